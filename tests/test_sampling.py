"""sampling.py against trusted references: completion log-probs against a full log-softmax
(chunked head, shared prompts, gradients), greedy decoding against HF `generate`, the sampling
filters, generation masks and truncation flags, reward-model scores at the last real token, and
the form in which reward functions receive completions."""

import pytest
import torch

import common
from rlhf import data
from rlhf import sampling
from worlds import world


# ------------------------------------------------------------------ log-probs
def _naive_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=sampling.position_ids(mask)).logits
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
    p_ids, p_mask = data.encode_prompts(tok, prompts)
    c_ids, c_mask = data.encode_completions(tok, [" alice bought bike .", " bob lost phone . nobody knows"])
    assert p_mask[0, 0] == 0 and c_mask[0, -1] == 0  # left- and right-padding are both exercised
    lp, ent = sampling.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature=0.7,
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
    p_ids, p_mask = data.encode_prompts(tok, prompts)
    c_ids, c_mask = data.encode_completions(tok, [" alice bought bike .", " alice .", " bob lost phone . nobody knows",
                                                    " bob ."])  # rows 0, 1 continue prompt 0; rows 2, 3 prompt 1
    weight = model.model.layers[0].self_attn.k_proj.weight
    lp = sampling.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature=0.7)
    (g_shared,) = torch.autograd.grad(lp.sum(), weight)
    ref_lp, _ = _naive_logprobs(model, p_ids.repeat_interleave(2, 0), p_mask.repeat_interleave(2, 0), c_ids, c_mask, 0.7)
    (g_ref,) = torch.autograd.grad(ref_lp.sum(), weight)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_shared, g_ref, atol=1e-5, rtol=1e-4)
    assert g_ref.abs().sum() > 0  # the prompt's keys get gradient through the shared cache


def test_generate_greedy_matches_hf_generate():
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2)
    ids, mask = data.encode_prompts(tok, ["POST: alice bought the bike .\nTL;DR:",
                                            "POST: i think bob lost the red phone . we had a lot of fun .\nTL;DR:"])
    c, cm, _ = sampling.generate(model, tok, ids, mask, max_new_tokens=8, do_sample=False, num_return_sequences=3)
    hf = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8,
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, ids.shape[1]:]
    hf = hf[:, :c.shape[1]].repeat_interleave(3, 0).masked_fill(cm == 0, tok.pad_token_id)
    assert torch.equal(c, hf)  # rows 3i..3i+2 are prompt i's, all equal under greedy decoding


def test_sampling_filters_keep_top_k_and_the_nucleus():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)
    torch.manual_seed(0)
    assert set(sampling._next_token(logits, 1.0, 1.0, 2, True).tolist()) == {0, 1}
    probs = logits[0].softmax(-1)  # 0.64, 0.23, 0.09, ...: the 0.8-nucleus is the first two tokens
    assert set(sampling._next_token(logits, 1.0, 0.8, 0, True).tolist()) == {0, 1}
    assert set(sampling._next_token(logits, 1.0, float(probs[0]) - 1e-3, 0, True).tolist()) == {0}
    assert sampling._next_token(logits, 1.0, 1.0, 0, False).eq(0).all()
    full = sampling._next_token(logits, 1.0, 1.0, 0, True)
    assert abs((full == 2).float().mean() - probs[2]) < 0.03  # plain sampling follows the softmax


