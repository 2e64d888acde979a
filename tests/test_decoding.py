"""rlhf/decoding.py: each faster way to a decoding step's logits gives what the model's own forward
gives. The fused step of the Llama family against transformers' forward on left-padded prompts
(and greedy decoding through it against HF generate: tests/test_architectures.py), where it
applies and where it must not; MKL's packed weights; the cache buffers written in place."""

import types

import pytest
import torch
import transformers

from rlhf import data
from rlhf import decoding
from rlhf import sampling
from worlds import world

MKL = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's packed matmuls are x86's")


def tiny(name, **overrides):
    """A tiny fp32 model of a Llama-family architecture, weights large enough to tell paths apart."""
    tok = world.build_tokenizer()
    config = getattr(transformers, f"{name}Config")(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=None, **overrides)
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)  # biases too (Qwen2's q, k and v; Llama's attention_bias)
    return model, tok


def prompts(tok):
    return data.encode_prompts(tok, ["POST: alice bought the bike .\nTL;DR:",
                                     "POST: i think bob lost the red phone . we had a lot of fun .\nTL;DR:"])  # left-padded


@MKL
@pytest.mark.parametrize("name,overrides", [("Llama", {}), ("Llama", {"attention_bias": True, "mlp_bias": True}),
                                            ("Qwen2", {}), ("Mistral", {"sliding_window": None})])
def test_the_llama_step_gives_the_models_logits(name, overrides):
    """llama_step, token by token on the same prefilled cache, gives transformers' next-token logits
    for 2 left-padded prompts x 3 rows each, over 6 steps (the keys and values of each step written
    into its buffers, which then hold transformers' cache), with attention and MLP biases too."""
    from transformers import DynamicCache

    model, tok = tiny(name, **overrides)
    ids, mask = prompts(tok)
    n, steps = 3, 6
    caches = []
    with torch.no_grad():
        for _ in range(2):
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, attention_mask=mask, position_ids=sampling.position_ids(mask), **sampling.with_cache(model, cache))
            cache.batch_repeat_interleave(n)
            caches.append(cache)
        rows, capacity = ids.shape[0] * n, ids.shape[1] + steps
        weights = decoding.llama_weights(model, rows, capacity)
        assert weights is not None and len(weights["layers"]) == 2
        keys, values = decoding.cache_buffers(caches[1], capacity)
        mask = mask.repeat_interleave(n, 0)
        positions = sampling.position_ids(mask)[:, -1:] + 1
        tokens = torch.randint(0, len(tok), (rows,), generator=torch.Generator().manual_seed(0))
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(rows, 1)], 1)
            ours = decoding.llama_step(model, weights, keys, values, tokens, mask, positions)
            theirs = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions,
                           **sampling.with_cache(model, caches[0])).logits[:, -1]
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
            tokens, positions = theirs.argmax(-1), positions + 1
        L = mask.shape[1]
        torch.testing.assert_close(keys[1][..., :L, :], caches[0].layers[1].keys)  # what the next token would attend to
        torch.testing.assert_close(values[1][..., :L, :], caches[0].layers[1].values)


@MKL
def test_generate_takes_the_fused_step_only_where_it_applies(monkeypatch):
    """The Llama family's fp32 models on the CPU decode through llama_step, with the samples of the
    model's own forward; a sliding window shorter than the rows' positions, bf16 weights, another
    architecture, a Linear replaced by another module (LoRA, 8-bit), sharded weights, or too little
    free memory for the packed copies: the model's own forward."""
    calls = []
    step = decoding.llama_step
    monkeypatch.setattr(decoding, "llama_step", lambda *a: calls.append(1) or step(*a))

    def sample(model, tok, fused):
        ids, mask = prompts(tok)
        calls.clear()
        out = sampling.generate(model, tok, ids, mask, 6, num_return_sequences=2, seed=0)
        assert bool(calls) == fused, (type(model).__name__, fused)
        return out

    model, tok = tiny("Qwen2")
    fused = sample(model, tok, True)
    with monkeypatch.context() as patch:
        patch.setattr(decoding, "llama_weights", lambda *a: None)
        plain = sample(model, tok, False)
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    sample(*tiny("Mistral", sliding_window=32), True)  # a window longer than prompt + completion hides nothing
    sample(*tiny("Mistral", sliding_window=8), False)
    sample(*tiny("Qwen3"), False)  # q and k normed per head: not the family's layer
    model, tok = tiny("Llama")
    sample(model.bfloat16(), tok, False)
    model, tok = tiny("Llama")
    model.model.layers[1].mlp.up_proj = torch.nn.Sequential(model.model.layers[1].mlp.up_proj)
    sample(model, tok, False)
    model, tok = tiny("Llama")
    with monkeypatch.context() as patch:
        patch.setattr(decoding.parallel, "is_sharded", lambda model: True)
        sample(model, tok, False)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    monkeypatch.setattr(decoding.basics, "free_memory_bytes", lambda: 2 * 5 * sum(m.weight.numel() * 4 for m in linears) - 1)
    sample(model, tok, False)


