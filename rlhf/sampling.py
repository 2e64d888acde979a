"""Log-probs, sampling and reward-model scores: the shared code a forker of ppo.py, dpo.py or
grpo.py must read and trust. Every algorithm computes its ratio, KL and loss from
`completion_logprobs`, samples with `generate`, and reads a reward model with `sequence_scores`
(reward.py, whose chosen and rejected share a prompt, with `completion_scores`).

Conventions: prompts are left-padded (B, P), completions right-padded (B, C); masks, never pad
ids, say where a sequence starts and ends, so pad == EOS is safe. When there are k times as many
completions as prompts, completion row i continues prompt row i // k (`repeat_interleave(k)`).
A completion ends at any of `stop_token_ids` (the tokenizer's EOS and the generation config's),
and log-probs come from the logits the model samples from (`lm_logits`: the head and the
architecture's post-head transform). tests/test_architectures.py checks both, per architecture.
"""

import contextlib
import functools
import hashlib
import inspect
import os

import torch

from rlhf import basics
from rlhf import data
from rlhf import decoding
from rlhf import parallel


# ============================================================================ stop tokens
def stop_token_ids(model_or_config, tokenizer):
    """Every token that ends a completion: the tokenizer's EOS and the model's generation-config
    `eos_token_id` (an int or a list: Llama-3-Instruct's <|eot_id|> and <|eom_id|>, Gemma's
    <end_of_turn>, Qwen2.5-Instruct's <|im_end|> and <|endoftext|>), as HF `generate` stops.
    `model_or_config`: a model, its GenerationConfig or its config. Returns a sorted list."""
    gen = getattr(model_or_config, "generation_config", None)
    if gen is None:  # a config object itself, or a model without a generation config (a reward model)
        gen = getattr(model_or_config, "config", model_or_config)
    listed = getattr(gen, "eos_token_id", None)
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    return sorted({tokenizer.eos_token_id, *listed})


# ============================================================================ logits
def logit_transform(config):
    """What the architecture's forward does to the LM head's output before returning `logits`,
    as a function of fp32 logits (None: nothing). completion_logprobs applies it inside its
    chunked head, so training sees the distribution `generate` samples from. models.load_model
    checks it on every causal LM it loads (`check_logits`) and refuses one that does more."""
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma-2/3: cap * tanh(logits / cap)
    scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
    divide = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling
    multiply = getattr(config, "lm_head_multiplier", None)  # Falcon-H1: logits * lm_head_multiplier
    steps = []
    if cap:
        steps.append(lambda x: torch.tanh(x / cap) * cap)
    if scale is not None and scale != 1:
        steps.append(lambda x: x * scale)
    if divide is not None and divide != 1:
        steps.append(lambda x: x / divide)
    if multiply is not None and multiply != 1:
        steps.append(lambda x: x * multiply)
    if not steps:
        return None

    def transform(x):
        for f in steps:
            x = f(x)
        return x
    return transform


def lm_logits(model, hidden):
    """fp32 next-token logits from final hidden states (..., H) -> (..., V): the LM head and the
    architecture's transform (`logit_transform`), exactly what `model(...).logits` holds."""
    logits = model.get_output_embeddings()(hidden).float()
    transform = logit_transform(model.config)
    return transform(logits) if transform is not None else logits


@torch.no_grad()
def check_logits(model, tokens=8):
    """Refuse a causal LM whose forward transforms its logits in a way `lm_logits` does not
    reproduce: compare log-softmax of both on a few tokens (one short forward; the tolerance
    allows bf16 rounding, a missing transform on a real model is off by nats)."""
    arch = type(model).__name__
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = (torch.arange(1, tokens + 1, device=model.device) * 7919 % vocab)[None]  # (1, T) arbitrary tokens
    mask = torch.ones_like(ids)
    try:
        expected = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False).logits
        hidden = backbone(model)(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                                 use_cache=False).last_hidden_state
    except (AttributeError, TypeError, ValueError) as e:
        basics.fail(f"{arch} is not supported: its backbone cannot be run on its own to read log-probs "
                    f"from the hidden states ({type(e).__name__}: {e}).")
    error = (torch.log_softmax(lm_logits(model, hidden), -1) - torch.log_softmax(expected.float(), -1)).abs().max()
    tolerance = 1e-3 if model.dtype == torch.float32 else 0.25
    if not error <= tolerance:
        basics.fail(f"{arch} is not supported: its forward transforms the LM head's logits in a way this project "
                    f"does not reproduce (log-probs off by {float(error):.3g} nats), so training would optimise "
                    "another distribution than the one it samples from.")