def test_exponential_race_samples_the_softmax():
    """argmax p / Exp(1) draws token v with probability p_v: frequencies over 40,000 draws are
    within 4 standard errors of the softmax, for every token."""
    logits = torch.tensor([[1.5, 1.0, 0.2, -0.5, -3.0]]).repeat(40_000, 1)
    probs = logits[0].softmax(-1)
    noise = torch.rand(logits.shape, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(sampling._next_token(logits, 1.0, 1.0, 0, True, noise=noise), minlength=5) / 40_000
    assert ((freq - probs).abs() <= 4 * (probs * (1 - probs) / 40_000).sqrt() + 1e-4).all(), (freq, probs)


def test_seeded_samples_of_rank_shards_equal_the_whole_batch(tiny_qwen, monkeypatch):
    """generate(seed=s) on N ranks, each with its contiguous shard of the prompts, samples what one
    process samples for the whole batch (each row's noise is keyed by seed, step and global row);
    the same seed samples the same again, another seed something else."""
    from rlhf import parallel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen)
    prompts = [f"POST: bob sold the car {i} . TL;DR:" for i in range(4)]
    ids, mask = data.encode_prompts(tok, prompts)

    def sample(rows, seed):
        out, out_mask, _ = sampling.generate(model, tok, ids[rows], mask[rows], 6, 1.0, num_return_sequences=3, seed=seed)
        return [o[m.bool()].tolist() for o, m in zip(out, out_mask)]

    whole = sample(slice(0, 4), 7)
    assert sample(slice(0, 4), 7) == whole and sample(slice(0, 4), 8) != whole
    monkeypatch.setattr(parallel, "world_size", lambda: 2)
    shards = []
    for r in (0, 1):
        monkeypatch.setattr(parallel, "rank", lambda r=r: r)
        shards += sample(slice(2 * r, 2 * r + 2), 7)
    assert shards == whole


def test_each_rank_draws_only_its_own_rows_noise(tiny_qwen, monkeypatch):
    """Rank 3 of 8 with 6 rows draws (6, vocab) uniforms per decoding step, not (8 x 6, vocab)."""
    from rlhf import parallel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen)
    ids, mask = data.encode_prompts(tok, ["POST: bob sold the car . TL;DR:", "POST: alice lost it . TL;DR:"])
    monkeypatch.setattr(parallel, "world_size", lambda: 8)
    monkeypatch.setattr(parallel, "rank", lambda: 3)
    drawn, rand = [], torch.rand

    def counting_rand(*shape, generator=None, **kw):
        if generator is not None:
            drawn.append(torch.Size(shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape).numel())
        return rand(*shape, generator=generator, **kw)

    monkeypatch.setattr(torch, "rand", counting_rand)
    _, c_mask, _ = sampling.generate(model, tok, ids, mask, 4, 1.0, num_return_sequences=3, seed=7)
    vocab = model.get_output_embeddings().weight.shape[0]
    steps = c_mask.shape[1]
    assert max(drawn) <= 6 * vocab and sum(drawn) == steps * 6 * vocab


# ------------------------------------------------------------------ generation
def test_generate_masks_after_eos_and_flags_truncation(tmp_path):
    from conftest import uniform_words_model
    from transformers import AutoModelForCausalLM

    tok = uniform_words_model(tmp_path)  # EOS with probability ~0.2 per token: likely, not certain
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids, mask = data.encode_prompts(tok, ["POST: alice bought the bike .\nTL;DR:"] * 16)
    torch.manual_seed(0)
    c, cm, truncated = sampling.generate(model, tok, ids, mask, max_new_tokens=6, temperature=1.0)
    assert 0 < truncated.sum() < 16  # both cases below occur
    for row, m, tr in zip(c.tolist(), cm.tolist(), truncated.tolist()):
        n = sum(m)
        assert m == [1] * n + [0] * (len(m) - n)
        assert all(t == tok.pad_token_id for t in row[n:])
        if tr:
            assert tok.eos_token_id not in row[:n] and n == 6
        else:
            assert row[n - 1] == tok.eos_token_id and tok.eos_token_id not in row[:n - 1]


