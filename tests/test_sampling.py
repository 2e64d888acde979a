"""sampling.py against trusted references: completion log-probs against a full log-softmax
(chunked head, shared prompts, gradients), greedy decoding against HF `generate`, the sampling
filters, generation masks and truncation flags, reward-model scores at the last real token, and
the form in which reward functions receive completions."""

import types

import pytest
import torch

import common
from rlhf import data
from rlhf import sampling
from worlds import world

prompt_rows = sampling.prompt_rows


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


def test_label_logprob_is_autograds_log_softmax_gather():
    """LabelLogprob's value and gradient, under any upstream gradient, are those of
    log_softmax(logits)[label], and its entropy is -(softmax * log_softmax).sum(); torch's
    gradcheck compares its backward with finite differences."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(5, 11, dtype=torch.float64) + 40).requires_grad_()  # far from 0: the max shift matters
    labels = torch.tensor([0, 3, 10, 3, 7])
    upstream = torch.randn(5, dtype=torch.float64)
    ours, entropy = sampling.LabelLogprob.apply(logits, labels, True)
    plain = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(ours, plain)
    torch.testing.assert_close(torch.autograd.grad(ours, logits, upstream)[0], torch.autograd.grad(plain, logits, upstream)[0])
    log_p = torch.log_softmax(logits.detach(), -1)
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1))
    assert not entropy.requires_grad
    assert sampling.LabelLogprob.apply(logits, labels, False)[1] is None
    assert torch.autograd.gradcheck(lambda x: sampling.LabelLogprob.apply(x, labels, False)[0], (logits,))


@pytest.mark.parametrize("checkpointing,attention", [(False, "sdpa"), (True, "sdpa"), (False, "eager"), (True, "eager")])
def test_shared_prompts_match_repeated_prompts(checkpointing, attention, monkeypatch):
    """k completions per prompt give the same log-probs and gradients as k copies of the prompt:
    on the CPU under sdpa as one row a prompt with a block mask (`prompt_rows`), elsewhere as one
    prompt pass whose KV cache is repeated (with checkpointing: the repeat fallback)."""
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2)
    model.set_attn_implementation(attention)
    rows, blocks = [], []
    monkeypatch.setattr(sampling, "prompt_rows", lambda *a: rows.append(1) or prompt_rows(*a))
    block_attention = sampling.prompt_block_attention
    monkeypatch.setattr(sampling, "prompt_block_attention",
                        lambda *a, **kw: blocks.append(kw["prompt_blocks"]) or block_attention(*a, **kw))
    monkeypatch.setattr(sampling, "BLOCK_ATTENTION_MIN_WORK", 0)  # blocks for this tiny model too
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
    assert rows == ([1] if attention == "sdpa" else [])
    # block by block in each of the 2 layers, but not under checkpointing (its recompute runs plain sdpa)
    # the model reads each completion but its last token, a label only (states_before)
    assert blocks == ([(p_ids.shape[1], 2, c_ids.shape[1] - 1)] * 2 if attention == "sdpa" and not checkpointing else [])


def test_blocks_that_skip_little_attention_keep_the_whole_mask(monkeypatch):
    """The one-row pass attends block by block only where the pairs the blocks skip, times the hidden
    size, reach BLOCK_ATTENTION_MIN_WORK: not for the embedded world's tiny model at its default."""
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2)
    p_ids, p_mask = data.encode_prompts(tok, ["POST: alice bought the bike .\nTL;DR:"])
    c_ids, c_mask = data.encode_completions(tok, [" alice bought bike .", " alice ."])
    P, C = p_ids.shape[1], c_ids.shape[1] - 1  # the model reads each completion but its last token (states_before)
    work = (P + 2 * C) ** 2 - (P * P + 2 * C * (P + C))  # one row: the whole mask's pairs less the blocks'
    work *= model.config.hidden_size
    blocks = []
    block_attention = sampling.prompt_block_attention
    monkeypatch.setattr(sampling, "prompt_block_attention",
                        lambda *a, **kw: blocks.append(1) or block_attention(*a, **kw))
    for threshold, used in ((sampling.BLOCK_ATTENTION_MIN_WORK, False), (work + 1, False), (work, True)):
        monkeypatch.setattr(sampling, "BLOCK_ATTENTION_MIN_WORK", threshold)
        blocks.clear()
        with torch.no_grad():
            sampling.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask)
        assert blocks == ([1] * 2 if used else []), threshold


