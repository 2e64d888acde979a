"""Log-probs, sampling and reward-model scores: the shared code a forker of ppo.py, dpo.py or
grpo.py must read and trust. Every algorithm computes its ratio, KL and loss from
`completion_logprobs`, samples with `generate`, and reads a reward model with `sequence_scores`.

Conventions: prompts are left-padded (B, P), completions right-padded (B, C); masks, never pad
ids, say where a sequence starts and ends, so pad == EOS is safe. When there are k times as many
completions as prompts, completion row i continues prompt row i // k (`repeat_interleave(k)`).
"""

import functools
import inspect

import torch
from transformers import DynamicCache

import common
import parallel


# ============================================================================ log-probs
def position_ids(mask):
    """Positions that skip left padding: (B, T)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def backbone(model):
    """The transformer without its head (model.model for Llama/Qwen, model.transformer for GPT-2)."""
    return getattr(model, model.base_model_prefix)


def with_cache(module, cache):
    """Keyword arguments that make a forward read and extend a key/value cache: transformers
    renamed `past_key_values` to `cache` in 5.x, and this works with either."""
    return {_cache_keyword(type(module)): cache, "use_cache": True}


@functools.cache
def _cache_keyword(cls):
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def is_checkpointing(model):
    """Whether activation (gradient) checkpointing is on; transformers 5 renamed the attribute."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                        temperature=1.0, with_entropy=False, chunk_tokens=None):
    """Per-token log pi(y_t | x, y_<t) of the completion tokens: (B, C), 0 where masked.

    Shared prompts: when there are k > 1 times as many completions as prompts, completion row i
    continues prompt row i // k (the layout of `repeat_interleave(k)`: GRPO's groups, DPO's
    chosen/rejected pairs). Each prompt then goes through the model once and its key/value cache
    is repeated for its k completions -- the same numbers as k copies of the prompt, with k times
    less prompt compute. (Under gradient checkpointing with gradients on, HF layers refuse a
    cache, so the prompt is repeated instead.)

    Memory: the head is applied to completion positions only (not the prompt, not padding), in
    chunks of rows, each under activation checkpointing, so at most one chunk of fp32 logits
    `(chunk_tokens, vocab)` exists at a time, in forward and in backward; never `(B, T, V)`.
    With `with_entropy`, also returns the per-token entropy of the (tempered) distribution.
    """
    k = completion_ids.shape[0] // prompt_ids.shape[0]
    C = completion_ids.shape[1]
    body = backbone(model)
    if k > 1 and not (torch.is_grad_enabled() and is_checkpointing(model)):
        cache = DynamicCache(config=model.config)
        prompt_hidden = body(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids(prompt_mask),
                             **with_cache(body, cache)).last_hidden_state  # (B, P, H)
        cache.batch_repeat_interleave(k)  # (B*k, ...): differentiable, gradients reach the prompt once
        mask = torch.cat([prompt_mask.repeat_interleave(k, 0), completion_mask], 1)  # (B*k, P+C)
        hidden = body(input_ids=completion_ids, attention_mask=mask, position_ids=position_ids(mask)[:, -C:],
                      **with_cache(body, cache)).last_hidden_state  # (B*k, C, H)
        # the state before each completion token: the prompt's last, then the completion's own
        hidden = torch.cat([prompt_hidden[:, -1:].repeat_interleave(k, 0), hidden[:, :-1]], 1)  # (B*k, C, H)
        del cache, prompt_hidden
    else:
        if k > 1:
            prompt_ids, prompt_mask = prompt_ids.repeat_interleave(k, 0), prompt_mask.repeat_interleave(k, 0)
        ids = torch.cat([prompt_ids, completion_ids], 1)  # (B, P+C)
        mask = torch.cat([prompt_mask, completion_mask], 1)
        hidden = body(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                      use_cache=False).last_hidden_state  # (B, P+C, H)
        hidden = hidden[:, -C - 1:-1]  # (B, C, H): the state before each completion token
    keep = completion_mask.bool()
    h, labels = hidden[keep], completion_ids[keep]  # (N, H), (N,): real tokens only
    head = model.get_output_embeddings()
    chunk = chunk_tokens or max(1, 2**26 // head.weight.shape[0])  # <= 256 MB of fp32 logits
    lps, ents = [], []
    for i in range(0, h.shape[0], chunk):
        args = (head, h[i:i + chunk], labels[i:i + chunk], temperature, with_entropy)
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = torch.utils.checkpoint.checkpoint(_head_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _head_logprobs(*args)
        lps.append(lp)
        ents.append(ent)
    logprobs = torch.zeros(completion_ids.shape, dtype=torch.float32, device=h.device)
    logprobs = logprobs.masked_scatter(keep, torch.cat(lps)) if lps else logprobs
    if not with_entropy:
        return logprobs
    entropy = torch.zeros(completion_ids.shape, dtype=torch.float32, device=h.device)
    entropy = entropy.masked_scatter(keep, torch.cat(ents)) if ents else entropy
    return logprobs, entropy


def _head_logprobs(head, h, labels, temperature, with_entropy):
    logits = head(h).float() / temperature  # (n, V), fp32 for a stable log-softmax
    logz = torch.logsumexp(logits, -1)
    lp = logits.gather(-1, labels[:, None]).squeeze(-1) - logz
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = logz - (logits.softmax(-1) * logits).sum(-1)
    return lp, ent



# ============================================================================ generation
@torch.no_grad()
def generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature=1.0,
             top_p=1.0, top_k=0, do_sample=True, num_return_sequences=1):
    """Sample `num_return_sequences` (n) completions per prompt; stop at EOS.

    A plain decoding loop over the model's key/value cache -- HF `generate`'s sampling, without
    its processors: each prompt is prefilled once and its cache repeated for its n samples, so
    rows i*n..(i+1)*n-1 are prompt i's (the layout of `repeat_interleave(n)`). Sampling is
    multinomial at `temperature`, optionally restricted by `top_k` / `top_p`; `do_sample=False`
    is greedy. Returns completion ids (B*n, C) with everything after the first EOS set to pad,
    the mask (1 up to and including EOS), and `truncated` (B*n,): True where no EOS was produced.
    """
    was_training = model.training
    model.eval()
    n, eos, pad = num_return_sequences, tokenizer.eos_token_id, tokenizer.pad_token_id
    cache = DynamicCache(config=model.config)
    positions = position_ids(prompt_mask)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, logits_to_keep=1,
                **with_cache(model, cache))
    logits = out.logits[:, -1].float().repeat_interleave(n, 0)  # (B*n, V): next-token logits
    cache.batch_repeat_interleave(n)
    mask = prompt_mask.repeat_interleave(n, 0)
    next_position = positions[:, -1:].repeat_interleave(n, 0) + 1  # (B*n, 1)
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    sharded = parallel.is_sharded(model)  # FSDP2 layers gather weights collectively: ranks step together
    tokens = []
    for t in range(max_new_tokens):
        if not logits.amax() < float("inf"):  # NaN/+inf (one reduction): a sentence, not torch.multinomial's error
            common.fail(f"the model's next-token logits hold NaN/inf (generated token {t + 1}): its weights have "
                        "diverged. Resume from an earlier checkpoint with a lower --learning_rate.")
        token = _next_token(logits, temperature, top_p, top_k, do_sample).masked_fill(done, pad)  # (B*n,)
        tokens.append(token)
        done |= token == eos
        finished = parallel.all_reduce(float((~done).sum()), "sum") == 0 if sharded else bool(done.all())
        if finished or t + 1 == max_new_tokens:
            break
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_position,
                       **with_cache(model, cache)).logits[:, -1].float()
        next_position = next_position + 1
    del cache
    model.train(was_training)
    completion = torch.stack(tokens, 1) if tokens else prompt_ids.new_full((logits.shape[0], 1), pad)  # (B*n, C)
    is_eos = completion == eos
    truncated = ~is_eos.any(1)
    first_eos = torch.where(truncated, completion.shape[1], is_eos.int().argmax(1))  # (B*n,)
    arange = torch.arange(completion.shape[1], device=completion.device)
    completion_mask = (arange[None] <= first_eos[:, None]).long()
    completion = completion.masked_fill(completion_mask == 0, pad)
    width = max(int(completion_mask.sum(1).max()), 1)
    return completion[:, :width], completion_mask[:, :width], truncated