# ============================================================================ log-probs
def position_ids(mask):
    """Positions that skip left padding: (B, T)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def backbone(model):
    """The transformer without its head (model.model for Llama/Qwen, model.transformer for GPT-2);
    inside a peft model, its LoRA layers included."""
    model = transformers_model(model)
    return getattr(model, model.base_model_prefix)


def transformers_model(model):
    """The transformers model itself: a peft model's wrapped one (adapters in place), else `model`."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def with_cache(module, cache):
    """Keyword arguments that make a forward read and extend a key/value cache: transformers
    renamed `past_key_values` to `cache` in 5.x, and this works with either."""
    return {_cache_keyword(type(transformers_model(module))): cache, "use_cache": True}


@functools.cache
def _cache_keyword(cls):
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def is_checkpointing(model):
    """Whether activation (gradient) checkpointing is on; transformers 5 renamed the attribute."""
    model = transformers_model(model)
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def completion_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Last-layer hidden states of the prompt's last token and of every completion token:
    (B*k, 1+C, H), so that column t is the state before completion token t (what predicts it)
    and column t+1 the state at it (where a reward model reads a score).

    Shared prompts: when there are k > 1 times as many completions as prompts, completion row i
    continues prompt row i // k (the layout of `repeat_interleave(k)`: GRPO's groups, DPO's and
    reward.py's chosen/rejected pairs). Each prompt then goes through the model once and its
    key/value cache is repeated for its k completions -- the same numbers as k copies of the
    prompt, with k times less prompt compute. (Under gradient checkpointing with gradients on,
    HF layers refuse a cache, so the prompt is repeated instead.) On a CPU under sdpa the prompt
    and its k completions go through as one row with a block mask instead (`prompt_rows`): the
    same numbers up to float32 rounding, one pass over the weights instead of two.
    """
    k = completion_ids.shape[0] // prompt_ids.shape[0]
    C = completion_ids.shape[1]
    body = backbone(model)
    if k > 1 and fits_one_row(model, prompt_ids.shape[1] + k * C):
        return prompt_rows(body, prompt_ids, prompt_mask, completion_ids, completion_mask)
    if k > 1 and not (torch.is_grad_enabled() and is_checkpointing(model)):
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        prompt_hidden = body(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids(prompt_mask),
                             **with_cache(body, cache)).last_hidden_state  # (B, P, H)
        cache.batch_repeat_interleave(k)  # (B*k, ...): differentiable, gradients reach the prompt once
        mask = torch.cat([prompt_mask.repeat_interleave(k, 0), completion_mask], 1)  # (B*k, P+C)
        hidden = body(input_ids=completion_ids, attention_mask=mask, position_ids=position_ids(mask)[:, -C:],
                      **with_cache(body, cache)).last_hidden_state  # (B*k, C, H)
        return torch.cat([prompt_hidden[:, -1:].repeat_interleave(k, 0), hidden], 1)  # (B*k, 1+C, H)
    if k > 1:
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(k, 0), prompt_mask.repeat_interleave(k, 0)
    ids = torch.cat([prompt_ids, completion_ids], 1)  # (B, P+C)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    hidden = body(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                  use_cache=False).last_hidden_state  # (B, P+C, H)
    return hidden[:, -C - 1:]  # (B, 1+C, H)


def fits_one_row(model, length):
    """Whether `prompt_rows` serves this model: on a CPU, where a pass's cost is reading the weights
    (a GPU reads them fast, and a block mask would take its fused causal kernel away), under sdpa
    (which reads a 4-D boolean mask as given), for rows no longer than a sliding window."""
    config = transformers_model(model).config
    window = getattr(config, "sliding_window", None) or length
    return (next(model.parameters()).device.type == "cpu" and getattr(config, "_attn_implementation", None) == "sdpa"
            and length <= window)


def prompt_rows(body, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """completion_states of k completions per prompt as one row each: (prompt, c_1, ..., c_k), where
    completion j attends to the prompt's real tokens and to its own earlier ones (a block mask) at
    the positions it has after the prompt. One forward over the weights (and one weight gradient)
    instead of a prompt pass and a completion pass: on a CPU at small batches, an eighth to a third
    less time for forward and backward (bench/shared_prompt.py). No token attends to a pad; a
    prompt's left pad, with no real token before it, attends to the row's first one (no row of the
    mask is empty), so a real token is one that attends to itself (throughput.forward_tokens)."""
    B, P = prompt_ids.shape
    k, C = completion_ids.shape[0] // B, completion_ids.shape[1]
    T = P + k * C
    real = torch.cat([prompt_mask, completion_mask.reshape(B, k * C)], 1).bool()  # (B, T)
    segment = torch.cat([prompt_mask.new_zeros(P), torch.arange(1, k + 1, device=real.device).repeat_interleave(C)])
    column = torch.arange(T, device=real.device)
    sees = (column[None] <= column[:, None]) & ((segment[None] == 0) | (segment[None] == segment[:, None]))  # (T, T)
    first = prompt_mask.argmax(1)  # (B,): each row's first real prompt token (left padding)
    pad_sees_first = ~real[:, :, None] & (column[None, None] == first[:, None, None])  # (B, T, T)
    mask = (sees[None] & real[:, None, :]) | pad_sees_first  # (B, T, T): query row, key column
    after = prompt_mask.sum(1, keepdim=True) + torch.arange(C, device=real.device).repeat(k)  # (B, kC): after the prompt
    positions = torch.cat([position_ids(prompt_mask), after], 1)
    with block_attention(body, B * (T * T - (P * P + k * C * (P + C)))):
        hidden = body(input_ids=torch.cat([prompt_ids, completion_ids.reshape(B, k * C)], 1), attention_mask=mask[:, None],
                      position_ids=positions, use_cache=False, prompt_blocks=(P, k, C)).last_hidden_state  # (B, T, H)
    return torch.cat([hidden[:, P - 1:P].repeat_interleave(k, 0), hidden[:, P:].reshape(B * k, C, -1)], 1)  # (B*k, 1+C, H)


PROMPT_BLOCKS = "rlhf_prompt_blocks"  # the attention implementation prompt_rows' forward runs under
BLOCK_ATTENTION_MIN_WORK = 10**7  # (query, key) pairs the blocks skip x hidden size, below which they do not pay


@contextlib.contextmanager
def block_attention(body, skipped_pairs):
    """While a prompt_rows forward runs: a model under sdpa attends block by block
    (`prompt_block_attention`), not over the whole (T, T) mask, where the blocks skip enough of its
    pairs: `skipped_pairs` times the hidden size at least BLOCK_ATTENTION_MIN_WORK (GRPO's 8 x 32
    completions after a 38-token prompt on SmolLM2-135M: 3.9e7, about 40% less attention time;
    DPO's pairs there, 2e6, and the embedded world's tiny models gain nothing: each block is
    another kernel call and a few copies). Not under activation checkpointing, whose recompute in
    backward runs after this has ended."""
    config = getattr(body, "config", None)
    if (getattr(config, "_attn_implementation", None) != "sdpa" or is_checkpointing(body)
            or skipped_pairs * getattr(config, "hidden_size", 0) < BLOCK_ATTENTION_MIN_WORK):
        yield
        return
    from transformers import AttentionInterface  # a slow import: not for --help

    AttentionInterface.register(PROMPT_BLOCKS, prompt_block_attention)
    config._attn_implementation = PROMPT_BLOCKS
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def prompt_block_attention(module, query, key, value, attention_mask, prompt_blocks=None, **kwargs):
    """transformers' sdpa attention over prompt_rows' layout, given as `prompt_blocks` (P, k, C):
    the prompts' (P, P) block, then each completion against its prompt and itself, (C, P + C).
    The same output as sdpa over the whole (T = P + kC, T) mask, whose other blocks allow nothing
    (tests/test_sampling.py), at about half its time in forward and backward for GRPO's 8 x 32
    completions after a 38-token prompt. Without `prompt_blocks`, plain sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if prompt_blocks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    P, k, C = prompt_blocks

    def per_completion(x):  # (B, h, T, D) -> (B*k, h, C, D): completion j of row b at b*k + j
        return x[:, :, P:].unflatten(2, (k, C)).transpose(1, 2).flatten(0, 1)

    def with_prompt(x):  # (B, h, T, D) -> (B*k, h, P + C, D): its prompt's, then its own
        return torch.cat([x[:, :, :P].repeat_interleave(k, 0), per_completion(x)], 2)

    m = attention_mask[:, :, P:]  # (B, 1, kC, T): the completions' rows
    to_prompt = m[..., :P].unflatten(2, (k, C)).transpose(1, 2).flatten(0, 1)  # (B*k, 1, C, P)
    to_own = m[..., P:].unflatten(2, (k, C)).unflatten(4, (k, C)).diagonal(dim1=2, dim2=4)  # (B, 1, C, C, k)
    to_own = to_own.permute(0, 4, 1, 2, 3).flatten(0, 1)  # (B*k, 1, C, C)
    prompt, _ = sdpa_attention_forward(module, query[:, :, :P], key[:, :, :P], value[:, :, :P],
                                       attention_mask[:, :, :P, :P], **kwargs)  # (B, P, h, D)
    completions, _ = sdpa_attention_forward(module, per_completion(query), with_prompt(key), with_prompt(value),
                                            torch.cat([to_prompt, to_own], -1), **kwargs)  # (B*k, C, h, D)
    return torch.cat([prompt, completions.unflatten(0, (-1, k)).flatten(1, 2)], 1), None  # (B, T, h, D)


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                        temperature=1.0, with_entropy=False, chunk_tokens=None):
    """Per-token log pi(y_t | x, y_<t) of the completion tokens: (B, C), 0 where masked. With one
    completion per prompt it computes exactly this plain PyTorch (tests/test_sampling.py), without
    ever holding the (B, C, V) fp32 logits:

        ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
        logits = model(ids, attention_mask=mask, position_ids=position_ids(mask)).logits
        logits = logits[:, prompt_ids.shape[1] - 1:-1].float() / temperature    # what predicts each y_t
        logprobs = logits.log_softmax(-1).gather(-1, completion_ids[..., None]).squeeze(-1) * completion_mask

    Shared prompts: when there are k > 1 times as many completions as prompts, completion row i
    continues prompt row i // k, and each prompt goes through the model once (`completion_states`).

    Memory: the head is applied to completion positions only (not the prompt, not padding), in
    chunks of rows, each but the last under activation checkpointing (backward starts with the last
    one's kept logits, then recomputes the others one by one), so at most one chunk of fp32 logits
    `(chunk_tokens, vocab)` exists at a time, in forward and in backward; never `(B, T, V)`.
    With `with_entropy`, also returns the per-token entropy of the (tempered) distribution.
    """
    hidden = states_before(model, prompt_ids, prompt_mask, completion_ids, completion_mask)  # (B, C, H)
    return token_logprobs(model, hidden, completion_ids, completion_mask.bool(), temperature, with_entropy, chunk_tokens)