def test_prompt_block_attention_is_sdpa_over_the_whole_block_mask():
    """prompt_block_attention's output and gradients equal transformers' sdpa over prompt_rows'
    whole (T, T) mask: left-padded prompts, completions of several lengths, grouped-query heads."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = {}

    def body(**kw):
        seen.update(kw)
        return types.SimpleNamespace(last_hidden_state=torch.zeros(kw["input_ids"].shape + (2,)))

    B, P, k, C, heads, kv_heads, D = 2, 3, 3, 4, 4, 2, 8
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_mask = (torch.arange(C) < torch.tensor([4, 2, 1, 3, 4, 1])[:, None]).long()
    sampling.prompt_rows(body, torch.ones(B, P, dtype=torch.long), prompt_mask, torch.ones(B * k, C, dtype=torch.long),
                         completion_mask)
    mask, T = seen["attention_mask"], P + k * C
    assert seen["prompt_blocks"] == (P, k, C) and mask.shape == (B, 1, T, T)
    torch.manual_seed(0)
    q, key, value = (torch.randn(B, n, T, D, requires_grad=True) for n in (heads, kv_heads, kv_heads))
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    ours, _ = sampling.prompt_block_attention(module, q, key, value, mask, prompt_blocks=(P, k, C), scaling=0.3)
    full, _ = sdpa_attention_forward(module, q, key, value, mask, scaling=0.3)
    assert ours.shape == full.shape == (B, T, heads, D)
    torch.testing.assert_close(ours, full)
    upstream = torch.randn_like(full)
    for a, b in zip(torch.autograd.grad(ours, (q, key, value), upstream), torch.autograd.grad(full, (q, key, value), upstream)):
        torch.testing.assert_close(a, b)
    plain, _ = sampling.prompt_block_attention(module, q, key, value, mask, scaling=0.3)  # no layout: plain sdpa
    torch.testing.assert_close(plain, full)


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


def test_decoding_runs_in_inference_mode_and_returns_tensors_autograd_can_save(monkeypatch):
    """The decoding loop's forwards run under inference mode (no version counters or views to track),
    but not on FSDP2-sharded weights, which gather under no_grad; what generate returns is plain
    tensors, which a training forward can save for its backward (an inference tensor cannot be)."""
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2)
    ids, mask = data.encode_prompts(tok, ["POST: alice bought the bike .\nTL;DR:", "POST: bob lost the phone .\nTL;DR:"])
    modes = []  # the embedding runs in every forward: the model's own and decoding's fused step (rlhf/decoding.py)
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: modes.append(torch.is_inference_mode_enabled()))
    out = sampling.generate(model, tok, ids, mask, 6, num_return_sequences=2, seed=0)
    assert len(modes) > 1 and all(modes)
    assert not any(torch.is_inference(x) for x in out)
    model.get_input_embeddings()(out[0]).sum().backward()  # raises for an inference tensor's indices
    modes.clear()
    monkeypatch.setattr(sampling.parallel, "is_sharded", lambda model: True)
    sharded = sampling.generate(model, tok, ids, mask, 6, num_return_sequences=2, seed=0)
    assert len(modes) > 1 and not any(modes)
    assert all(torch.equal(a, b) for a, b in zip(out, sharded))


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


SAMPLING_KNOBS = [dict(temperature=0.7), dict(top_k=3), dict(top_k=12), dict(top_p=0.5), dict(top_p=0.93),
                  dict(min_p=0.3), dict(repetition_penalty=1.7), dict(repetition_penalty=0.6),
                  dict(temperature=1.3, top_k=6, top_p=0.8, min_p=0.05, repetition_penalty=1.4)]


def _hf_processed(logits, seen_ids, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0):
    """HF generate's processors, in generate's order: repetition penalty, temperature, top-k, top-p, min-p."""
    from transformers.generation import logits_process as lp

    steps = ([lp.RepetitionPenaltyLogitsProcessor(repetition_penalty)] if repetition_penalty != 1.0 else []) + \
        ([lp.TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []) + \
        ([lp.TopKLogitsWarper(top_k)] if top_k else []) + ([lp.TopPLogitsWarper(top_p)] if top_p < 1.0 else []) + \
        ([lp.MinPLogitsWarper(min_p)] if min_p else [])
    for step in steps:
        logits = step(seen_ids, logits)
    return logits


@pytest.mark.parametrize("knobs", SAMPLING_KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_processed_logits_and_each_sample_are_hf_generates(knobs):
    """processed_logits equals HF's logits processors on random logits of 6 rows, each row with its
    own seen tokens (-inf where HF drops a token, the same value where it keeps one); _next_token
    with given noise is the exponential race over that distribution, and greedy decoding (no
    sample) is the argmax after the repetition penalty alone."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=gen) * 3
    seen_ids = torch.randint(0, 40, (6, 5), generator=gen)  # each row's prompt and completion so far
    seen = torch.zeros(6, 40, dtype=torch.bool).scatter_(1, seen_ids, True)
    ours = sampling.processed_logits(logits, knobs.get("temperature", 1.0), knobs.get("top_p", 1.0), knobs.get("top_k", 0),
                                     knobs.get("min_p", 0.0), knobs.get("repetition_penalty", 1.0),
                                     seen if "repetition_penalty" in knobs else None)
    hf = _hf_processed(logits.clone(), seen_ids, **knobs)
    assert torch.equal(ours.isinf(), hf.isinf()), knobs
    assert torch.allclose(ours[~ours.isinf()], hf[~hf.isinf()], rtol=1e-6, atol=1e-6), knobs
    assert 1 <= int((~ours.isinf()).sum(-1).min())  # a filter keeps the most probable token
    assert bool(ours.isinf().any()) == any(k in knobs for k in ("top_k", "top_p", "min_p"))  # and drops some on these logits
    noise = torch.rand(6, 40, generator=gen)
    sample = sampling._next_token(logits, knobs.get("temperature", 1.0), knobs.get("top_p", 1.0), knobs.get("top_k", 0),
                                  True, knobs.get("min_p", 0.0), knobs.get("repetition_penalty", 1.0),
                                  seen if "repetition_penalty" in knobs else None, noise=noise)
    assert sample.tolist() == (hf.softmax(-1) / -torch.log(noise)).argmax(-1).tolist(), knobs
    greedy = sampling._next_token(logits, knobs.get("temperature", 1.0), knobs.get("top_p", 1.0), knobs.get("top_k", 0),
                                  False, knobs.get("min_p", 0.0), knobs.get("repetition_penalty", 1.0),
                                  seen if "repetition_penalty" in knobs else None, noise=noise)
    penalised = _hf_processed(logits.clone(), seen_ids, repetition_penalty=knobs.get("repetition_penalty", 1.0))
    assert greedy.tolist() == penalised.argmax(-1).tolist(), knobs


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