def _next_token(logits, temperature, top_p, top_k, do_sample):
    """One token per row from next-token logits (B, V): greedy, or sampled at `temperature`
    from the top-k tokens and the smallest set whose probability reaches top_p."""
    if not do_sample:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # tokens after the nucleus is full (the first always stays)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1).squeeze(-1)


def reward_completions(prompts, texts):
    """What reward functions and judges receive for decoded completion texts, in TRL's form:
    the text itself after a text prompt; one assistant message after a conversational prompt."""
    return [[{"role": "assistant", "content": t.strip()}] if common.is_conversational(p) else t
            for p, t in zip(prompts, texts)]


def decode_completions(tokenizer, completion_ids, completion_mask):
    """Completion texts without EOS or padding."""
    texts = []
    for ids, m in zip(completion_ids.tolist(), completion_mask.tolist()):
        ids = [t for t, k in zip(ids, m) if k and t != tokenizer.eos_token_id]
        texts.append(" " + tokenizer.decode(ids, skip_special_tokens=True).strip())
    return texts


@torch.no_grad()
def sample_texts(model, tokenizer, prompts, max_new_tokens, batch_size=64, **sampling):
    """Generate for a list of rendered prompt texts; returns (texts, truncated flags)."""
    texts, truncated = [], []
    for i in range(0, len(prompts), batch_size):
        ids, mask = common.encode_prompts(tokenizer, prompts[i:i + batch_size])
        c, cm, tr = generate(model, tokenizer, ids.to(model.device), mask.to(model.device), max_new_tokens, **sampling)
        texts += decode_completions(tokenizer, c, cm)
        truncated += tr.tolist()
    return texts, truncated



