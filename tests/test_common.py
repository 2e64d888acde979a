"""common.py against trusted references: the 8-bit optimizer, bf16 fidelity,
data loading on every format and on malformed input, checkpoints, reward functions."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from rlhf import basics
from rlhf import checkpoints
import common
from rlhf import data
from rlhf import memory
from worlds import world


def _args(**kw):
    base = dict(learning_rate=1e-2, weight_decay=0.0, optim="adamw_8bit", dtype="float32",
                attn_implementation="sdpa", trust_remote_code=False, gradient_checkpointing=False,
                output_dir="", report_to="none", eval_batch_size=16)
    return SimpleNamespace(**{**base, **kw})


def test_encode_pads_and_eos():
    tok = world.build_tokenizer()
    ids, mask = data.encode_prompts(tok, ["POST: a", "POST: alice bought the bike . TL;DR:"], max_length=4)
    # "POST:" and " a" are one token each (added tokens), padded on the left
    assert ids.shape == (2, 4) and mask[0].tolist() == [0, 0, 1, 1] and mask[1].tolist() == [1, 1, 1, 1]
    assert ids[0, :2].tolist() == [tok.pad_token_id] * 2 and tok.convert_ids_to_tokens(ids[0, 2:]) == ["POST:", " a"]
    assert tok.convert_ids_to_tokens(ids[1, -3:]) == [" .", "Ġ", "TL;DR:"]  # too-long prompts keep their end
    c, cm = data.encode_completions(tok, [" alice", " alice bought bike ."])
    assert c[0].tolist()[:2] == [tok.convert_tokens_to_ids(" alice"), tok.eos_token_id]
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
    assert memory.optimizer_state_bytes(opt) < 128 * 128 * 3  # vs 8 bytes/param for fp32 AdamW


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
    import conftest

    return conftest.chat_tokenizer()


def test_prompt_completion_jsonl(tmp_path, chat_tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "POST: a", "completion": " alice ."}] * 3)
    pairs = data.sft_pairs(data.load_data(path), path)
    assert pairs[0] == ("POST: a", " alice .")


def test_messages_format(tmp_path, chat_tokenizer):
    msgs = [{"role": "user", "content": "alice bought the bike"}, {"role": "assistant", "content": "alice bought bike ."}]
    path = _write_jsonl(tmp_path / "m.jsonl", [{"messages": msgs}])
    (prompt, completion), = data.sft_pairs(data.load_data(path), path)
    assert data.render_prompt(chat_tokenizer, prompt) == "<|user|> alice bought the bike <|assistant|>"
    assert data.render_completion(chat_tokenizer, prompt, completion) == " alice bought bike . <eos> "


def test_preference_formats(tmp_path):
    std = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "chosen": " a", "rejected": " b"}])
    assert data.preference_triples(data.load_data(std), std) == [("x", " a", " b")]
    u = {"role": "user", "content": "x"}
    conv = _write_jsonl(tmp_path / "c.jsonl", [{"prompt": [u], "chosen": [{"role": "assistant", "content": "a"}],
                                                 "rejected": [{"role": "assistant", "content": "b"}]}])
    (p, c, r), = data.preference_triples(data.load_data(conv), conv)
    assert p == [u] and c[0]["content"] == "a"
    implicit = _write_jsonl(tmp_path / "i.jsonl", [{"chosen": [u, {"role": "assistant", "content": "a"}],
                                                     "rejected": [u, {"role": "assistant", "content": "b"}]}])
    (p, c, r), = data.preference_triples(data.load_data(implicit), implicit)
    assert p == [u] and r[0]["content"] == "b"


def test_prompt_only_keeps_extra_columns(tmp_path):
    path = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "2+2=", "answer": "4"}])
    ds = data.load_data(path)
    data.require_columns(ds, ["prompt"], path)
    assert ds[0]["answer"] == "4"


def test_parquet_and_folder(tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"prompt": "x", "completion": " y"}]).to_parquet(str(tmp_path / "d.parquet"))
    assert len(data.load_data(str(tmp_path / "d.parquet"))) == 1
    folder = tmp_path / "folder"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", [{"prompt": "x", "completion": " y"}] * 2)
    assert len(data.load_data(str(folder))) == 2


def _error(fn, *a):
    with pytest.raises(SystemExit) as e:
        fn(*a)
    return str(e.value)


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x", "completion": "y"}, '{"prompt": "x", '])
    msg = _error(data.load_data, path)
    assert "bad.jsonl" in msg and "line 2" in msg
    path = _write_jsonl(tmp_path / "list.jsonl", ["[1, 2]"])
    assert "line 1" in _error(data.load_data, path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "empty" in _error(data.load_data, str(empty))
    assert "does not exist" in _error(data.load_data, str(tmp_path / "missing.jsonl"))


def test_missing_column_and_bad_row_are_named(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "answer": "y"}])
    msg = _error(data.sft_pairs, data.load_data(path), path)
    assert "'completion'" in msg and "d.jsonl" in msg
    msg = _error(data.preference_triples, data.load_data(path), path)
    assert "'chosen'" in msg
    path = _write_jsonl(tmp_path / "e.jsonl", [{"prompt": "x", "completion": "y"}, {"prompt": "x", "completion": ""}])
    msg = _error(data.sft_pairs, data.load_data(path), path)
    assert "row 1" in msg and "'completion'" in msg


def test_eval_dataset_names_an_embedded_worlds_test_split():
    """--eval_dataset embedded (embedded:arith, embedded:code): the world's held-out test split of
    that --seed, prompts disjoint from its training splits; a file is still read as before."""
    ds = data.eval_data(SimpleNamespace(eval_dataset="embedded", seed=0))
    world0 = common.embedded_world(0)
    assert ds["prompt"] == world0["test"]["prompt"] and "post" in ds.column_names
    assert not set(ds["prompt"]) & set(world0["rl"]["prompt"])
    assert data.eval_data(SimpleNamespace(eval_dataset="", seed=0)) is None


def test_batch_indices_cycle_through_epochs():
    seen = [i for step in range(5) for i in data.batch_indices(10, 4, seed=1, step=step)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert seen[:10] != seen[10:20]  # a fresh order each epoch
    assert data.batch_indices(10, 4, seed=1, step=3) == seen[12:16]  # stateless: resumable


# ------------------------------------------------------------------ checkpoints and memory
def test_checkpoints_load_with_automodel(tmp_path, tiny_qwen):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen)
    args = _args(output_dir=str(tmp_path / "out"))
    os.makedirs(args.output_dir)
    checkpoints.save_checkpoint(model, tok, args, f"{args.output_dir}/checkpoint-1", state={"step": 1})
    checkpoints.save_checkpoint(model, tok, args, f"{args.output_dir}/checkpoint-1", state={"step": 1})  # overwrite
    checkpoints.save_final(model, tok, args)
    for folder in (f"{args.output_dir}/checkpoint-1", args.output_dir):
        again = AutoModelForCausalLM.from_pretrained(folder)
        assert torch.equal(again.lm_head.weight, model.lm_head.weight)
        assert json.load(open(f"{folder}/args.json"))["output_dir"] == args.output_dir
    assert sorted(os.listdir(args.output_dir)) == sorted(
        ["checkpoint-1", "args.json", "config.json", "generation_config.json", "input_hashes.json", "model.safetensors",
         "tokenizer.json", "tokenizer_config.json"])


def test_tensor_bytes_counts_tied_weights_once(tiny_qwen):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen)
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head is embedding or head.data_ptr() == embedding.data_ptr()  # the world's model ties them
    n_params = sum(p.numel() for p in model.parameters())  # parameters() deduplicates tied ones
    assert memory.tensor_bytes(list(model.parameters())) == 4 * n_params
    # listed twice (the head and the embedding, as a state_dict lists them): still counted once
    assert memory.tensor_bytes(list(model.parameters()) + [head]) == 4 * n_params
    assert memory.tensor_bytes([embedding, head[:10]]) == 4 * embedding.numel()  # a view shares its storage


# ------------------------------------------------------------------ rewards
def test_reward_fn_from_file_gets_extra_columns(tmp_path):
    f = tmp_path / "rewards.py"
    f.write_text("def fn(prompts, completions, answer, **kw):\n"
                 "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n"
                 "def bad(prompts, completions, **kw):\n"
                 "    return [1 / len(p.split('=')[1]) for p in prompts]\n")
    fn = common.load_reward_fn(f"{f}:fn")
    r = common.call_reward_fns([fn], ["2+2=", "3+3="], [" 4", " 5"], None, {"answer": ["4", "6"]})[:, 0]
    assert r.tolist() == [1.0, 0.0]
    msg = _error(common.call_reward_fns, [common.load_reward_fn(f"{f}:bad")], ["1+1=2", "2+2="], ["a", "b"])
    assert "ZeroDivisionError" in msg and "prompt 1" in msg and "2+2=" in msg
    assert "defines no function" in _error(common.load_reward_fn, f"{f}:nope")
    assert "does not exist" in _error(common.load_reward_fn, "missing.py:fn")
    assert "2 values for 1" in _error(common.call_reward_fns, [lambda completions, **kw: [1, 2]], ["x"], ["y"])
    assert "finite" in _error(common.call_reward_fns, [lambda completions, **kw: [float("nan")]], ["x"], ["y"])
    assert common.load_reward_fn("gold") is world.gold_reward


def test_load_tokenizer_round_trips_the_world_tokenizer(tmp_path):
    """A saved world model reloads with its own word-level tokenizer, not the model type's."""
    tok = world.build_tokenizer()
    world.build_model(tok, hidden_size=64, num_layers=1).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = common.load_tokenizer(str(tmp_path))
    text = "POST: alice bought the bike . TL;DR: alice bought bike ."
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(tok(text)["input_ids"]) == text