# ------------------------------------------------------------------ plumbing at its edges
def test_decoded_completions_drop_the_stop_token_and_special_tokens_only():
    """decode_completions: a finished row loses its last real token (the stop token, even one
    that is not a special token, as a generation config's may be), a truncated row keeps every
    token, padding never shows, and special tokens inside a completion are skipped as TRL's
    batch_decode(skip_special_tokens=True) skips them."""
    from conftest import chat_tokenizer

    tok = chat_tokenizer()
    words = tok(" alice bought the bike .", add_special_tokens=False)["input_ids"]
    assert len(words) == 5
    eos, pad, user = tok.eos_token_id, tok.pad_token_id, tok.convert_tokens_to_ids("<|user|>")
    ids = torch.tensor([[words[0], words[1], eos, pad], [words[0], words[1], words[2], words[3]],
                        [words[0], user, words[3], words[4]], [words[0], words[2], words[4], pad]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])
    truncated = torch.tensor([False, True, True, False])  # row 3 ends in "." as its stop token
    texts = sampling.decode_completions(tok, ids, mask, truncated)
    assert texts == [tok.decode(words[:2]), tok.decode(words[:4]), tok.decode([words[0], words[3], words[4]]),
                     tok.decode([words[0], words[2]])] == [" alice bought", " alice bought the bike", " alice bike .", " alice the"]
    assert sampling.completion_id_lists(ids, mask) == [ids[0, :3].tolist(), ids[1].tolist(), ids[2].tolist(),
                                                        ids[3, :3].tolist()]


