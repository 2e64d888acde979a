"""bench/verifier_time.py: seconds exec_tests_strict takes on one batch of code-world completions.

A benchmark, not a test. The batch is the code world's first N demonstrations (seed 0's `sft`
split: about 70% pass all five hidden tests), verified 5 times; prints each time and the median,
and checks that the verifier agrees with the world's direct check. To compare two versions of
rlhf/sandbox.py, run it in a checkout of each, alternately, on the same machine:

    OMP_NUM_THREADS=1 python bench/verifier_time.py 128   # one GRPO step of `make demo-code` (8 x 16)
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlhf import sandbox  # noqa: E402
from worlds import world_code  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
rows = world_code.build_world(0, sizes={"sft": n, "rl": 8, "test": 8})["sft"]
completions, tests = list(rows["completion"]), list(rows["tests"])
sandbox.check()
times = []
for _ in range(5):
    start = time.perf_counter()
    rewards = sandbox.exec_tests_strict(prompts=None, completions=completions, tests=tests)
    times.append(time.perf_counter() - start)
assert rewards == [float(c) for c in rows["correct"]], "the verifier disagrees with the world's direct check"
print(f"{n} completions, {sandbox.default_workers()} workers: seconds per batch", " ".join(f"{t:.2f}" for t in times),
      f"(median {sorted(times)[2]:.2f})")