def states_before(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """The last-layer hidden state before each completion token, what predicts it: (B*k, C, H).
    A completion's last column is a label only, never an input that predicts one, so the model
    reads every completion token but the last (`completion_states` of the first C - 1): a group of
    8 completions of 32 tokens after a 35-token prompt is 283 tokens a pass instead of 291."""
    width = max(completion_ids.shape[1] - 1, 1)  # a one-token completion still needs a column for completion_states
    states = completion_states(model, prompt_ids, prompt_mask, completion_ids[:, :width], completion_mask[:, :width])
    return states[:, :completion_ids.shape[1]]  # (B*k, C, H)


def packed_logprobs(model, input_ids, position_ids, loss_mask):
    """Per-token log pi(x_t | x_<t) of rows that hold several examples each (sft.py --packing), 0
    where loss_mask is 0: (B, T). `position_ids` restart at 0 with each example; with no
    attention mask, transformers reads the examples' bounds from them (a block-diagonal causal
    mask under sdpa and eager, varlen kernels under flash_attention_2), so no token attends to
    another example's. Padding is an example of its own with a loss mask of 0."""
    hidden = backbone(model)(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state  # (B, T, H)
    keep = loss_mask[:, 1:].bool()  # (B, T-1): data.packed_batch's loss mask is 0 at each example's first token
    logprobs = token_logprobs(model, hidden[:, :-1], input_ids[:, 1:], keep)  # (B, T-1)
    return torch.cat([torch.zeros_like(logprobs[:, :1]), logprobs], 1)  # (B, T): column t is token t's


def token_logprobs(model, hidden, labels, keep, temperature=1.0, with_entropy=False, chunk_tokens=None):
    """log pi(label | hidden state before it) where `keep`, 0 elsewhere: hidden (B, C, H), labels and
    keep (B, C) -> (B, C) (and the entropy with `with_entropy`), the head in chunks, each but the last
    checkpointed."""
    shape = labels.shape
    h, labels = hidden[keep], labels[keep]  # (N, H), (N,): real tokens only
    head = model.get_output_embeddings()
    transform = logit_transform(model.config)  # e.g. Gemma-2's softcap: the logits generate samples from
    chunk = chunk_tokens or max(1, 2**26 // head.weight.shape[0])  # <= 256 MB of fp32 logits
    lps, ents = [], []
    for i in range(0, h.shape[0], chunk):
        args = (head, transform, h[i:i + chunk], labels[i:i + chunk], temperature, with_entropy)
        # every chunk but the last is recomputed in backward; the last one's logits are kept, since
        # backward starts with them: still one chunk's alive at a time, and one head pass less
        if torch.is_grad_enabled() and h.requires_grad and i + chunk < h.shape[0]:
            lp, ent = torch.utils.checkpoint.checkpoint(_head_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _head_logprobs(*args)
        lps.append(lp)
        ents.append(ent)
    logprobs = torch.zeros(shape, dtype=torch.float32, device=h.device)
    logprobs = logprobs.masked_scatter(keep, torch.cat(lps)) if lps else logprobs
    if not with_entropy:
        return logprobs
    entropy = torch.zeros(shape, dtype=torch.float32, device=h.device)
    entropy = entropy.masked_scatter(keep, torch.cat(ents)) if ents else entropy
    return logprobs, entropy


def _head_logprobs(head, transform, h, labels, temperature, with_entropy):
    logits = head(h).float()  # (n, V), fp32 for a stable log-softmax
    logits = transform(logits) if transform is not None else logits
    logits = logits / temperature if temperature != 1.0 else logits
    return LabelLogprob.apply(logits, labels, with_entropy)


class LabelLogprob(torch.autograd.Function):
    """log softmax(logits)[label], and with `with_entropy` the softmax's entropy (no gradient):
    (n, V), (n,) -> (n,), (n,) or None. The same values and gradient as autograd's
    `logits.gather(label) - logsumexp(logits)` and `-(softmax * log_softmax).sum()`, in one
    exponential pass: e = exp(logits - max), s = sum(e), log Z = max + log s, the entropy
    log Z - <e, logits> / s, and backward -g e / s plus g at the label, from the kept e. Autograd's
    backward would make four (n, V) tensors (the gather's zeros, the softmax, its product, their
    sum) and the entropy two more; this makes e, and one for the gradient. The head's logits are a
    model's largest activation (n x 49k floats for SmolLM2)."""

    @staticmethod
    def forward(ctx, logits, labels, with_entropy):
        top = logits.amax(-1, keepdim=True)  # (n, 1)
        e = torch.sub(logits, top).exp_()  # (n, V)
        s = e.sum(-1)  # (n,)
        logz = top.squeeze(-1) + s.log()
        entropy = None
        if with_entropy:
            entropy = logz - torch.bmm(e[:, None], logits[:, :, None]).view(-1) / s  # log Z - E_p[logit]
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(e, s, labels)
        return logits.gather(-1, labels[:, None]).squeeze(-1) - logz, entropy

    @staticmethod
    def backward(ctx, grad, _):
        e, s, labels = ctx.saved_tensors
        grad_logits = e * (-grad / s)[:, None]  # -g softmax(logits)
        return grad_logits.scatter_add_(-1, labels[:, None], grad[:, None]), None, None



# ============================================================================ generation
@torch.no_grad()
def generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature=1.0,
             top_p=1.0, top_k=0, do_sample=True, num_return_sequences=1, min_p=0.0, repetition_penalty=1.0,
             seed=None):
    """Sample `num_return_sequences` (n) completions per prompt; stop at any stop token
    (`stop_token_ids`: the tokenizer's EOS and the generation config's).

    A plain decoding loop over the model's key/value cache -- HF `generate`'s sampling, without
    its processors: each prompt is prefilled once and its cache repeated for its n samples, so
    rows i*n..(i+1)*n-1 are prompt i's (the layout of `repeat_interleave(n)`). Sampling is
    at `temperature` (an exponential race, `_next_token`), optionally restricted by `top_k` / `top_p` / `min_p`, after
    `repetition_penalty` on the tokens seen so far (prompt and completion); `do_sample=False` is
    greedy (the repetition penalty still applies, as in HF). Returns completion ids (B*n, C) with
    everything after the first stop token set to pad, the mask (1 up to and including it), and
    `truncated` (B*n,): True where none was produced.

    `seed`: None draws the sampling noise from the global RNG. An int keys each row's noise by
    (seed, decoding step, global row) (`sampling_noise`): each rank draws only its own rows',
    and the samples of N ranks x B prompts (each rank its contiguous shard, parallel.shard) are
    exactly those of 1 rank x N*B prompts; a resumed run draws the same ones again.
    """
    was_training = model.training
    model.eval()
    n, pad = num_return_sequences, tokenizer.pad_token_id
    stops = torch.tensor(stop_token_ids(model, tokenizer), device=prompt_ids.device)
    from transformers import DynamicCache  # a slow import: not for --help

    sharded = parallel.is_sharded(model)  # FSDP2 layers gather weights collectively: ranks step together
    with torch.inference_mode(not sharded):  # no version counters or views to track; FSDP2 keeps no_grad
        cache = DynamicCache(config=model.config)
        positions = position_ids(prompt_mask)
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, logits_to_keep=1,
                    **with_cache(model, cache))
        logits = out.logits[:, -1].float().repeat_interleave(n, 0)  # (B*n, V): next-token logits
        cache.batch_repeat_interleave(n)
        mask = prompt_mask.repeat_interleave(n, 0)
        next_position = positions[:, -1:].repeat_interleave(n, 0) + 1  # (B*n, 1)
        done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        seen = None  # (B*n, V) tokens already in each row, for the repetition penalty
        if repetition_penalty != 1.0:
            seen = logits.new_zeros(logits.shape).scatter_add_(1, prompt_ids.repeat_interleave(n, 0),
                                                               mask.float()) > 0
        generator = torch.Generator(device=logits.device) if do_sample and seed is not None else None
        first_row = parallel.rank() * logits.shape[0]  # this rank's rows in the global batch (parallel.shard)
        tokens = []

        def model_step(token, mask, positions):  # the model's own forward, one token a row on the cache
            return model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                         **with_cache(model, cache)).logits[:, -1].float()

        # a CPU's faster ways to the same logits (rlhf/decoding.py), else model_step
        with decoding.decoding_step(model, cache, logits.shape[0], prompt_ids.shape[1] + max_new_tokens, model_step) as step:
            for t in range(max_new_tokens):
                if not logits.amax() < float("inf"):  # NaN/+inf (one reduction): a sentence, not a sampling error
                    basics.fail(f"the model's next-token logits hold NaN/inf (generated token {t + 1}): its weights "
                                "have diverged. Resume from an earlier checkpoint with a lower --learning_rate.")
                noise = (sampling_noise(logits.shape, logits.device, generator, seed, t, first_row)
                         if do_sample else None)
                token = _next_token(logits, temperature, top_p, top_k, do_sample, min_p, repetition_penalty, seen,
                                    noise)
                token = token.masked_fill(done, pad)  # (B*n,)
                tokens.append(token)
                if seen is not None:
                    seen[torch.arange(len(token), device=token.device), token] = True
                done |= torch.isin(token, stops)
                finished = parallel.all_reduce(float((~done).sum()), "sum") == 0 if sharded else bool(done.all())
                if finished or t + 1 == max_new_tokens:
                    break
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
                logits = step(token, mask, next_position)  # (B*n, V)
                next_position = next_position + 1
        del cache
    model.train(was_training)
    completion = torch.stack(tokens, 1) if tokens else prompt_ids.new_full((logits.shape[0], 1), pad)  # (B*n, C)
    is_stop = torch.isin(completion, stops)
    truncated = ~is_stop.any(1)
    first_stop = torch.where(truncated, completion.shape[1], is_stop.int().argmax(1))  # (B*n,)
    arange = torch.arange(completion.shape[1], device=completion.device)
    completion_mask = (arange[None] <= first_stop[:, None]).long()
    completion = completion.masked_fill(completion_mask == 0, pad)
    width = max(int(completion_mask.sum(1).max()), 1)
    return completion[:, :width], completion_mask[:, :width], truncated


def sampling_noise(shape, device, generator=None, seed=None, step=0, first_row=0):
    """Uniform [0, 1) noise of one decoding step, `shape` (R, V): from the global RNG without a
    generator; with one, row i's from `generator` re-seeded with a key of (seed, step, global row
    first_row + i), a counter-based stream: a row's noise depends on nothing else, so a rank
    draws only its own R rows (never the whole world's), N ranks sample what 1 rank with the
    whole batch samples, and a rank whose rows all finished early and stops drawing changes
    nothing for the others."""
    if generator is None:
        return torch.rand(shape, device=device)
    noise = torch.empty(shape, device=device)  # (R, V)
    for i in range(shape[0]):
        generator.manual_seed(noise_key(seed, step, first_row + i))
        torch.rand(shape[1:], generator=generator, device=device, out=noise[i])
    return noise


def noise_key(seed, step, row):
    """A 63-bit generator seed from (seed, step, row): distinct keys for distinct triples."""
    digest = hashlib.blake2b(f"{seed},{step},{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _next_token(logits, temperature, top_p, top_k, do_sample, min_p=0.0, repetition_penalty=1.0, seen=None,
                noise=None):
    """One token per row from next-token logits (B, V): greedy (after the repetition penalty, as
    in HF), or sampled from `processed_logits`.

    Sampling is an exponential race: with E_v = -log U_v, U_v ~ Uniform(0, 1) the `noise`
    (B, V), argmax_v p_v / E_v is token v with probability p_v (the E_v / p_v are independent
    Exp(p_v) times; the first to finish wins), so the sample is a function of the noise. It is
    taken in log space, argmax_v (logit_v - log E_v): the same argmax (log p_v is the logit less
    the row's log-normaliser), without a softmax."""
    if not do_sample:
        return processed_logits(logits, 1.0, repetition_penalty=repetition_penalty, seen=seen).argmax(-1)
    logits = processed_logits(logits, temperature, top_p, top_k, min_p, repetition_penalty, seen)
    noise = torch.rand_like(logits) if noise is None else noise
    return (logits - torch.log(noise).neg_().log_()).argmax(-1)


def processed_logits(logits, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, seen=None):
    """The logits (B, V) a token is sampled from, -inf where a filter drops it: first the
    repetition penalty (Keskar et al. 2019, as HF applies it: the logit of every token in `seen`
    (B, V) is divided by the penalty where positive, multiplied where negative), then the
    temperature, then the top-k tokens, the smallest set whose probability reaches top_p, and the
    tokens at least min_p times as probable as the most probable one (Nguyen et al. 2024)."""
    if seen is not None:
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty), logits)
    logits = logits / temperature if temperature != 1.0 else logits
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # HF's TopPLogitsWarper's rule, to the bit: sorted from the least probable up, the tokens whose
        # cumulative probability is at most 1 - top_p go (the most probable always stays). Summing from
        # the top instead rounds differently in float32 and drops a token at the boundary that HF keeps.
        sorted_logits, order = logits.sort(-1)
        drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def reward_completions(prompts, texts):
    """What reward functions and reward models receive for decoded completion texts
    (`decode_completions`), in TRL's exact form: the text itself, unchanged, after a text prompt;
    one assistant message holding that text after a conversational prompt. Every script that
    scores completions (grpo.py, ppo.py, dpo.py --online, eval.py) goes through here."""
    return [[{"role": "assistant", "content": t}] if data.is_conversational(p) else t
            for p, t in zip(prompts, texts)]


