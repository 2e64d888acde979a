"""bench/regression.py: each training script's step time, throughput and MFU at fixed short
settings, kept as a baseline per machine (bench/baselines/<machine>.json), and a check that a
change made no step more than --threshold slower than the baseline's commit.

The check does not compare with the stored numbers, which another load measured: it checks the
baseline's commit out into a temporary git worktree and runs both trees now, interleaved A B B A
(A: the baseline's commit, B: this working tree, uncommitted changes included; B first every
other script), so that both see the same load. It compares each side's fastest step (of every
run's steps after the first): on a machine shared with other work the fastest step is the one the
load disturbed least, where a median moved by 20% between two runs of the same code at load 7 on
2 cores. The medians (step time, tokens per second, MFU) are printed and stored beside it; the
stored numbers are the record of what the machine did then.

Every run: a tiny Llama (hidden 128, 2 layers, the embedded world's tokenizer, built once in
--workdir), the embedded world's rows written to .jsonl files, one thread, fp32, torch AdamW,
--max_steps 6, no checkpoints, no evaluation; GRPO, PPO and online DPO score with the gold judge;
distill.py's teacher is the same tiny Llama (the divergence is then 0 at the first step, its cost
the same as any teacher of that shape).

    python bench/regression.py --write      # the baseline of this machine at HEAD (a clean tree)
    python bench/regression.py              # the check: exit 1 if a step is > 10% slower than there
(make bench-baseline / make bench-check; docs/benchmarks.md, "Regression check", has a run.)
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS = 6
COMMON = ["--max_steps", str(STEPS), "--logging_steps", "1", "--save_steps", "0", "--eval_steps", "0", "--seed", "0",
          "--optim", "adamw", "--learning_rate", "1e-5", "--warmup_steps", "0", "--dtype", "float32",
          "--gradient_accumulation_steps", "1"]
# script, its dataset (a split of the embedded world), its own flags
RUNS = {
    "sft": ("sft.py", "sft", ["--batch_size", "8"]),
    "reward": ("reward.py", "prefs", ["--batch_size", "8"]),
    "dpo": ("dpo.py", "prefs", ["--batch_size", "8"]),
    "dpo_online": ("dpo.py", "rl", ["--online", "--reward_fn", "gold", "--batch_size", "4", "--max_new_tokens", "16"]),
    "kto": ("kto.py", "prefs", ["--batch_size", "8"]),
    "grpo": ("grpo.py", "rl", ["--reward_fn", "gold", "--batch_size", "2", "--num_generations", "8",
                               "--max_completion_length", "16"]),
    "ppo": ("ppo.py", "rl", ["--reward_fn", "gold", "--batch_size", "4", "--max_completion_length", "16"]),
    "distill": ("distill.py", "sft", ["--teacher", "{model}", "--batch_size", "4", "--max_completion_length", "16"]),
}
COLUMNS = {"sft": ["prompt", "completion"], "prefs": ["prompt", "chosen", "rejected"], "rl": ["prompt", "post"]}
ROWS = 256
REPORTED = ("step_time", "tokens_per_second", "rollout_tokens_per_second", "mfu")


def machine():
    """This machine's name for its baseline file: the CPU model and its cores."""
    from rlhf import throughput

    name = re.sub(r"[^a-z0-9]+", "-", throughput.cpu_model().lower()).strip("-")
    return f"{name}-{os.cpu_count()}cpu"


def build(workdir):
    """The tiny Llama and the embedded world's splits as .jsonl, once in `workdir`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import common
    from worlds import world

    model_dir = os.path.join(workdir, "model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        tok = world.build_tokenizer()
        config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    embedded = common.embedded_world(0)
    for split, columns in COLUMNS.items():
        with open(os.path.join(workdir, f"{split}.jsonl"), "w") as f:
            for row in embedded[split].select(range(ROWS)):
                f.write(json.dumps({c: row[c] for c in columns}) + "\n")
    return model_dir


def run(tree, name, workdir, model_dir, log):
    """One run of RUNS[name] with `tree`'s scripts: its steps' metrics after the first (warm-up)."""
    script, split, flags = RUNS[name]
    out = os.path.join(workdir, "out")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, os.path.join(tree, script), "--model", model_dir, "--dataset",
           os.path.join(workdir, f"{split}.jsonl"), "--output_dir", out, *COMMON, *(f.format(model=model_dir) for f in flags)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"regression: {name} exited {proc.returncode} in {tree}; see {log}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "step_time" in r][1:]
    medians = {k: statistics.median(r[k] for r in rows if k in r) for k in REPORTED if any(k in r for r in rows)}
    return {**medians, "best_step_time": min(r["step_time"] for r in rows)}


def median_of(runs):
    """The runs' medians, and their fastest step."""
    return {**{k: statistics.median(r[k] for r in runs) for k in runs[0]}, "best_step_time": min(r["best_step_time"] for r in runs)}


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def write_baseline(cli, path, model_dir):
    if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/baselines"):
        sys.exit("regression: --write measures HEAD: commit or stash the changes first.")
    results = {}
    for name in cli.names:
        runs = [run(ROOT, name, cli.workdir, model_dir, os.path.join(cli.workdir, f"{name}.log")) for _ in range(cli.runs)]
        results[name] = median_of(runs)
        print(f"{name:>10}: " + ", ".join(f"{k} {v:.4g}" for k, v in results[name].items()), flush=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"machine": machine(), "commit": git("rev-parse", "HEAD"), "steps": STEPS, "runs": cli.runs,
                   "settings": {n: [RUNS[n][0], *COMMON, *RUNS[n][2]] for n in RUNS}, "results": results}, f, indent=1)
    print(f"regression: wrote {path}")


