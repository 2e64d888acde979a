"""bench/same_runs.py: a refactor changes no behaviour, shown on runs rather than argued.

Runs a fixed set of short training runs on the embedded world (seed 0, one thread, so every run
is deterministic on one machine): sft, reward, ppo, dpo offline and online, grpo plain (two
updates per rollout), grpo --use_peft and grpo --tools on the arithmetic-with-a-calculator world.
For each it records every value of metrics.jsonl except wall-clock ones, and a hash of every
saved tensor. Run it in two checkouts (before and after a change) and compare:

    python bench/same_runs.py --out /tmp/before            # in a checkout of the old commit
    python bench/same_runs.py --out /tmp/after             # in the new one
    python bench/same_runs.py --compare /tmp/before /tmp/after

--compare prints each run's verdict and exits 1 on any difference. About 4 minutes on one core.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMES = ("seconds", "_per_second", "time", "eta", "mfu")  # wall-clock metrics: differ from run to run


def runs(out):
    """(name, argv) of each run, in order: later runs read earlier runs' folders."""
    o = lambda name: ["--output_dir", f"{out}/{name}", "--seed", "0"]  # noqa: E731
    sft, tools_sft = f"{out}/sft", f"{out}/sft_tools"
    return [
        ("sft", ["sft.py", "--max_steps", "40", *o("sft")]),
        ("reward", ["reward.py", "--model", sft, "--max_steps", "6", *o("reward")]),
        ("ppo", ["ppo.py", "--model", sft, "--reward_model", f"{out}/reward", "--max_steps", "2", *o("ppo")]),
        ("ppo_gold", ["ppo.py", "--model", sft, "--reward_fn", "gold", "--max_steps", "2", "--batch_size", "16", *o("ppo_gold")]),
        ("dpo", ["dpo.py", "--model", sft, "--max_steps", "4", *o("dpo")]),
        ("dpo_online", ["dpo.py", "--online", "--model", sft, "--max_steps", "3", *o("dpo_online")]),
        ("grpo", ["grpo.py", "--model", sft, "--max_steps", "4", "--num_iterations", "2", *o("grpo")]),
        ("grpo_peft", ["grpo.py", "--model", sft, "--use_peft", "--learning_rate", "5e-4", "--max_steps", "2", *o("grpo_peft")]),
        ("sft_tools", ["sft.py", "--dataset", "embedded:arith_tools", "--max_steps", "60", *o("sft_tools")]),
        ("grpo_tools", ["grpo.py", "--model", tools_sft, "--dataset", "embedded:arith_tools", "--reward_fn", "arith_strict",
                        "--tools", "worlds/calculator.py:add", "--max_tool_calling_iterations", "1",
                        "--max_completion_length", "96", "--temperature", "1.0", "--max_steps", "2", *o("grpo_tools")]),
    ]


def fingerprint(folder):
    """metrics.jsonl's values (wall-clock ones left out) and a sha256 of each saved tensor file."""
    rows = []
    for line in open(os.path.join(folder, "metrics.jsonl")):
        row = json.loads(line)
        rows.append({k: v for k, v in row.items() if not any(t in k for t in TIMES)})
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors[name] = hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
    return {"metrics": rows, "tensors": tensors}


def record(out):
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    result = {}
    for name, argv in runs(os.path.abspath(out)):
        proc = subprocess.run([sys.executable, *argv, "--overwrite_output_dir"], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        result[name] = fingerprint(os.path.join(out, name))
        print(f"{name}: {len(result[name]['metrics'])} metrics rows, {len(result[name]['tensors'])} tensor files")
    json.dump(result, open(os.path.join(out, "fingerprints.json"), "w"), indent=1)


def compare(a, b):
    fa, fb = (json.load(open(os.path.join(f, "fingerprints.json"))) for f in (a, b))
    differ = 0
    for name in fa:
        if name not in fb:
            print(f"{name}: missing from {b}")
            differ += 1
            continue
        ma, mb = fa[name]["metrics"], fb[name]["metrics"]
        bad = [(i, k, r.get(k), s.get(k)) for i, (r, s) in enumerate(zip(ma, mb)) for k in set(r) | set(s) if r.get(k) != s.get(k)]
        same_tensors = fa[name]["tensors"] == fb[name]["tensors"]
        ok = not bad and len(ma) == len(mb) and same_tensors
        differ += not ok
        print(f"{name}: {'same' if ok else 'DIFFERENT'} ({len(ma)} metrics rows, {len(fa[name]['tensors'])} tensor files"
              f"{'' if same_tensors else ', tensors differ'})")
        for i, k, x, y in bad[:10]:
            print(f"  row {i} {k}: {x} -> {y}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="record the runs' fingerprints in this folder")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two recorded folders")
    a = p.parse_args()
    compare(*a.compare) if a.compare else record(a.out) if a.out else p.error("--out or --compare")
