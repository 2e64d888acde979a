"""bench/trl_quality.py: does each implementation learn? Our grpo.py and dpo.py against TRL's
GRPOTrainer and DPOTrainer, from the same SFT policy, on the same data, at the same settings;
then eval.py scores all of them (gold reward on the world's test prompts, win rate against the
SFT policy with its CI) and the wall-clock and CPU time of each training run.

A benchmark, not a test. It needs the embedded world's SFT policy (`python sft.py`, runs/sft),
whose tokenizer `AutoTokenizer` loads exactly as our scripts do, so TRL reads the same tokens.
Both sides get the world's splits as .jsonl files and train with:
- GRPO: 150 steps of 8 prompts x 8 completions (TRL: per_device_train_batch_size 64), one
  optimizer step per rollout, lr 5e-5, temperature 0.7, beta 0.04, loss_type grpo, at most 32
  new tokens, the gold judge as the reward function;
- DPO:  250 steps of 32 pairs, lr 1e-5, beta 0.1, sigmoid loss, no RPO term;
- both: torch AdamW, constant lr, no warmup, no weight decay, clip 1.0, fp32, seed 0.
What still differs, by each project's design: TRL's DPO runs a frozen reference model every
step (ours precomputes the reference log-probs once); sampling draws differ (each side has its
own random stream), so the two GRPO runs see different completions.

Run (TRL lives in its own venv so it never changes the project's environment):
    python -m venv --system-site-packages .venv-bench
    .venv-bench/bin/pip install -r bench/requirements.txt
    python sft.py                                    # runs/sft, if not there yet
    OMP_NUM_THREADS=1 python bench/trl_quality.py --trl_python .venv-bench/bin/python
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from cpu_vs_trl import timed, trl_trainer  # noqa: E402 (the speed benchmark's clocks and TRL set-up)

COMMON = dict(optim="adamw", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
              dtype="float32", seed=0, logging_steps=10)
SETTINGS = {
    "grpo": dict(max_steps=150, batch_size=8, num_generations=8, learning_rate=5e-5, temperature=0.7, beta=0.04,
                 loss_type="grpo", max_completion_length=32),
    "dpo": dict(max_steps=250, batch_size=32, learning_rate=1e-5, beta=0.1, loss_type="sigmoid",
                rpo_alpha=0.0),  # plain DPO: off in TRL; on by default for our embedded policy (dpo.py)
}
DATA = {"grpo": ("rl", ["prompt", "post"]), "dpo": ("prefs", ["prompt", "chosen", "rejected"])}


def write_data(workdir):
    import common

    world = common.embedded_world(0)
    for algo, (split, columns) in DATA.items():
        with open(os.path.join(workdir, f"{algo}.jsonl"), "w") as f:
            for row in world[split]:
                f.write(json.dumps({c: row[c] for c in columns}) + "\n")


def ours_command(algo, sft, data, out):
    flags = {**COMMON, **SETTINGS[algo], "model": sft, "dataset": data, "output_dir": out, "overwrite_output_dir": True}
    if algo == "grpo":
        flags["reward_fn"] = "gold"
    return [sys.executable, os.path.join(ROOT, f"{algo}.py")] + [f"--{k}={v}" for k, v in flags.items()]


def run_trl(algo, sft, data, out):
    """Inside the venv that has TRL: train with TRL's trainer at the settings above, save to `out`.
    The policy's tokenizer loads through plain AutoTokenizer, as Qwen2Tokenizer: the same ids as
    our loader (tests/test_scratch.py)."""
    trainer = trl_trainer(algo, sft, data, out, {**COMMON, **SETTINGS[algo]})
    trainer.train()
    trainer.save_model(out)  # model and tokenizer, as TRL users save them


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl_python", default=".venv-bench/bin/python", help="Python of the venv that has TRL.")
    parser.add_argument("--sft", default="runs/sft", help="The SFT policy both sides start from (sft.py's output).")
    parser.add_argument("--algos", default="grpo,dpo", help="Comma-separated: grpo, dpo.")
    parser.add_argument("--workdir", default="/tmp/bench_trl_quality", help="Data, logs and run folders.")
    parser.add_argument("--output", default=os.path.join(ROOT, "bench", "results_trl_quality.json"), help="Results JSON.")
    parser.add_argument("--max_steps", type=int, default=0, help="Override both algorithms' steps (a quick check of the setup; 0: the settings above).")
    parser.add_argument("--trl_worker", nargs=3, metavar=("ALGO", "SFT", "DATA"), help=argparse.SUPPRESS)
    parser.add_argument("--trl_out", default="", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.max_steps:
        for settings in SETTINGS.values():
            settings["max_steps"] = cli.max_steps
    if cli.trl_worker:  # the TRL side of one run, inside the TRL venv
        algo, sft, data = cli.trl_worker
        return run_trl(algo, sft, data, cli.trl_out)

    sft = os.path.abspath(cli.sft)
    if not os.path.isfile(os.path.join(sft, "config.json")):
        sys.exit(f"error: {cli.sft} holds no model: run `python sft.py` first.")
    os.makedirs(cli.workdir, exist_ok=True)
    write_data(cli.workdir)
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": ROOT}
    results, policies = {"settings": {"common": COMMON, **SETTINGS, "sft": cli.sft}}, [f"sft={sft}"]
    for algo in cli.algos.split(","):
        data = os.path.join(cli.workdir, f"{algo}.jsonl")
        for side in ("ours", "trl"):
            out = os.path.join(cli.workdir, f"{side}_{algo}")
            if side == "ours":
                cmd = ours_command(algo, sft, data, out)
            else:
                cmd = [cli.trl_python, os.path.abspath(__file__), "--trl_worker", algo, sft, data, "--trl_out", out,
                       "--max_steps", str(cli.max_steps)]
            wall, cpu = timed(cmd, env, out + ".log")
            results.setdefault(algo, {})[side] = {"wall_seconds": wall, "cpu_seconds": cpu}
            policies.append(f"{side}_{algo}={out}")
            print(f"{side:4} {algo:4}: {wall:7.1f} s wall, {cpu:7.1f} s CPU", flush=True)

    # every policy judged by eval.py: gold reward on the test prompts (greedy), win rate vs SFT
    eval_out = os.path.join(cli.workdir, "eval")
    timed([sys.executable, os.path.join(ROOT, "eval.py"), *policies, "--output_dir", eval_out], env, eval_out + ".log")
    with open(os.path.join(eval_out, "results.json")) as f:
        judged = json.load(f)
    results["eval"] = judged
    with open(cli.output, "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(eval_out, "results.md")) as f:
        print(f.read())
    print(f"saved {cli.output}")


if __name__ == "__main__":
    main()
