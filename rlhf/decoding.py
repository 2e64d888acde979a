"""How a CPU decodes fast: the function of one decoding step that sampling.generate's loop calls.
Nobody needs to read this to fork an algorithm file: every path gives the tokens the model's own
forward gives, to float32 rounding (tests/test_decoding.py, tests/test_architectures.py).

Decoding reads every weight once a token for a few rows, so on a CPU it is bound by memory
traffic and by the per-operator work between the matmuls. Three things, where they apply:
- MKL-packed weights (`packed_weights`: fp32 on an x86 CPU): each weight is packed once for the
  rollout's number of rows, where the plain matmul repacks it at every call; a third less time.
- Cache buffers written in place (`preallocate`): no copy of every layer's cache every token.
- One fused step for the Llama family (`llama_step`: Llama, Qwen2, Mistral without a sliding
  window; SmolLM2 is a Llama): the decoder layer's arithmetic on the packed weights with a
  handful of operators between the matmuls (torch's rms_norm, attention over the cache buffers
  grouped by key/value head), without the model's per-module calls, masks and cache objects.
Elsewhere (a GPU, bf16, sharded, quantised or LoRA weights, other architectures) the model's own
forward runs unchanged.
"""

import contextlib
import functools

import torch
import torch.nn.functional as F

from rlhf import basics
from rlhf import parallel

PACKED_BYTES_PER_WEIGHT_BYTE = 5  # MKL's packed sgemm copies for a few rows: 2,740 MB for SmolLM2's 538 MB (bench/cpu_kernels.py)
LLAMA_FAMILY = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")  # one decoder layer, as llama_step computes it
PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}  # a decoder layer's Linears


@contextlib.contextmanager
def decoding_step(model, cache, rows, capacity, model_step):
    """The function of one decoding step while the context lasts: (tokens (R,), mask (R, L), positions
    (R, 1)) -> the next-token logits (R, V) in fp32, for the `rows` rows of a prefilled `cache` that
    holds up to `capacity` positions. `llama_step` where it applies, else `model_step` (the model's
    own forward with the cache) on packed weights and preallocated cache buffers where those apply."""
    weights = llama_weights(model, rows, capacity)
    if weights is not None:
        keys, values = cache_buffers(cache, capacity)
        yield functools.partial(llama_step, model, weights, keys, values)
        return
    preallocate(cache, capacity)
    with packed_weights(model, rows):
        yield model_step


# ============================================================================ packed weights
def can_pack(model, linears):
    """MKL packs fp32 weights on the CPU of a single process, and its packed copies take about
    PACKED_BYTES_PER_WEIGHT_BYTE times the weights' bytes until decoding ends: they are made only
    when that fits in half the memory the machine has free."""
    if (not linears or not torch.backends.mkl.is_available() or parallel.is_sharded(model)
            or any(m.weight.dtype != torch.float32 or m.weight.device.type != "cpu" for m in linears)):
        return False
    return PACKED_BYTES_PER_WEIGHT_BYTE * sum(m.weight.numel() * 4 for m in linears) <= basics.free_memory_bytes() / 2


def pack(weight, bias, rows):
    """What `packed_matmul` multiplies by: (weight, its copy MKL packed for `rows` rows, bias, rows)."""
    weight = weight.detach()
    return weight, torch.ops.mkl._mkl_reorder_linear_weight(weight, rows), None if bias is None else bias.detach(), rows


def packed_matmul(packed, x):
    """x @ weight.T + bias: MKL's packed matmul for x of the packed number of rows, else the plain one."""
    weight, reordered, bias, rows = packed
    return torch.ops.mkl._mkl_linear(x, reordered, weight, bias, rows)


@contextlib.contextmanager
def packed_weights(model, rows):
    """While decoding `rows` rows a step on an x86 CPU in fp32: every plain nn.Linear multiplies by a
    copy of its weight that MKL packed once for `rows` rows, where the plain matmul repacks the
    weight at every call. The same products up to float32 rounding (another order of summation:
    tests/test_decoding.py); another number of rows falls back to the plain matmul. Elsewhere
    (`can_pack` says no): nothing changes."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not can_pack(model, linears):
        yield
        return
    for m in linears:
        m.forward = functools.partial(packed_matmul, pack(m.weight, m.bias, rows))
    try:
        yield
    finally:
        for m in linears:
            del m.forward


# ============================================================================ cache buffers
def preallocate(cache, capacity):
    """Give each plain layer of a DynamicCache buffers of `capacity` positions, so that a decoding
    step writes its token's keys and values into the next slot instead of copying the whole cache
    into a longer one (transformers' `torch.cat`, a copy of every layer's cache every token). The
    layer's keys and values stay views of its buffers up to the positions written. Other layers
    (sliding windows, quantised caches) keep their own update."""
    from transformers.cache_utils import DynamicLayer

    for layer in getattr(cache, "layers", []):
        if type(layer) is not DynamicLayer or not layer.is_initialized or layer.keys.shape[-2] >= capacity:
            continue
        n = layer.keys.shape[-2]
        buffers = [_buffer(x, capacity) for x in (layer.keys, layer.values)]
        layer.keys, layer.values = (b[..., :n, :] for b in buffers)
        layer.update = functools.partial(_write_in_place, layer, *buffers)


def _write_in_place(layer, keys, values, key_states, value_states, *args, **kwargs):
    start, end = layer.keys.shape[-2], layer.keys.shape[-2] + key_states.shape[-2]
    if end > keys.shape[-2]:  # past the buffers: grow as transformers does
        return type(layer).update(layer, key_states, value_states, *args, **kwargs)
    keys[..., start:end, :] = key_states
    values[..., start:end, :] = value_states
    layer.keys, layer.values = keys[..., :end, :], values[..., :end, :]
    return layer.keys, layer.values


def cache_buffers(cache, capacity):
    """Each layer's prefilled keys and values (R, kv heads, P, head dim) copied into buffers of
    `capacity` positions, for llama_step to write each new token's into: ([keys], [values])."""
    return [_buffer(layer.keys, capacity) for layer in cache.layers], [_buffer(layer.values, capacity) for layer in cache.layers]