def test_sequence_scores_read_the_last_real_token():
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = world.build_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(cfg).eval()
    prompts, completions = ["POST: alice bought the bike .\nTL;DR:", "POST: bob lost it .\nTL;DR:"], [" alice .", " bob lost phone ."]
    batch = sampling.reward_model_scores(rm, tok, prompts, completions)
    for i in range(2):  # each alone, without any padding
        ids = tok(prompts[i] + completions[i])["input_ids"] + [tok.eos_token_id]
        alone = rm(input_ids=torch.tensor([ids])).logits[0, 0]
        assert batch[i].item() == pytest.approx(alone.item(), abs=1e-5)


def test_reward_completions_take_trls_form():
    """Text prompts get the text; conversational prompts one assistant message (TRL's form)."""
    conversation = [{"role": "user", "content": "hi"}]
    assert sampling.reward_completions(["POST: x TL;DR:"], [" alice ."]) == [" alice ."]
    assert sampling.reward_completions([conversation], [" alice ."]) == [[{"role": "assistant", "content": " alice ."}]]


# ------------------------------------------------------------------ stop tokens
def test_stop_token_ids_are_the_union_of_eos_and_the_generation_config():
    from transformers import GenerationConfig, Qwen2Config

    tok = world.build_tokenizer()  # EOS 1
    assert sampling.stop_token_ids(GenerationConfig(eos_token_id=7), tok) == [1, 7]
    assert sampling.stop_token_ids(GenerationConfig(eos_token_id=[9, 1, 7]), tok) == [1, 7, 9]
    assert sampling.stop_token_ids(GenerationConfig(), tok) == [1]
    model = world.build_model(tok, hidden_size=32, num_layers=1)
    model.generation_config.eos_token_id = [1, 8]
    assert sampling.stop_token_ids(model, tok) == [1, 8]
    assert sampling.stop_token_ids(Qwen2Config(eos_token_id=5), tok) == [1, 5]  # a config (a reward model's)


def test_a_completion_ending_in_a_stop_token_gets_no_extra_eos():
    tok = world.build_tokenizer()
    tok.add_tokens(["<|end|>"], special_tokens=True)  # stands for an end-of-turn token such as <|eot_id|>
    stop = tok.convert_tokens_to_ids("<|end|>")
    ids, mask = data.encode_completions(tok, [" alice .<|end|>", " alice ."], stop_ids=[tok.eos_token_id, stop])
    assert ids[0, :3].tolist() == tok(" alice .", add_special_tokens=False)["input_ids"] + [stop]
    assert mask.sum(1).tolist() == [3, 3] and ids[1, 2] == tok.eos_token_id
    ids, mask = data.encode_completions(tok, [" alice .<|end|>"])  # EOS alone stops: EOS is added
    assert ids[0].tolist()[-2:] == [stop, tok.eos_token_id]
    ids, mask = data.encode_completions(tok, [" alice .<|end|>\n"], stop_ids=[stop])  # Qwen's "<|im_end|>\n"
    assert ids[0].tolist()[-2:] == [stop, tok.convert_tokens_to_ids("Ċ")] and mask.sum() == 4


def test_a_generation_config_stop_token_ends_the_completion():
    """generate stops at any of stop_token_ids: a token listed only in the model's generation
    config (an end-of-turn such as <|eot_id|>) ends the completion, is kept in it, and is not a
    truncation. (tests/test_architectures.py repeats this per architecture, against HF generate.)"""
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2)
    ids, mask = data.encode_prompts(tok, ["POST: alice bought the bike .\nTL;DR:", "POST: bob lost it .\nTL;DR:"])
    c, cm, truncated = sampling.generate(model, tok, ids, mask, max_new_tokens=6, do_sample=False)
    assert truncated.all()  # greedy random weights never say EOS here: only the new stop token can end a row
    stop = c[0, 2].item()  # row 0's third greedy token
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    c, cm, truncated = sampling.generate(model, tok, ids, mask, max_new_tokens=6, do_sample=False)
    n = int(cm[0].sum())
    assert n <= 3 and c[0, n - 1] == stop and not truncated[0]
    assert (c[0, n:] == tok.pad_token_id).all() and cm[0, n:].sum() == 0