def completion_id_lists(completion_ids, completion_mask):
    """The token ids of each completion without padding, the stop token included (TRL's
    `completion_ids` for reward functions): (B, C), (B, C) -> B lists."""
    return [[t for t, k in zip(ids, m) if k] for ids, m in zip(completion_ids.tolist(), completion_mask.tolist())]


def decode_completions(tokenizer, completion_ids, completion_mask, truncated):
    """Completion texts as `generate` returns them: without padding, without the stop token that
    ends a completion (the last real token of every row not `truncated`), otherwise exactly as
    the tokenizer decodes them (TRL's `batch_decode(..., skip_special_tokens=True)`: no space
    added, nothing stripped, so a format reward sees what the policy wrote)."""
    texts = []
    for ids, m, tr in zip(completion_ids.tolist(), completion_mask.tolist(), truncated.tolist()):
        ids = [t for t, k in zip(ids, m) if k]
        texts.append(tokenizer.decode(ids if tr else ids[:-1], skip_special_tokens=True))
    return texts


@torch.no_grad()
def sample_texts(model, tokenizer, prompts, max_new_tokens, batch_size=64, desc=None, **sampling):
    """Generate for a list of rendered prompt texts; returns (texts, truncated flags, the
    completions' token ids as completion_id_lists gives them). `desc`: show a progress bar of the
    prompts done, under that name (eval.py's policies)."""
    from tqdm.auto import tqdm

    texts, truncated, id_lists = [], [], []
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", dynamic_ncols=True, leave=False,
               disable=desc is None or os.environ.get("TQDM_DISABLE") == "1")
    for i in range(0, len(prompts), batch_size):
        ids, mask = data.encode_prompts(tokenizer, prompts[i:i + batch_size])
        c, cm, tr = generate(model, tokenizer, ids.to(model.device), mask.to(model.device), max_new_tokens, **sampling)
        texts += decode_completions(tokenizer, c, cm, tr)
        truncated += tr.tolist()
        id_lists += completion_id_lists(c, cm)
        bar.update(len(prompts[i:i + batch_size]))
    bar.close()
    return texts, truncated, id_lists



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