def test_seeded_noise_differs_by_step_and_row_and_a_row_keeps_its_own():
    """sampling_noise with a generator: row i of a rank whose rows start at first_row is global
    row first_row + i's noise, whoever draws it; two steps, two rows and two seeds differ."""
    gen = torch.Generator()
    whole = sampling.sampling_noise((6, 50), "cpu", gen, seed=3, step=4, first_row=0)
    shard = sampling.sampling_noise((2, 50), "cpu", gen, seed=3, step=4, first_row=2)
    assert torch.equal(shard, whole[2:4])
    assert not torch.equal(whole[0], whole[1])  # rows differ
    assert not torch.equal(whole, sampling.sampling_noise((6, 50), "cpu", gen, seed=3, step=5))  # steps differ
    assert not torch.equal(whole, sampling.sampling_noise((6, 50), "cpu", gen, seed=4, step=4))  # seeds differ
    assert torch.equal(whole, sampling.sampling_noise((6, 50), "cpu", gen, seed=3, step=4))  # and it is a function of them
    assert ((whole >= 0) & (whole < 1)).all()
    keys = {sampling.noise_key(s, t, r) for s in range(3) for t in range(3) for r in range(3)}
    assert len(keys) == 27 and all(0 <= k < 2 ** 63 for k in keys)


@pytest.mark.parametrize("attribute, value, formula", [
    ("final_logit_softcapping", 4.0, lambda x: 4.0 * torch.tanh(x / 4.0)),
    ("logit_scale", 0.25, lambda x: x * 0.25),
    ("logits_scaling", 8.0, lambda x: x / 8.0),
    ("lm_head_multiplier", 3.0, lambda x: x * 3.0),
])
def test_logit_transform_is_each_architectures_own_formula(attribute, value, formula):
    """logit_transform: Gemma's softcap, Cohere's scale, Granite's divisor and Falcon-H1's
    multiplier each as its formula; a factor of 1 (or none) is no transform; two apply in turn."""
    from types import SimpleNamespace

    x = torch.linspace(-20, 20, 41)
    torch.testing.assert_close(sampling.logit_transform(SimpleNamespace(**{attribute: value}))(x), formula(x))
    neutral = 0 if attribute == "final_logit_softcapping" else 1
    assert sampling.logit_transform(SimpleNamespace(**{attribute: neutral})) is None
    assert sampling.logit_transform(SimpleNamespace()) is None
    both = sampling.logit_transform(SimpleNamespace(**{attribute: value, "lm_head_multiplier": 0.5}
                                                    if attribute != "lm_head_multiplier" else {attribute: value, "logit_scale": 2.0}))
    second = (lambda y: y * 0.5) if attribute != "lm_head_multiplier" else (lambda y: y * 2.0)
    torch.testing.assert_close(both(x), second(formula(x)))