def test_decoding_writes_each_token_into_preallocated_cache_buffers(monkeypatch):
    """Where the model's own forward decodes, each cache layer gets buffers for the prompt and every
    new token: the samples are those of transformers' growing cache, and after the prefill no layer concatenates its cache;
    a layer given too few positions goes back to concatenating, with the same keys and values."""
    from transformers.cache_utils import DynamicLayer

    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2)
    monkeypatch.setattr(decoding, "llama_weights", lambda *a: None)  # the model's own forward, not the fused step
    ids, mask = data.encode_prompts(tok, ["POST: alice bought the bike .\nTL;DR:", "POST: bob lost the phone .\nTL;DR:"])
    grown = []
    update = DynamicLayer.update
    monkeypatch.setattr(DynamicLayer, "update", lambda self, *a, **kw: grown.append(1) or update(self, *a, **kw))
    ours = sampling.generate(model, tok, ids, mask, 8, num_return_sequences=3, seed=0)
    assert len(grown) == 2  # the prefill's, one a layer
    layer = DynamicLayer()
    layer.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    before = [x.clone() for x in (layer.keys, layer.values)]
    decoding.preallocate(types.SimpleNamespace(layers=[DynamicLayer(), layer]), 4)  # an empty layer first: skipped
    new = [torch.randn(1, 2, 1, 4) for _ in range(4)]
    keys, values = layer.update(new[0], new[1])  # the last free position: written in place
    assert len(grown) == 3 and torch.equal(keys, torch.cat([before[0], new[0]], -2))
    assert torch.equal(values, torch.cat([before[1], new[1]], -2))
    keys, values = layer.update(new[2], new[3])  # past the buffers: concatenated
    assert len(grown) == 4 and torch.equal(keys, torch.cat([before[0], new[0], new[2]], -2))
    assert torch.equal(values, torch.cat([before[1], new[1], new[3]], -2))
    monkeypatch.setattr(decoding, "preallocate", lambda cache, capacity: None)
    plain = sampling.generate(model, tok, ids, mask, 8, num_return_sequences=3, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(ours, plain)) and len(grown) > 4



@MKL
def test_packed_weights_give_the_plain_matmuls_numbers_and_go_away_after(monkeypatch):
    """packed_weights: a forward of `rows` rows (the decode steps) gives the plain forward's
    logits up to float32 rounding, another number of rows exactly (it falls back), and once the
    block ends every Linear is plain again (its forward is the class's, its weight untouched).
    Nothing is packed where five times the weights' bytes would not fit in half the free memory."""
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2).eval()
    ids = torch.randint(0, len(tok), (5, 7), generator=torch.Generator().manual_seed(0))
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    weights = [m.weight.clone() for m in linears]
    calls, packed_matmul = [], decoding.packed_matmul
    monkeypatch.setattr(decoding, "packed_matmul", lambda *a: calls.append(a[-1].shape[0] * a[-1].shape[1]) or packed_matmul(*a))
    with torch.no_grad():
        plain = [model(input_ids=ids[:, :1]).logits, model(input_ids=ids).logits]
        with decoding.packed_weights(model, 5):
            assert all("forward" in vars(m) for m in linears)
            packed = [model(input_ids=ids[:, :1]).logits, model(input_ids=ids).logits]
    torch.testing.assert_close(packed[0], plain[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(packed[1], plain[1])
    assert calls == [5] * len(linears) + [35] * len(linears)  # every Linear went through MKL's op, twice
    assert not any("forward" in vars(m) for m in linears)
    assert all(torch.equal(m.weight, w) for m, w in zip(linears, weights))
    weight_bytes = sum(m.weight.numel() * 4 for m in linears)
    monkeypatch.setattr(decoding.basics, "free_memory_bytes", lambda: 2 * 5 * weight_bytes - 1)  # the copies would not fit
    with decoding.packed_weights(model, 5):
        assert not any("forward" in vars(m) for m in linears)
    monkeypatch.setattr(decoding.basics, "free_memory_bytes", lambda: 2 * 5 * weight_bytes)
    with decoding.packed_weights(model, 5):
        assert all("forward" in vars(m) for m in linears)
    with decoding.packed_weights(model.bfloat16(), 5):  # bf16: nothing is packed
        assert not any("forward" in vars(m) for m in linears)
    w, b = torch.randn(8, 16, generator=torch.Generator().manual_seed(2)), torch.randn(8)
    packed = decoding.pack(w, b, 5)  # llama_step's matmul: MKL's for the packed rows, the plain one for others
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(decoding.packed_matmul(packed, x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-6)
    assert torch.equal(decoding.packed_matmul(packed, x[:3]), torch.nn.functional.linear(x[:3], w, b))
    biased = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))  # a Linear's bias is added too (Qwen2's q/k/v)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), decoding.packed_weights(biased, 5):
        packed = biased(x)
    torch.testing.assert_close(packed, biased(x).detach(), rtol=1e-5, atol=1e-6)
