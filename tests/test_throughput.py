"""rlhf/throughput.py: the FLOP count against torch's own count of one forward and backward, the
token and attention counts of padded, cached and packed forwards, the hook that counts only
trained forwards, and the device's peak (datasheet table, cached CPU measurement)."""

import json
import types

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf import throughput


def tiny_llama(tie=False):
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=tie, attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def counted_by_torch(model, ids):
    """torch's FLOPs of one forward and backward: every matmul, the attention's included (eager
    attention: FlopCounterMode has no formula for the CPU's fused sdpa kernel)."""
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids).logits.sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("freeze_mlp", [False, True])
def test_the_flop_count_is_torchs_within_one_percent(tie, freeze_mlp):
    model = tiny_llama(tie)
    if freeze_mlp:  # frozen weights: no weight gradient, 4 FLOPs per weight and token instead of 6
        for layer in model.model.layers:
            layer.mlp.requires_grad_(False)
    ids = torch.randint(0, 97, (3, 20))
    tokens, attended = throughput.forward_tokens(ids)
    ours = throughput.train_flops(throughput.model_shape(model), tokens, attended)
    direct = counted_by_torch(model, ids)
    assert abs(ours - direct) <= 0.01 * direct, (ours, direct)
    trainable, frozen, layers, width = throughput.model_shape(model)
    assert (layers, width) == (2, 64) and (frozen > 0) == freeze_mlp
    assert trainable + frozen == sum(p.numel() for p in model.parameters() if p.dim() == 2) - 97 * 64 * (not tie)


def test_tokens_and_attention_of_padded_cached_and_packed_forwards():
    ids = torch.zeros(2, 4, dtype=torch.long)
    # left padding: rows of 3 and 4 real tokens, each token reads its row
    assert [int(x) for x in throughput.forward_tokens(ids, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))] == [7, 3 * 3 + 4 * 4]
    # a completion of 4 columns after a cached prompt of 2: the mask covers both
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
    assert [int(x) for x in throughput.forward_tokens(ids, mask)] == [2 + 4, 2 * 4 + 4 * 5]
    # packed rows: examples of 3 + 1 and of 2 + 2 tokens attend within themselves
    positions = torch.tensor([[0, 1, 2, 0], [0, 1, 0, 1]])
    assert [int(x) for x in throughput.forward_tokens(ids, None, positions)] == [8, 9 + 1 + 4 + 4]


def test_a_prompt_and_its_completions_in_one_row_see_the_prompt_and_themselves():
    """sampling.prompt_rows' block mask: prompt tokens causal among themselves; completion j sees
    the prompt's real tokens and its own earlier ones, never another completion or a pad; a pad
    never sees itself (a prompt's left pad sees the first real token). forward_tokens counts the
    real tokens and twice the pairs of real queries."""
    from rlhf import sampling

    seen = {}

    class Body:
        def __call__(self, **kw):
            seen.update(kw)
            return types.SimpleNamespace(last_hidden_state=torch.zeros(kw["input_ids"].shape + (2,)))

    prompt_mask = torch.tensor([[0, 1, 1]])  # one left pad, 2 real prompt tokens
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # completions of 2 and 1 tokens
    states = sampling.prompt_rows(Body(), torch.arange(3)[None], prompt_mask, torch.ones(2, 3, dtype=torch.long), completion_mask)
    assert states.shape == (2, 4, 2)
    mask = seen["attention_mask"][0, 0].int()
    assert mask.tolist() == [
        [0, 1, 0, 0, 0, 0, 0, 0, 0],  # the prompt's pad, with nothing before it to see, sees the first real token
        [0, 1, 0, 0, 0, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0, 0, 0, 0],
        [0, 1, 1, 1, 0, 0, 0, 0, 0],  # completion 1
        [0, 1, 1, 1, 1, 0, 0, 0, 0],
        [0, 1, 1, 1, 1, 0, 0, 0, 0],  # its pad: the real tokens before it, never itself
        [0, 1, 1, 0, 0, 0, 1, 0, 0],  # completion 2 sees the prompt, not completion 1
        [0, 1, 1, 0, 0, 0, 1, 0, 0],
        [0, 1, 1, 0, 0, 0, 1, 0, 0]]
    assert seen["position_ids"].tolist() == [[0, 0, 1, 2, 3, 4, 2, 3, 4]]
    tokens, attended = throughput.forward_tokens(seen["input_ids"], seen["attention_mask"])
    assert (int(tokens), int(attended)) == (5, 2 * (1 + 2 + 3 + 4 + 3))


def test_a_step_counts_the_trained_forwards_only(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny_llama()
    throughput.watch(model)
    ids = torch.randint(0, 97, (2, 10))
    throughput.start_step()
    throughput.add_rollout(0.001, 20)  # shorter than the forwards below
    with torch.no_grad():  # a rollout's or a reference's forward: not the update's
        model(input_ids=ids)
    model(input_ids=ids).logits.sum().backward()
    metrics = throughput.step_metrics()
    seconds, rollout_seconds, rollout_tokens, tokens, flops = throughput._RUN[-1]
    assert (rollout_seconds, rollout_tokens, tokens) == (0.001, 20, 20) and seconds > 0.001
    assert flops == throughput.train_flops(throughput.model_shape(model), 20, 2 * 10 * 10)
    assert metrics["rollout_tokens_per_second"] == pytest.approx(20 / 0.001) and metrics["step_time"] == seconds
    assert metrics["tokens_per_second"] == pytest.approx(20 / (seconds - 0.001))
    assert 0 < metrics["mfu"] == pytest.approx(flops / (seconds - 0.001) / throughput._PEAK["flops"])
    model(input_ids=ids).logits.sum().backward()  # between steps (an evaluation, say): not counted
    assert throughput.step_metrics() == {} and len(throughput._RUN) == 1
    summary = throughput.run_summary()
    assert summary["flops_per_step"] == flops and summary["peak_flops"] == throughput._PEAK["flops"]


def test_the_cpu_peak_is_measured_once_per_cpu_threads_and_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = throughput.peak_flops(torch.device("cpu"), torch.float32)
    assert first["flops"] > 1e8 and "measured" in first["source"]
    cache = json.load(open(tmp_path / "rlhf" / "cpu_peak_flops.json"))
    assert list(cache) == [f"{throughput.cpu_model()}|{torch.get_num_threads()} threads|float32"]
    monkeypatch.setattr(throughput, "measure_matmul_flops", lambda dtype: pytest.fail("measured again"))
    assert throughput.peak_flops(torch.device("cpu"), torch.float32) == first


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4), ("NVIDIA H100 PCIe", torch.bfloat16, 756),
    ("NVIDIA H200", torch.float16, 989.4), ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312),
    ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165.2), ("NVIDIA L4", torch.bfloat16, 121),
    ("NVIDIA GB10", torch.bfloat16, 125), ("NVIDIA A100-PCIE-40GB", torch.float32, 19.5),
    ("NVIDIA L40S", torch.bfloat16, None), ("NVIDIA GB10", torch.float32, None)])
def test_a_gpu_peak_is_its_datasheets_dense_number(name, dtype, tflops, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    peak = throughput.peak_flops(torch.device("cuda"), dtype)
    assert peak["flops"] == (tflops * 1e12 if tflops else None), peak["source"]