def test_token_logprobs_with_no_kept_token_and_more_tokens_than_hidden_units():
    """token_logprobs: no kept token gives zeros (no empty concatenation); with more kept tokens
    than hidden units and small chunks every token is computed, as one chunk computes it."""
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=16, num_layers=1)
    hidden = torch.randn(3, 12, 16, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, len(tok), (3, 12), generator=torch.Generator().manual_seed(1))
    nothing = torch.zeros(3, 12, dtype=torch.bool)
    lp, ent = sampling.token_logprobs(model, hidden, labels, nothing, with_entropy=True)
    assert lp.shape == ent.shape == (3, 12) and not lp.any() and not ent.any()
    keep = torch.ones(3, 12, dtype=torch.bool)
    keep[0, :2] = False  # 34 kept tokens > 16 hidden units
    with torch.no_grad():
        small = sampling.token_logprobs(model, hidden, labels, keep, chunk_tokens=5)
        whole = sampling.token_logprobs(model, hidden, labels, keep, chunk_tokens=1000)
        direct = torch.log_softmax(model.get_output_embeddings()(hidden).float(), -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(small, whole)
    torch.testing.assert_close(small, direct * keep)
    assert small.dtype == torch.float32 and (small[keep] < 0).all()


def test_a_reward_model_without_a_generation_config_stops_at_its_configs_eos():
    """stop_token_ids of a model with no generation config (a sequence classifier) reads the
    model's config: its eos_token_id joins the tokenizer's EOS."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = world.build_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id,
                      eos_token_id=[5, 6])
    rm = Qwen2ForSequenceClassification(cfg)
    assert getattr(rm, "generation_config", None) is None
    assert sampling.stop_token_ids(rm, tok) == sorted({tok.eos_token_id, 5, 6})
    from types import SimpleNamespace

    assert sampling.stop_token_ids(SimpleNamespace(), tok) == [tok.eos_token_id]  # a config that names no EOS


def test_score_texts_renders_conversations_cuts_prompts_and_batches_like_one_at_a_time():
    """score_texts: conversational prompts and assistant-message completions are rendered with
    the reward model's chat template, as reward.py renders its pairs; prompts keep their last
    max_prompt_length tokens and the completion is never cut; batches of 2 give each row's
    score alone."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from conftest import chat_tokenizer

    tok = chat_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(cfg).eval()
    prompts = [[{"role": "user", "content": "POST: alice bought the bike ."}], "POST: bob lost it .\nTL;DR:",
               [{"role": "user", "content": "POST: i think bob lost the red phone . we had a lot of fun ."}]]
    completions = [[{"role": "assistant", "content": "alice bought bike ."}], " bob lost it .",
                   [{"role": "assistant", "content": "bob lost phone ."}]]
    scores = sampling.score_texts(rm, tok, prompts, completions, batch_size=2, max_prompt_length=6)
    stops = sampling.stop_token_ids(rm, tok)
    for i in range(3):
        p_ids, _ = data.encode_prompts(tok, [data.render_prompt(tok, prompts[i])], 6)
        c_ids, _ = data.encode_completions(tok, [data.render_completion(tok, prompts[i], completions[i])], None, stops)
        assert c_ids.shape[1] > 6 or i == 1  # the completions are longer than the prompts' cut
        with torch.no_grad():
            alone = rm(input_ids=torch.cat([p_ids, c_ids], 1)).logits[0, 0]
        assert scores[i].item() == pytest.approx(alone.item(), abs=1e-5), i
    uncut = sampling.score_texts(rm, tok, prompts, completions, batch_size=3)
    assert not torch.allclose(uncut, scores)  # the cut changed what the model read


def test_log_prob_and_score_forwards_build_no_cache_and_the_head_is_recomputed_in_backward(monkeypatch):
    """Memory: a forward whose key/value cache nothing reads builds none (the body returns no
    past_key_values) -- the log-probs of one completion a prompt, packed rows and a reward
    model's scores; the shared-prompt pass builds one, which it reads. With gradients the head
    runs once per chunk forward and once more in backward but for the last chunk (their fp32
    logits are recomputed, not kept); without gradients once."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=32, num_layers=1)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    rm = Qwen2ForSequenceClassification(cfg).eval()
    caches = []
    for m in (model, rm):
        sampling.backbone(m).register_forward_hook(lambda mod, args, out: caches.append(out.past_key_values is not None))
    p_ids, p_mask = data.encode_prompts(tok, ["POST: alice bought the bike .\nTL;DR:", "POST: bob .\nTL;DR:"])
    c_ids, c_mask = data.encode_completions(tok, [" alice bought bike .", " bob ."])
    heads = []
    real_head = sampling._head_logprobs
    monkeypatch.setattr(sampling, "_head_logprobs", lambda *a: heads.append(a[2].shape[0]) or real_head(*a))
    lp = sampling.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, chunk_tokens=4)
    n = int(c_mask.sum())
    assert caches == [False] and heads == [4] * (n // 4) + [n % 4] * (n % 4 > 0)
    heads.clear()
    lp.sum().backward()
    chunks = [4] * (n // 4) + [n % 4] * (n % 4 > 0)
    assert heads == chunks[-2::-1]  # each chunk once more but the last, whose logits were kept, last first
    heads.clear()
    with torch.no_grad():
        sampling.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, chunk_tokens=100)
    assert heads == [n]
    caches.clear()
    with torch.no_grad():
        sampling.completion_logprobs(model, p_ids[:1], p_mask[:1], c_ids, c_mask)  # two completions of one prompt: one row
        sampling.packed_logprobs(model, c_ids, sampling.position_ids(c_mask), c_mask)
        sampling.sequence_scores(rm, c_ids, c_mask)
        model.set_attn_implementation("eager")  # as on a GPU: a prompt pass whose cache the completions read
        sampling.completion_logprobs(model, p_ids[:1], p_mask[:1], c_ids, c_mask)
    assert caches == [False, False, False, True, True]


def test_the_filters_and_the_noise_default_to_leaving_things_as_they_are():
    """Defaults: processed_logits with none of its knobs (or a seen-token set and no penalty) is
    the logits themselves; _next_token, sampling_noise and token_logprobs with their defaults equal
    the calls that spell them out."""
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    seen = torch.rand(3, 11, generator=torch.Generator().manual_seed(1)) < 0.5
    assert torch.equal(sampling.processed_logits(logits), logits)
    assert torch.equal(sampling.processed_logits(logits, seen=seen), logits)
    noise = torch.rand(3, 11, generator=torch.Generator().manual_seed(2))
    expected = sampling._next_token(logits, 0.7, 1.0, 0, True, 0.0, 1.0, seen, noise)
    assert torch.equal(sampling._next_token(logits, 0.7, 1.0, 0, True, seen=seen, noise=noise), expected)
    assert torch.equal(sampling._next_token(logits, 1.0, 1.0, 0, False, seen=seen),
                       sampling._next_token(logits, 1.0, 1.0, 0, False, 0.0, 1.0, seen))
    g = torch.Generator()
    assert torch.equal(sampling.sampling_noise((2, 5), "cpu", g, seed=3), sampling.sampling_noise((2, 5), "cpu", g, 3, 0, 0))
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=16, num_layers=1)
    hidden = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, len(tok), (2, 4), generator=torch.Generator().manual_seed(4))
    keep = torch.ones(2, 4, dtype=torch.bool)
    with torch.no_grad():
        plain = sampling.token_logprobs(model, hidden, labels, keep)
        assert torch.equal(plain, sampling.token_logprobs(model, hidden, labels, keep, 1.0, False, None))


def test_one_row_serves_a_cpu_under_sdpa_within_a_sliding_window():
    """fits_one_row: the block mask knows no sliding window, so a row longer than the model's window
    takes the cached-prompt path (whose layers apply it); eager attention takes it too."""
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=16, num_layers=1)
    model.config.sliding_window = 11
    assert sampling.fits_one_row(model, 11) and not sampling.fits_one_row(model, 12)
    p_ids, p_mask = data.encode_prompts(tok, ["POST: alice bought the bike .\nTL;DR:"])  # 8 tokens
    c_ids, c_mask = data.encode_completions(tok, [" alice .", " bob ."])  # 2 x 3, read but the last: a row of 12
    rows = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampling, "prompt_rows", lambda *a: rows.append(1) or prompt_rows(*a))
        with torch.no_grad():
            sampling.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask)
            model.config.sliding_window = None
            sampling.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask)
    assert p_ids.shape[1] + 2 * (c_ids.shape[1] - 1) > 11 and rows == [1]
    model.set_attn_implementation("eager")
    assert not sampling.fits_one_row(model, 11)
