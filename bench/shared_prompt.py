"""bench/shared_prompt.py: three ways to run k completions of one prompt through a real model with
gradients, forward + backward CPU seconds each (docs/benchmarks.md, section 2):
- one row (`sampling.prompt_rows`, the CPU's way under sdpa): prompt, c_1, ..., c_k with a block mask;
- a cached prompt (the way elsewhere): the prompt alone, its key/value cache repeated k times, then
  the completions against it;
- the prompt repeated k times (TRL's way), as one batch.

    OMP_NUM_THREADS=1 python bench/shared_prompt.py --model models/SmolLM2-135M-Instruct

Shapes: DPO's real-model batch (a prompt of 42 tokens, 2 completions of 15) and GRPO's (35, 8 x 32),
random tokens, fp32, one thread; the least of --repeats runs counts. A benchmark, not a test.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf import models, sampling  # noqa: E402

SHAPES = {"dpo (prompt 42, 2 x 15)": (42, 2, 15), "grpo (prompt 35, 8 x 32)": (35, 8, 32)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="Times through the shapes (the first round also warms up).")
    cli = parser.parse_args()
    args = argparse.Namespace(dtype="float32", trust_remote_code=False, attn_implementation="sdpa", use_peft=False,
                              load_in_4bit=False, load_in_8bit=False, gradient_checkpointing=False)
    model = models.load_model(cli.model, args).train()
    one_row = sampling.fits_one_row
    generator = torch.Generator().manual_seed(0)

    def seconds(p_ids, p_mask, c_ids, c_mask):
        best = float("inf")
        for _ in range(cli.repeats):
            model.zero_grad(set_to_none=True)
            start = time.process_time()
            sampling.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask).sum().backward()
            best = min(best, time.process_time() - start)
        return best

    print(f"| shape | one row s | cached prompt s | repeated prompt s |  ({cli.model}, {torch.get_num_threads()} thread(s))")
    print("|---|---|---|---|")
    for name, (P, k, C) in list(SHAPES.items()) * cli.rounds:
        p_ids = torch.randint(100, 40000, (1, P), generator=generator)
        c_ids = torch.randint(100, 40000, (k, C), generator=generator)
        p_mask, c_mask = torch.ones_like(p_ids), torch.ones_like(c_ids)
        rows = seconds(p_ids, p_mask, c_ids, c_mask)
        sampling.fits_one_row = lambda *a: False
        cached = seconds(p_ids, p_mask, c_ids, c_mask)
        sampling.fits_one_row = one_row
        repeated = seconds(p_ids.repeat(k, 1), p_mask.repeat(k, 1), c_ids, c_mask)
        print(f"| {name} | {rows:.3f} | {cached:.3f} | {repeated:.3f} |")


if __name__ == "__main__":
    main()