def check(cli, path, model_dir):
    if not os.path.exists(path):
        sys.exit(f"regression: no baseline for this machine ({path}): make one with `make bench-baseline` "
                 "on a clean commit, and commit it.")
    with open(path) as f:
        baseline = json.load(f)
    tree_a = tempfile.mkdtemp(prefix="bench_baseline_")
    git("worktree", "add", "--detach", tree_a, baseline["commit"])
    failed = []
    try:
        print(f"regression: A = {baseline['commit'][:10]} (the baseline's commit), B = this working tree; "
              f"{cli.runs} runs each, A B B A; fail above {1 + cli.threshold:.2f} x A's step time", flush=True)
        print(f"{'run':>10} {'A best ms':>10} {'B best ms':>10} {'B / A':>6}  {'B tok/s':>9} {'B mfu':>7}  "
              "stored A median ms")
        for i, name in enumerate(cli.names):
            if name not in baseline["results"]:  # a script newer than the baseline's commit: nothing to compare with
                print(f"{name:>10}: skipped: not in the baseline of {baseline['commit'][:10]} (make bench-baseline adds it)")
                continue
            sides = {"A": [], "B": []}
            order = ("ABBA" * cli.runs)[:2 * cli.runs]  # A B B A A B ...: a drift in load cancels
            for side in order[::-1] if i % 2 else order:  # and B first every other run
                tree = tree_a if side == "A" else ROOT
                sides[side].append(run(tree, name, cli.workdir, model_dir, os.path.join(cli.workdir, f"{name}_{side}.log")))
            a, b = median_of(sides["A"]), median_of(sides["B"])
            ratio = b["best_step_time"] / a["best_step_time"]
            stored = baseline["results"].get(name, {}).get("step_time")
            verdict = "SLOWER" if ratio > 1 + cli.threshold else "ok"
            print(f"{name:>10} {1e3 * a['best_step_time']:>10.1f} {1e3 * b['best_step_time']:>10.1f} {ratio:>6.3f}  "
                  f"{b['tokens_per_second']:>9.0f} {b.get('mfu', float('nan')):>7.3f}  "
                  f"{1e3 * stored if stored else float('nan'):.1f}  {verdict}", flush=True)
            if verdict != "ok":
                failed.append(f"{name} ({ratio:.2f} x)")
    finally:
        git("worktree", "remove", "--force", tree_a)
    if failed:
        sys.exit(f"regression: FAILED: steps more than {cli.threshold:.0%} slower than {baseline['commit'][:10]}: "
                 + ", ".join(failed))
    print(f"regression: passed: no step more than {cli.threshold:.0%} slower than {baseline['commit'][:10]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="Measure HEAD and write this machine's baseline.")
    parser.add_argument("--runs", type=int, default=2, help="Runs of each script per side.")
    parser.add_argument("--threshold", type=float, default=0.10, help="The slowdown that fails the check.")
    parser.add_argument("--names", default=",".join(RUNS), help=f"Comma-separated runs to time, of {', '.join(RUNS)}.")
    parser.add_argument("--baseline", default="", help="Baseline file (default: bench/baselines/<machine>.json).")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "bench_regression"),
                        help="The model, data, logs and run folder.")
    cli = parser.parse_args()
    cli.names = [n for n in cli.names.split(",") if n]
    unknown = [n for n in cli.names if n not in RUNS]
    if unknown:
        sys.exit(f"regression: unknown --names {unknown}; known: {', '.join(RUNS)}")
    path = cli.baseline or os.path.join(ROOT, "bench", "baselines", f"{machine()}.json")
    os.makedirs(cli.workdir, exist_ok=True)
    model_dir = build(cli.workdir)
    (write_baseline if cli.write else check)(cli, path, model_dir)


if __name__ == "__main__":
    main()
