"""common.py against trusted references: log-probs, the 8-bit optimizer, bf16 fidelity,
data loading on every format and on malformed input, generation masks, checkpoints."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

import common
import world


def _args(**kw):
    base = dict(learning_rate=1e-2, weight_decay=0.0, optim="adamw_8bit", dtype="float32",
                attn_implementation="sdpa", trust_remote_code=False, gradient_checkpointing=False,
                output_dir="", report_to="none", eval_batch_size=16)
    return SimpleNamespace(**{**base, **kw})


# ------------------------------------------------------------------ log-probs
def _naive_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=common.position_ids(mask)).logits
    logits = logits[:, prompt_ids.shape[1] - 1:-1].float() / temperature  # full (B, C, V) softmax
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, completion_ids[..., None]).squeeze(-1) * completion_mask
    ent = -(logp.exp() * logp).sum(-1) * completion_mask
    return lp, ent


@pytest.mark.parametrize("chunk_tokens", [None, 3])
def test_completion_logprobs_match_full_softmax(chunk_tokens):
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2)
    prompts = ["POST: alice bought the bike .\nTL;DR:", "POST: i think bob lost the red phone . we had a lot of fun .\nTL;DR:"]
    p_ids, p_mask = common.encode_prompts(tok, prompts)
    c_ids, c_mask = common.encode_completions(tok, [" alice bought bike .", " bob lost phone . nobody knows"])
    assert p_mask[0, 0] == 0 and c_mask[0, -1] == 0  # left- and right-padding are both exercised
    lp, ent = common.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature=0.7,
                                         with_entropy=True, chunk_tokens=chunk_tokens)
    ref_lp, ref_ent = _naive_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature=0.7)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    assert (lp[c_mask == 0] == 0).all()
    # gradients agree too (the chunks are checkpointed)
    g1 = torch.autograd.grad(lp.sum(), model.model.layers[0].self_attn.q_proj.weight)[0]
    lp2, _ = _naive_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature=0.7)
    g2 = torch.autograd.grad(lp2.sum(), model.model.layers[0].self_attn.q_proj.weight)[0]
    torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prompts_match_repeated_prompts(checkpointing):
    """k completions per prompt: one prompt pass whose KV cache is repeated gives the same
    log-probs and gradients as k copies of the prompt (with checkpointing: the repeat fallback)."""
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2)
    if checkpointing:
        common.enable_checkpointing(model)
    model.train()
    prompts = ["POST: alice bought the bike .\nTL;DR:", "POST: i think bob lost the red phone . we had a lot of fun .\nTL;DR:"]
    p_ids, p_mask = common.encode_prompts(tok, prompts)
    c_ids, c_mask = common.encode_completions(tok, [" alice bought bike .", " alice .", " bob lost phone . nobody knows",
                                                    " bob ."])  # rows 0, 1 continue prompt 0; rows 2, 3 prompt 1
    weight = model.model.layers[0].self_attn.k_proj.weight
    lp = common.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature=0.7)
    (g_shared,) = torch.autograd.grad(lp.sum(), weight)
    ref_lp, _ = _naive_logprobs(model, p_ids.repeat_interleave(2, 0), p_mask.repeat_interleave(2, 0), c_ids, c_mask, 0.7)
    (g_ref,) = torch.autograd.grad(ref_lp.sum(), weight)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_shared, g_ref, atol=1e-5, rtol=1e-4)
    assert g_ref.abs().sum() > 0  # the prompt's keys get gradient through the shared cache


def test_generate_greedy_matches_hf_generate():
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2)
    ids, mask = common.encode_prompts(tok, ["POST: alice bought the bike .\nTL;DR:",
                                            "POST: i think bob lost the red phone . we had a lot of fun .\nTL;DR:"])
    c, cm, _ = common.generate(model, tok, ids, mask, max_new_tokens=8, do_sample=False, num_return_sequences=3)
    hf = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8,
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, ids.shape[1]:]
    hf = hf[:, :c.shape[1]].repeat_interleave(3, 0).masked_fill(cm == 0, tok.pad_token_id)
    assert torch.equal(c, hf)  # rows 3i..3i+2 are prompt i's, all equal under greedy decoding


def test_sampling_filters_keep_top_k_and_the_nucleus():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)
    torch.manual_seed(0)
    assert set(common._next_token(logits, 1.0, 1.0, 2, True).tolist()) == {0, 1}
    probs = logits[0].softmax(-1)  # 0.64, 0.23, 0.09, ...: the 0.8-nucleus is the first two tokens
    assert set(common._next_token(logits, 1.0, 0.8, 0, True).tolist()) == {0, 1}
    assert set(common._next_token(logits, 1.0, float(probs[0]) - 1e-3, 0, True).tolist()) == {0}
    assert common._next_token(logits, 1.0, 1.0, 0, False).eq(0).all()
    full = common._next_token(logits, 1.0, 1.0, 0, True)
    assert abs((full == 2).float().mean() - probs[2]) < 0.03  # plain sampling follows the softmax


def test_encode_pads_and_eos():
    tok = world.build_tokenizer()
    ids, mask = common.encode_prompts(tok, ["POST: a b", "POST: alice bought the bike . TL;DR:"], max_length=4)
    assert ids.shape == (2, 4) and mask[0].tolist() == [0, 1, 1, 1] and mask[1].tolist() == [1, 1, 1, 1]
    assert ids[1, -1] == tok.convert_tokens_to_ids("TL;DR:")  # too-long prompts keep their end
    c, cm = common.encode_completions(tok, [" alice", " alice bought bike ."])
    assert c[0].tolist()[:2] == [tok.convert_tokens_to_ids("alice"), tok.eos_token_id]
    assert cm[0].tolist() == [1, 1, 0, 0, 0] and c[0, 2] == tok.pad_token_id
    assert c[1, -1] == tok.eos_token_id


# ------------------------------------------------------------------ optimizer
def test_adamw_8bit_tracks_torch_adamw():
    torch.manual_seed(0)
    w0 = torch.randn(128, 128)
    grads = [torch.randn(128, 128) for _ in range(10)]
    finals = {}
    for optim in ("adamw_8bit", "adamw"):
        p = torch.nn.Parameter(w0.clone())
        opt = common.make_optimizer(torch.nn.ParameterList([p]), _args(optim=optim, weight_decay=0.01))
        for g in grads:
            p.grad = g.clone()
            common.optimizer_step(opt)
        finals[optim] = p.detach()
    moved = (finals["adamw"] - w0).abs().mean()
    err = (finals["adamw_8bit"] - finals["adamw"]).abs().mean()
    assert moved > 0.02
    assert err < 0.05 * moved, (err, moved)


def test_adamw_8bit_states_are_uint8():
    p = torch.nn.Parameter(torch.randn(128, 128))
    opt = common.make_optimizer(torch.nn.ParameterList([p]), _args())
    p.grad = torch.randn_like(p)
    common.optimizer_step(opt)
    assert opt.state[p]["state1"].dtype == torch.uint8
    assert common.optimizer_state_bytes(opt) < 128 * 128 * 3  # vs 8 bytes/param for fp32 AdamW


def test_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    src = torch.full((200_000,), 1.0 + 1e-3)  # between two bf16 values (ulp 2**-7 ~ 7.8e-3)
    dst = torch.empty_like(src, dtype=torch.bfloat16)
    common.stochastic_round_(dst, src)
    assert set(dst.float().unique().tolist()) == {1.0, 1.0078125}
    assert dst.float().mean().item() == pytest.approx(1.0 + 1e-3, abs=5e-5)


@pytest.mark.parametrize("optim", ["adamw_8bit", "adamw"])
def test_bf16_weights_keep_small_updates(optim):
    """lr 1e-6 on bf16 weights of size ~1: round-to-nearest loses every update; ours does not."""
    torch.manual_seed(0)
    w0 = (1 + torch.rand(64, 128)).to(torch.bfloat16)
    g = torch.ones(64, 128)  # Adam moves each weight by ~lr per step
    steps = 200
    p = torch.nn.Parameter(w0.clone())
    opt = common.make_optimizer(torch.nn.ParameterList([p]), _args(optim=optim, learning_rate=1e-6))
    for _ in range(steps):
        p.grad = g.to(torch.bfloat16)
        common.optimizer_step(opt)
    assert p.dtype == torch.bfloat16
    drift = (w0.float() - p.float()).mean().item()
    assert drift == pytest.approx(steps * 1e-6, rel=0.1)  # fp32 would move exactly lr * steps
    # the naive path (the optimizer straight on bf16 weights) loses the updates
    q = torch.nn.Parameter(w0.clone())
    naive = common.make_optimizer(torch.nn.ParameterList([q]), _args(optim=optim, learning_rate=1e-6))
    for _ in range(steps):
        q.grad = g.to(torch.bfloat16)
        naive.step()
    assert (w0.float() - q.float()).mean().item() < 0.2 * steps * 1e-6


# ------------------------------------------------------------------ data
def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


@pytest.fixture()
def chat_tokenizer():
    from conftest import CHAT_TEMPLATE

    tok = world.build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_prompt_completion_jsonl(tmp_path, chat_tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "POST: a", "completion": " alice ."}] * 3)
    pairs = common.sft_pairs(common.load_data(path), path)
    assert pairs[0] == ("POST: a", " alice .")


def test_messages_format(tmp_path, chat_tokenizer):
    msgs = [{"role": "user", "content": "alice bought the bike"}, {"role": "assistant", "content": "alice bought bike ."}]
    path = _write_jsonl(tmp_path / "m.jsonl", [{"messages": msgs}])
    (prompt, completion), = common.sft_pairs(common.load_data(path), path)
    assert common.render_prompt(chat_tokenizer, prompt) == "<|user|> alice bought the bike <|assistant|>"
    assert common.render_completion(chat_tokenizer, prompt, completion) == " alice bought bike . <eos> "


def test_preference_formats(tmp_path):
    std = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "chosen": " a", "rejected": " b"}])
    assert common.preference_triples(common.load_data(std), std) == [("x", " a", " b")]
    u = {"role": "user", "content": "x"}
    conv = _write_jsonl(tmp_path / "c.jsonl", [{"prompt": [u], "chosen": [{"role": "assistant", "content": "a"}],
                                                 "rejected": [{"role": "assistant", "content": "b"}]}])
    (p, c, r), = common.preference_triples(common.load_data(conv), conv)
    assert p == [u] and c[0]["content"] == "a"
    implicit = _write_jsonl(tmp_path / "i.jsonl", [{"chosen": [u, {"role": "assistant", "content": "a"}],
                                                     "rejected": [u, {"role": "assistant", "content": "b"}]}])
    (p, c, r), = common.preference_triples(common.load_data(implicit), implicit)
    assert p == [u] and r[0]["content"] == "b"


def test_prompt_only_keeps_extra_columns(tmp_path):
    path = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "2+2=", "answer": "4"}])
    ds = common.load_data(path)
    common.require_columns(ds, ["prompt"], path)
    assert ds[0]["answer"] == "4"


def test_parquet_and_folder(tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"prompt": "x", "completion": " y"}]).to_parquet(str(tmp_path / "d.parquet"))
    assert len(common.load_data(str(tmp_path / "d.parquet"))) == 1
    folder = tmp_path / "folder"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", [{"prompt": "x", "completion": " y"}] * 2)
    assert len(common.load_data(str(folder))) == 2


def _error(fn, *a):
    with pytest.raises(SystemExit) as e:
        fn(*a)
    return str(e.value)


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x", "completion": "y"}, '{"prompt": "x", '])
    msg = _error(common.load_data, path)
    assert "bad.jsonl" in msg and "line 2" in msg
    path = _write_jsonl(tmp_path / "list.jsonl", ["[1, 2]"])
    assert "line 1" in _error(common.load_data, path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "empty" in _error(common.load_data, str(empty))
    assert "does not exist" in _error(common.load_data, str(tmp_path / "missing.jsonl"))


def test_missing_column_and_bad_row_are_named(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "answer": "y"}])
    msg = _error(common.sft_pairs, common.load_data(path), path)
    assert "'completion'" in msg and "d.jsonl" in msg
    msg = _error(common.preference_triples, common.load_data(path), path)
    assert "'chosen'" in msg
    path = _write_jsonl(tmp_path / "e.jsonl", [{"prompt": "x", "completion": "y"}, {"prompt": "x", "completion": ""}])
    msg = _error(common.sft_pairs, common.load_data(path), path)
    assert "row 1" in msg and "'completion'" in msg


def test_batch_indices_cycle_through_epochs():
    seen = [i for step in range(5) for i in common.batch_indices(10, 4, seed=1, step=step)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert seen[:10] != seen[10:20]  # a fresh order each epoch
    assert common.batch_indices(10, 4, seed=1, step=3) == seen[12:16]  # stateless: resumable


# ------------------------------------------------------------------ generation
def test_generate_masks_after_eos_and_flags_truncation():
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2)
    with torch.no_grad():  # make EOS likely after a couple of tokens but not certain
        model.lm_head.weight[tok.eos_token_id] *= 0
    ids, mask = common.encode_prompts(tok, ["POST: alice bought the bike .\nTL;DR:"] * 16)
    torch.manual_seed(0)
    c, cm, truncated = common.generate(model, tok, ids, mask, max_new_tokens=6, temperature=1.0)
    for row, m, tr in zip(c.tolist(), cm.tolist(), truncated.tolist()):
        n = sum(m)
        assert m == [1] * n + [0] * (len(m) - n)
        assert all(t == tok.pad_token_id for t in row[n:])
        if tr:
            assert tok.eos_token_id not in row[:n] and n == 6
        else:
            assert row[n - 1] == tok.eos_token_id and tok.eos_token_id not in row[:n - 1]


# ------------------------------------------------------------------ checkpoints and memory
def test_checkpoints_load_with_automodel(tmp_path, tiny_qwen):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen)
    args = _args(output_dir=str(tmp_path / "out"))
    os.makedirs(args.output_dir)
    common.save_checkpoint(model, tok, args, f"{args.output_dir}/checkpoint-1", state={"step": 1})
    common.save_checkpoint(model, tok, args, f"{args.output_dir}/checkpoint-1", state={"step": 1})  # overwrite
    common.save_final(model, tok, args)
    for folder in (f"{args.output_dir}/checkpoint-1", args.output_dir):
        again = AutoModelForCausalLM.from_pretrained(folder)
        assert torch.equal(again.lm_head.weight, model.lm_head.weight)
        assert json.load(open(f"{folder}/args.json"))["output_dir"] == args.output_dir
    assert sorted(os.listdir(args.output_dir)) == sorted(
        ["checkpoint-1", "args.json", "config.json", "generation_config.json", "model.safetensors",
         "tokenizer.json", "tokenizer_config.json"])


def test_tensor_bytes_counts_tied_weights_once(tiny_qwen):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen)
    n_params = sum(p.numel() for p in model.parameters())  # parameters() deduplicates tied ones
    assert common.tensor_bytes(model) >= 4 * n_params
    assert common.tensor_bytes(list(model.parameters())) == 4 * n_params


# ------------------------------------------------------------------ rewards
def test_reward_fn_from_file_gets_extra_columns(tmp_path):
    f = tmp_path / "rewards.py"
    f.write_text("def fn(prompts, completions, answer, **kw):\n"
                 "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n"
                 "def bad(prompts, completions, **kw):\n"
                 "    return [1 / len(p.split('=')[1]) for p in prompts]\n")
    fn = common.load_reward_fn(f"{f}:fn")
    r = common.call_reward_fn(fn, ["2+2=", "3+3="], [" 4", " 5"], {"answer": ["4", "6"]})
    assert r.tolist() == [1.0, 0.0]
    msg = _error(common.call_reward_fn, common.load_reward_fn(f"{f}:bad"), ["1+1=2", "2+2="], ["a", "b"])
    assert "ZeroDivisionError" in msg and "prompt 1" in msg and "2+2=" in msg
    assert "defines no function" in _error(common.load_reward_fn, f"{f}:nope")
    assert "does not exist" in _error(common.load_reward_fn, "missing.py:fn")
    assert "2 values for 1" in _error(common.call_reward_fn, lambda p, c: [1, 2], ["x"], ["y"])
    assert "finite" in _error(common.call_reward_fn, lambda p, c: [float("nan")], ["x"], ["y"])
    assert common.load_reward_fn("gold") is world.gold_reward


def test_sequence_scores_read_the_last_real_token():
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = world.build_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(cfg).eval()
    prompts, completions = ["POST: alice bought the bike .\nTL;DR:", "POST: bob lost it .\nTL;DR:"], [" alice .", " bob lost phone ."]
    batch = common.reward_model_scores(rm, tok, prompts, completions)
    for i in range(2):  # each alone, without any padding
        ids = tok(prompts[i] + completions[i])["input_ids"] + [tok.eos_token_id]
        alone = rm(input_ids=torch.tensor([ids])).logits[0, 0]
        assert batch[i].item() == pytest.approx(alone.item(), abs=1e-5)


def test_load_tokenizer_round_trips_the_world_tokenizer(tmp_path):
    """A saved world model reloads with its own word-level tokenizer, not the model type's."""
    tok = world.build_tokenizer()
    world.build_model(tok, hidden_size=64, num_layers=1).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = common.load_tokenizer(str(tmp_path))
    text = "POST: alice bought the bike . TL;DR: alice bought bike ."
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(tok(text)["input_ids"]) == text