def test_a_gguf_file_is_not_read_from_a_folder_made_from_another_file(tmp_path):
    """--model path/to/file.gguf is dequantized once into path/to/file/ (rlhf/real_model.py); a folder
    there made from another file of that name (its source.json says so) is refused, not trained."""
    from rlhf import real_model

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": "0" * 64}))
    with pytest.raises(SystemExit, match="holds another model than this file"):
        real_model.gguf_folder(str(gguf))
    (tmp_path / "m" / "source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": basics.file_sha256(gguf)}))
    assert real_model.gguf_folder(str(gguf)) == str(tmp_path / "m")


def test_a_tied_embedding_trains_with_a_sparse_gradient_that_lands_dense(tiny_qwen, monkeypatch):
    """A trained model whose embedding is its head's weight gets a sparse embedding gradient
    (models.sparse_tied_embedding): autograd adds it into the head's dense one, so the weight's
    gradient is dense and equal to the dense embedding's; a backward that reaches only the
    embedding leaves a sparse gradient, which optimizer_step makes dense before the fused step.
    Frozen models, untied ones and several ranks keep the dense embedding."""
    from rlhf import models, parallel, sampling

    args = _args(optim="adamw", use_peft=False, load_in_4bit=False, load_in_8bit=False)
    model = common.load_model(tiny_qwen, args, adapters=True)
    embedding = model.get_input_embeddings()
    assert embedding.sparse and embedding.weight is model.get_output_embeddings().weight
    assert not common.load_model(tiny_qwen, args).get_input_embeddings().sparse  # a frozen reference's
    prompt, completions = torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9], [10, 8]])

    def gradient(sparse):
        embedding.sparse = sparse
        model.zero_grad(set_to_none=True)
        ones = torch.ones_like(completions)
        sampling.completion_logprobs(model, prompt, torch.ones_like(prompt), completions, ones).sum().backward()
        return embedding.weight.grad

    dense, sparse = gradient(False), gradient(True)
    assert not sparse.is_sparse and sparse.abs().sum() > 0
    torch.testing.assert_close(sparse, dense)
    steps = []
    for sparse in (True, False):  # the embedding alone: no head in this backward
        embedding.sparse, embedding.weight.grad = sparse, None
        start = embedding.weight.detach().clone()
        optimizer = torch.optim.AdamW([embedding.weight], lr=0.1, fused=True)
        embedding(torch.tensor([3, 4, 3])).pow(2).sum().backward()
        assert embedding.weight.grad.is_sparse == sparse
        common.optimizer_step(optimizer, 1.0)
        steps.append(embedding.weight.detach().clone())
        embedding.weight.data.copy_(start)
    torch.testing.assert_close(steps[0], steps[1])
    untied = world.build_model(world.build_tokenizer(), hidden_size=64, num_layers=2)
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    models.sparse_tied_embedding(untied)
    assert not untied.get_input_embeddings().sparse
    monkeypatch.setattr(parallel, "world_size", lambda: 2)
    tied = world.build_model(world.build_tokenizer(), hidden_size=64, num_layers=2)
    models.sparse_tied_embedding(tied)
    assert not tied.get_input_embeddings().sparse