def _buffer(x, capacity):
    """x's positions (dim -2) at the start of a buffer of `capacity` positions."""
    buffer = x.new_empty(*x.shape[:-2], capacity, x.shape[-1])
    buffer[..., :x.shape[-2], :] = x
    return buffer


# ============================================================================ the Llama family's step
def llama_weights(model, rows, capacity):
    """The packed weights of `llama_step` for `rows` rows, one dict a layer, and the head's; None
    where the step does not apply: another architecture, a projection that is not a plain Linear
    (LoRA, quantised), a sliding window shorter than `capacity`, weights MKL does not pack."""
    config = model.config
    window = getattr(config, "sliding_window", None)  # Mistral's; Qwen2's when its layers use one
    if type(model).__name__ not in LLAMA_FAMILY or config.hidden_act != "silu" or (window and window < capacity):
        return None  # within `capacity` positions a window hides nothing
    body = model.model
    norms = [body.norm] + [n for layer in body.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    named = [hasattr(layer.self_attn, "scaling") and hasattr(layer.self_attn, "head_dim") for layer in body.layers]
    if not all(named) or not all(hasattr(n, "variance_epsilon") for n in norms):
        return None  # a transformers version that names these otherwise: its own forward
    projections = [{name: layer.get_submodule(path) for name, path in PROJECTIONS.items()} for layer in body.layers]
    linears = [model.lm_head] + [m for layer in projections for m in layer.values()]
    if any(type(m) is not torch.nn.Linear for m in linears) or not can_pack(model, linears):
        return None
    layers = [{**{name: pack(m.weight, m.bias, rows) for name, m in ms.items()}, "norm1": layer.input_layernorm,
               "norm2": layer.post_attention_layernorm, "scaling": layer.self_attn.scaling}
              for ms, layer in zip(projections, body.layers)]
    return dict(layers=layers, head=pack(model.lm_head.weight, model.lm_head.bias, rows), heads=config.num_attention_heads,
                kv_heads=config.num_key_value_heads, head_dim=body.layers[0].self_attn.head_dim)


def llama_step(model, weights, keys, values, tokens, mask, positions):
    """One decoding step of a Llama-family model, the token's keys and values written into the
    `keys`/`values` buffers at position L - 1: transformers' LlamaDecoderLayer computed as it is
    (pre-norm, rotary q and k, grouped-query attention over the cache, SwiGLU), with a query of one
    token. tokens (R,), mask (R, L) (0 at a prompt's left padding), positions (R, 1) -> (R, V)."""
    body = model.model
    R, L = mask.shape
    kv, group, d = weights["kv_heads"], weights["heads"] // weights["kv_heads"], weights["head_dim"]
    h = body.embed_tokens(tokens)  # (R, H)
    cos, sin = body.rotary_emb(h[:, None], positions)  # (R, 1, d) each
    cos, sin = cos[:, :, None], sin[:, :, None]  # (R, 1, 1, d): the same for every head
    masked = torch.zeros(R, 1, 1, L).masked_fill_(mask[:, None, None, :] == 0, float("-inf"))  # (R, 1, 1, L)
    for layer, k_cache, v_cache in zip(weights["layers"], keys, values):
        x = _rms_norm(layer["norm1"], h)
        q = _rotary(packed_matmul(layer["q"], x).view(R, kv, group, d), cos, sin)  # query head i*group + j reads kv head i
        k_cache[:, :, L - 1] = _rotary(packed_matmul(layer["k"], x).view(R, kv, 1, d), cos, sin)[:, :, 0]
        v_cache[:, :, L - 1] = packed_matmul(layer["v"], x).view(R, kv, d)
        scores = (q @ k_cache[:, :, :L].transpose(-1, -2)).mul_(layer["scaling"]).add_(masked)  # (R, kv, group, L)
        attended = scores.softmax(-1) @ v_cache[:, :, :L]  # (R, kv, group, d)
        h = h + packed_matmul(layer["o"], attended.reshape(R, -1))
        x = _rms_norm(layer["norm2"], h)
        h = h + packed_matmul(layer["down"], F.silu(packed_matmul(layer["gate"], x)).mul_(packed_matmul(layer["up"], x)))
    return packed_matmul(weights["head"], _rms_norm(body.norm, h)).float()  # (R, V)


def _rms_norm(norm, x):
    return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)


def _rotary(x, cos, sin):
    first, second = x.chunk(2, -1)
    return x * cos + torch.cat([-second, first], -1) * sin  # transformers' rotate_half