def completion_scores(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """sequence_scores of prompt + completion, given apart: (B*k,), read at each completion's last
    real token. With k > 1 completions per prompt (row i continues prompt row i // k), each prompt
    goes through the model once (`completion_states`): reward.py's chosen and rejected share it."""
    states = completion_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask)  # (B*k, 1+C, H)
    last = completion_mask.sum(1)  # (B*k,): column of the last real completion token (0: the prompt's last)
    h = states[torch.arange(states.shape[0], device=states.device), last]  # (B*k, H)
    return model.score(h).squeeze(-1).float()  # (B*k,)


@torch.no_grad()
def reward_model_scores(model, tokenizer, prompts, completions, batch_size=64, max_prompt_length=None):
    """Score rendered prompt texts + completion texts with a reward model: (N,) on the CPU.
    Prompts keep their last `max_prompt_length` tokens (what the policy read); completions are
    never cut: the score is read at the end of the whole completion (a sampled one is already
    at most --max_completion_length tokens long)."""
    scores = []
    for i in range(0, len(prompts), batch_size):
        p_ids, p_mask = data.encode_prompts(tokenizer, prompts[i:i + batch_size], max_prompt_length)
        c_ids, c_mask = data.encode_completions(tokenizer, completions[i:i + batch_size], None,
                                                  stop_token_ids(model, tokenizer))
        ids = torch.cat([p_ids, c_ids], 1).to(model.device)
        mask = torch.cat([p_mask, c_mask], 1).to(model.device)
        scores.append(sequence_scores(model, ids, mask).cpu())
    return torch.cat(scores)


def score_texts(model, tokenizer, prompts, completions, batch_size=64, max_prompt_length=None):
    """Reward-model scores of dataset prompts (text or conversations) and their completions (text,
    or assistant messages), rendered through the reward model's own tokenizer and chat template,
    as reward.py rendered its training pairs: (N,) on the CPU. Only the prompt is cut (to its
    last `max_prompt_length` tokens); the reward model reads the whole completion."""
    rendered = [data.render_prompt(tokenizer, p) for p in prompts]
    answers = [data.render_completion(tokenizer, p, c) for p, c in zip(prompts, completions)]
    return reward_model_scores(model, tokenizer, rendered, answers, batch_size, max_prompt_length)