# ============================================================================ what rewards receive
def sequence_scores(model, input_ids, attention_mask):
    """Scalar score per sequence, read at the last non-pad token: (B,).

    Works with left padding (prompt) + right padding (completion): the position is found from
    the mask, never from pad ids, so pad == EOS is safe. Differentiable.
    """
    hidden = backbone(model)(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids(attention_mask), use_cache=False).last_hidden_state
    last = attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(1)  # (B,) index of last real token
    h = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (B, H)
    return model.score(h).squeeze(-1).float()  # (B,)


@torch.no_grad()
def reward_model_scores(model, tokenizer, prompts, completions, batch_size=64, max_length=None):
    """Score rendered prompt texts + completion texts with a reward model: (N,) on the CPU."""
    scores = []
    for i in range(0, len(prompts), batch_size):
        p_ids, p_mask = common.encode_prompts(tokenizer, prompts[i:i + batch_size], max_length)
        c_ids, c_mask = common.encode_completions(tokenizer, completions[i:i + batch_size], max_length)
        ids = torch.cat([p_ids, c_ids], 1).to(model.device)
        mask = torch.cat([p_mask, c_mask], 1).to(model.device)
        scores.append(sequence_scores(model, ids, mask).cpu())
    return torch.cat(scores)


def score_texts(model, tokenizer, prompts, completions, batch_size=64, max_length=None):
    """Reward-model scores of dataset prompts (text or conversations) and their completions (text,
    or assistant messages), rendered through the reward model's own tokenizer and chat template,
    as reward.py rendered its training pairs: (N,) on the CPU."""
    rendered = [common.render_prompt(tokenizer, p) for p in prompts]
    answers = [common.render_completion(tokenizer, p, c) for p, c in zip(prompts, completions)]
    return reward_model_scores(model, tokenizer, rendered, answers, batch_size, max_length)

