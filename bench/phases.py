"""bench/phases.py: where one GRPO step and one DPO step of a real model spend their time, and which
bound each phase is nearest: the machine's arithmetic peak or its memory bandwidth, both measured here
(docs/benchmarks.md, "Where a step's time goes").

    OMP_NUM_THREADS=1 python bench/phases.py --model models/SmolLM2-135M-Instruct

The batches are bench/cpu_vs_trl.py's real-model ones: GRPO 1 prompt x 8 completions x 32 new
tokens, DPO 2 pairs, on the embedded world's prompts and summaries. Each phase runs the project's
own functions (sampling.generate, sampling.completion_logprobs, dpo.pair_logps, dpo.dpo_loss,
torch's fused AdamW; GRPO's update takes a plain policy-gradient surrogate of its log-probs, whose cost
is grpo_loss's to a few elementwise operations) --repeats times; the least CPU time counts (one
thread: CPU time is the phase's own work, whatever else the machine runs).

For each phase: FLOPs (2 per weight per token forward, 4 more backward; 4 L d per attended
(query, key) pair forward, 8 more backward: rlhf/throughput.py's count), the bytes it must move at
least (the weights once per forward call -- once per decoding step --, weights and gradients in
backward, AdamW's reads and writes of weights, gradients and two moments), the time the arithmetic
peak allows (FLOPs / peak) and the time the bandwidth allows (bytes / bandwidth). The nearer bound
is the larger of the two; "of bound" is that time over the phase's.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf import models, sampling, throughput  # noqa: E402
from rlhf.basics import freeze  # noqa: E402
import dpo  # noqa: E402
from worlds import world  # noqa: E402


def cpu_best(fn, repeats):
    """(least CPU seconds over `repeats` calls of fn, fn's last result)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.process_time()
        out = fn()
        best = min(best, time.process_time() - start)
    return best, out


def measured_bounds(repeats):
    """(matmul FLOP/s, copy bytes/s) of this process's threads, best of `repeats`."""
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    seconds, _ = cpu_best(lambda: a @ b, max(repeats, 5))
    x = torch.randn(64 * 2**20)  # 256 MB, far past any cache
    y = torch.empty_like(x)
    copy, _ = cpu_best(lambda: y.copy_(x), max(repeats, 5))
    return 2 * n**3 / seconds, 2 * x.numel() * 4 / copy


def forward_flops(shape, tokens, attended, backward=False):
    trainable, frozen, layers, width = shape
    flops = 2 * (trainable + frozen) * tokens + 4 * layers * width * attended
    return 2 * flops if backward else flops  # backward: the activations' and the weights' gradients


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile_decode", action="store_true",
                        help="Only decode 8 rows x 16 tokens under torch's profiler and print its top operators.")
    cli = parser.parse_args()
    torch.manual_seed(0)
    args = argparse.Namespace(dtype="float32", trust_remote_code=False, attn_implementation="sdpa", use_peft=False,
                              load_in_4bit=False, load_in_8bit=False, gradient_checkpointing=False)
    tokenizer = models.load_tokenizer(cli.model)
    model = models.load_model(cli.model, args).train()
    if cli.profile_decode:
        return profile_decode(model, tokenizer)
    ref = freeze(models.load_model(cli.model, args))
    shape = throughput.model_shape(ref)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    peak, bandwidth = measured_bounds(cli.repeats)
    print(f"phases: {cli.model}, {n_params / 1e6:.1f}M parameters ({weight_bytes / 1e6:.0f} MB), "
          f"{torch.get_num_threads()} thread(s); measured matmul peak {peak / 1e9:.1f} GFLOP/s, "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows = []

    def phase(algo, name, seconds, flops, bytes_moved):
        t_flops, t_bytes = flops / peak, bytes_moved / bandwidth
        rows.append((algo, name, seconds, flops, bytes_moved, t_flops, t_bytes))

    test = world.build_world(0, {"sft": 0, "prefs": 0, "rl": 0, "contrast": 0})["test"]
    posts, summaries = list(test["prompt"][:2]), list(test["reference"][:2])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)  # as common.make_optimizer

    def optimizer_phase(algo):
        seconds, _ = cpu_best(lambda: optimizer.step(), cli.repeats)  # weights, gradients, 2 moments read; 3 written
        phase(algo, "optimizer (AdamW)", seconds, 0, 7 * weight_bytes)
        optimizer.zero_grad(set_to_none=False)

    # ---- GRPO: 1 prompt x 8 completions x 32 new tokens
    G, C = 8, 32
    p_ids, p_mask = (t[:1] for t in tokenizer(posts[:1], return_tensors="pt", padding=True).values())
    P = int(p_mask.sum())
    with torch.no_grad():
        prefill, _ = cpu_best(lambda: model(p_ids, attention_mask=p_mask, use_cache=True), cli.repeats)
        total, out = cpu_best(lambda: sampling.generate(model, tokenizer, p_ids, p_mask, C, num_return_sequences=G,
                                                        seed=0), cli.repeats)
    c_ids, c_mask = out[0], out[1]
    n_new = int(c_mask.sum())
    phase("grpo", "generation: prefill", prefill, forward_flops(shape, P, P * (P + 1) // 2), weight_bytes)
    decode_attended = sum(int(c_mask[:, t].sum()) * (P + t + 1) for t in range(c_mask.shape[1]))  # t-th new token: P + t + 1 keys
    phase("grpo", "generation: decode", total - prefill, forward_flops(shape, n_new, decode_attended),
          c_mask.shape[1] * weight_bytes)
    read = c_mask[:, :-1]  # the log-probs' passes read each completion but its last token (sampling.states_before)
    attended = P * (P + 1) // 2 + sum(int(read[:, t].sum()) * (P + t + 1) for t in range(read.shape[1]))  # the prompt once, then each token its prefix
    n_read = P + int(read.sum())
    with torch.no_grad():
        seconds, _ = cpu_best(lambda: sampling.completion_logprobs(ref, p_ids, p_mask, c_ids, c_mask), cli.repeats)
    phase("grpo", "reference log-probs", seconds, forward_flops(shape, n_read, attended), 2 * weight_bytes)
    advantages = torch.randn(G)

    def update_forward():
        logprobs = sampling.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask)
        return -(advantages[:, None] * logprobs).sum() / c_mask.sum()

    seconds, loss = cpu_best(update_forward, cli.repeats)
    phase("grpo", "update: forward", seconds, forward_flops(shape, n_read, attended), 2 * weight_bytes)
    seconds, _ = cpu_best(lambda: (model.zero_grad(set_to_none=True), update_forward().backward()), cli.repeats)  # fresh grads, as a step
    backward = seconds - rows[-1][2]
    phase("grpo", "update: backward", backward, forward_flops(shape, n_read, attended, backward=True), 4 * weight_bytes)
    optimizer_phase("grpo")

    # ---- DPO: 2 pairs (the reference's log-probs precomputed once before training: not a step's)
    rejected = [" " + s.strip().split(" . ")[0] + " ." for s in summaries]  # a shorter summary: one fact
    batch = dpo.encode_pairs(tokenizer, posts, summaries, rejected,
                             argparse.Namespace(max_prompt_length=512, max_completion_length=256), [tokenizer.eos_token_id])
    prompt_len, c_len = batch["prompt_mask"].sum(1), batch["completion_mask"][:, :-1]  # (B,), (2B, C - 1): what is read
    tokens = int(prompt_len.sum()) + int(c_len.sum())  # each prompt once for its two completions (pair_logps)
    dpo_attended = int((prompt_len * (prompt_len + 1) // 2).sum()) + sum(
        int(c_len[r, t]) * (int(prompt_len[r % len(posts)]) + t + 1) for r in range(c_len.shape[0]) for t in range(c_len.shape[1]))
    with torch.no_grad():
        ref_seconds, ref_logps = cpu_best(lambda: dpo.pair_logps(ref, batch, "sigmoid"), cli.repeats)

    def dpo_forward():
        chosen, rejected = dpo.pair_logps(model, batch, "sigmoid")
        return dpo.dpo_loss(chosen, rejected, *ref_logps, 0.1)[0].mean()

    seconds, _ = cpu_best(dpo_forward, cli.repeats)
    phase("dpo", "update: forward", seconds, forward_flops(shape, tokens, dpo_attended), 2 * weight_bytes)
    seconds, _ = cpu_best(lambda: (model.zero_grad(set_to_none=True), dpo_forward().backward()), cli.repeats)
    phase("dpo", "update: backward", seconds - rows[-1][2], forward_flops(shape, tokens, dpo_attended, backward=True),
          4 * weight_bytes)
    optimizer_phase("dpo")
    phase("dpo", "(reference log-probs, once per pair)", ref_seconds, forward_flops(shape, tokens, dpo_attended),
          2 * weight_bytes)

    print("| algo | phase | CPU ms | GFLOP | MB moved | ms at peak FLOP/s | ms at bandwidth | nearest bound | of bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for algo, name, seconds, flops, moved, t_flops, t_bytes in rows:
        bound = "arithmetic" if t_flops >= t_bytes else "memory"
        print(f"| {algo} | {name} | {seconds * 1e3:.0f} | {flops / 1e9:.2f} | {moved / 1e6:.0f} | {t_flops * 1e3:.0f} | "
              f"{t_bytes * 1e3:.0f} | {bound} | {max(t_flops, t_bytes) / seconds:.2f} |")


def profile_decode(model, tokenizer):
    """Where decoding's CPU time goes, operator by operator (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    prompt = world.build_world(0, {"sft": 0, "prefs": 0, "rl": 0, "contrast": 0})["test"]["prompt"][0]
    ids = tokenizer([prompt], return_tensors="pt")
    with torch.no_grad():
        sampling.generate(model, tokenizer, ids["input_ids"], ids["attention_mask"], 4, num_return_sequences=8, seed=0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            sampling.generate(model, tokenizer, ids["input_ids"], ids["attention_mask"], 16, num_return_sequences=8, seed=0)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
