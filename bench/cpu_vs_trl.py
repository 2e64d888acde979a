"""bench/cpu_vs_trl.py: steady-state seconds per step of our sft.py, dpo.py and grpo.py against
TRL's SFTTrainer, DPOTrainer and GRPOTrainer, at identical settings, on the same model: a tiny one
by default, or a real one with --model (e.g. models/SmolLM2-135M-Instruct from `make real-model`).

A benchmark, not a test. Both sides run as subprocesses with the same environment (one thread
each by default), on a Llama with hidden size 256 and 4 layers built locally with the embedded
world's tokenizer, on the same rows of the embedded world written to .jsonl files:
- SFT:  8 examples a step.
- DPO:  8 pairs a step, beta 0.1, sigmoid loss; reference handling as each project defaults
        (ours: log-probs precomputed before training; TRL: a frozen reference model forward).
- GRPO: 2 prompts x 8 generations, 32 new tokens, temperature 1, beta 0.04, loss_type grpo, one optimizer
        step per rollout, the gold judge as the reward function.
All: torch's fused AdamW (ours --optim adamw, TRL's adamw_torch_fused; lr 1e-5, no weight decay, constant schedule, clip 1.0), fp32, no checkpoints,
no evaluation. Steady state: each configuration runs twice, with --short and --long steps, and
the difference of the two times over the difference of steps cancels start-up (imports,
loading, tokenising, precomputing) and the final save. Two clocks: wall-clock, and CPU time
(user + system of the process and its threads), which is the steadier one on a shared machine
because it does not count waiting for a core. With OMP_NUM_THREADS=1 the two agree on an idle
machine. The two sides of each configuration run interleaved (ours, TRL's, ours, TRL's), so
both see the same load. --repeats N does that N times, the sides' order alternating; each repeat
gives a ratio of two runs side by side, and the result is their median (all N in `cpu_ratios`):
on a machine whose speed drifts by 10-20% within an hour, one pair is a draw from that spread.

With --model, that model (and its tokenizer) replaces the tiny one, on the same rows, at smaller
batches (REAL_BATCHES: a real model's step is seconds to minutes on a CPU): GRPO 1 prompt x 8
generations (TRL's per_device_train_batch_size 8), DPO 2 pairs, SFT 2 examples; and on the first
REAL_ROWS rows of each dataset (more steps than rows/batch cycle through them on both sides).

Run (TRL lives in its own venv so it never changes the project's environment):
    python -m venv --system-site-packages .venv-bench
    .venv-bench/bin/pip install -r bench/requirements.txt
    OMP_NUM_THREADS=1 python bench/cpu_vs_trl.py --trl_python .venv-bench/bin/python
    OMP_NUM_THREADS=1 python bench/cpu_vs_trl.py --model models/SmolLM2-135M-Instruct     # GRPO 2 and 6 steps, DPO and SFT 2 and 10
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# the shared settings, as our flags; the TRL side below spells the same numbers in its names
SETTINGS = {
    "sft": dict(batch_size=8, max_prompt_length=512, max_completion_length=256),
    "dpo": dict(batch_size=8, beta=0.1, max_prompt_length=512, max_completion_length=256),
    "grpo": dict(batch_size=2, num_generations=8, max_completion_length=32, beta=0.04, temperature=1.0, max_prompt_length=512),
}
REAL_BATCHES = {"sft": 2, "dpo": 2, "grpo": 1}  # --model: micro-batches a real model's CPU step can afford
# --model: rows of each dataset. Our DPO's start-up scores every pair with the reference once; over 256
# pairs that was ~100 s of CPU on SmolLM2-135M, whose noise swamped 4 steps of 2-5 s in the difference
REAL_ROWS = 32
REAL_LONG = {"grpo": 10, "dpo": 10, "sft": 10}  # --model: steps of the long run (each a few CPU-seconds; 8 steps apart from the short run, so a run's noise is an eighth of a step)
# gradient_accumulation_steps 1 as TRL's side: grpo.py's default for a pretrained model (anything but the
# embedded policy, this tiny Llama too) is 8 micro-batches a step
COMMON = dict(learning_rate=1e-5, optim="adamw", lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
              weight_decay=0.0, dtype="float32", attn_implementation="sdpa", logging_steps=1, seed=0,
              gradient_accumulation_steps=1)
DATA = {"sft": ("sft", ["prompt", "completion"], 512), "dpo": ("prefs", ["prompt", "chosen", "rejected"], 256),
        "grpo": ("rl", ["prompt", "post"], 256)}


def build(workdir, rows=0):
    """The tiny Llama (hidden 256, 4 layers) and the three datasets (their first `rows` rows if
    given), written once to workdir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import common
    from worlds import world

    model_dir = os.path.join(workdir, "model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        tok = world.build_tokenizer()
        config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                             tie_word_embeddings=False)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    embedded = common.embedded_world(0)
    for algo, (split, columns, n) in DATA.items():
        path = os.path.join(workdir, f"{algo}.jsonl")
        with open(path, "w") as f:
            for row in embedded[split].select(range(min(n, rows or n))):
                f.write(json.dumps({c: row[c] for c in columns}) + "\n")
    return model_dir


def settings(algo, real):
    """The shared settings of `algo`, as our flags; `real`: at REAL_BATCHES' batch size."""
    return {**COMMON, **SETTINGS[algo], **({"batch_size": REAL_BATCHES[algo]} if real else {})}


def ours_command(algo, model, data, steps, out, real):
    flags = {**settings(algo, real), "model": model, "dataset": data, "max_steps": steps, "output_dir": out}
    if algo == "grpo":
        flags["reward_fn"] = "gold"
    return [sys.executable, os.path.join(ROOT, f"{algo}.py")] + [f"--{k}={v}" for k, v in flags.items()]


def run_trl(algo, model_dir, data, steps, out, real):
    """Inside the venv that has TRL: train `steps` steps with TRL's trainer at our settings."""
    trl_trainer(algo, model_dir, data, out, {**settings(algo, real), "max_steps": steps}).train()


def trl_trainer(algo, model_dir, data, out, s):
    """TRL's trainer for `algo` with settings `s` (our flag names: learning_rate, batch_size,
    beta, ...; GRPO's batch_size counts prompts), torch's fused AdamW at a constant lr, fp32 on the CPU.
    bench/trl_quality.py builds its TRL runs with this too."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import trl
    from worlds import world

    torch.manual_seed(s["seed"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    ds = load_dataset("json", data_files=data, split="train")
    kw = dict(output_dir=out, max_steps=s["max_steps"], learning_rate=s["learning_rate"], optim="adamw_torch_fused",
              lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
              logging_steps=s["logging_steps"], save_strategy="no", report_to="none", use_cpu=True, bf16=False,
              seed=s["seed"], gradient_accumulation_steps=1, dataloader_num_workers=0, disable_tqdm=True)
    if algo == "sft":
        config = trl.SFTConfig(per_device_train_batch_size=s["batch_size"], max_length=1024, **kw)
        return trl.SFTTrainer(model=model, args=config, train_dataset=ds, processing_class=tokenizer)
    if algo == "dpo":
        config = trl.DPOConfig(per_device_train_batch_size=s["batch_size"], beta=s["beta"],
                               loss_type=[s.get("loss_type", "sigmoid")], max_length=1024, **kw)
        return trl.DPOTrainer(model=model, args=config, train_dataset=ds, processing_class=tokenizer)
    G = s["num_generations"]
    config = trl.GRPOConfig(per_device_train_batch_size=s["batch_size"] * G, num_generations=G,
                            max_completion_length=s["max_completion_length"], beta=s["beta"],
                            loss_type=s.get("loss_type", "grpo"), num_iterations=1, steps_per_generation=1,
                            temperature=s["temperature"], **kw)
    return trl.GRPOTrainer(model=model, reward_funcs=world.gold_reward, args=config, train_dataset=ds,
                           processing_class=tokenizer)


def timed(cmd, env, log):
    """Wall-clock and CPU seconds (user + system, all threads) of one subprocess. On a shared
    machine CPU time is the steadier measure: it does not count time spent waiting for a core."""
    cpu0, start = _children_cpu(), time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu0
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[:3])} ... exited {proc.returncode}; see {log}")
    return wall, cpu


def _children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl_python", default=".venv-bench/bin/python", help="Python of the venv that has TRL.")
    parser.add_argument("--algos", default="grpo,dpo,sft", help="Comma-separated: sft, dpo, grpo.")
    parser.add_argument("--short", type=int, default=2, help="Steps of the short run.")
    parser.add_argument("--long", type=int, default=0, help="Steps of the long run (default: 12 for GRPO, 32 for DPO and SFT, whose steps are shorter; with --model REAL_LONG: 10 each).")
    parser.add_argument("--model", default="", help="A model folder to time instead of the tiny Llama (e.g. models/SmolLM2-135M-Instruct); batches from REAL_BATCHES.")
    parser.add_argument("--workdir", default="/tmp/bench_cpu", help="Model, data, logs and run folders.")
    parser.add_argument("--output", default="", help="Results JSON (default: bench/results_cpu.json, with --model bench/results_cpu_<its folder name>.json).")
    parser.add_argument("--repeats", type=int, default=1, help="Times to run each side's short and long pair, interleaved (the sides' order alternating); step times and the ratio are the medians over the repeats, each repeat's ratio in cpu_ratios.")
    parser.add_argument("--only", default="ours,trl", help="Sides to run: ours,trl (default), ours, or trl.")
    parser.add_argument("--trl_worker", nargs=5, metavar=("ALGO", "MODEL", "DATA", "STEPS", "REAL"), help=argparse.SUPPRESS)
    parser.add_argument("--trl_out", default="", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.trl_worker:  # the TRL side of one run, inside the TRL venv
        algo, model_dir, data, steps, real = cli.trl_worker
        return run_trl(algo, model_dir, data, int(steps), cli.trl_out, real == "1")

    real = bool(cli.model)
    cli.output = cli.output or os.path.join(
        ROOT, "bench", f"results_cpu_{os.path.basename(os.path.normpath(cli.model))}.json" if real else "results_cpu.json")
    os.makedirs(cli.workdir, exist_ok=True)
    model_dir = build(cli.workdir, REAL_ROWS if real else 0)  # the tiny model (kept when there) and the data
    if real:
        model_dir = os.path.abspath(cli.model)
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": ROOT}
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    load_before = os.getloadavg()
    print(f"commit {commit}, load {load_before[0]:.1f} before the first run", flush=True)
    results = {}
    if os.path.exists(cli.output):  # keep the other algorithms' results when re-running one
        with open(cli.output) as f:
            results = json.load(f)
    for algo in cli.algos.split(","):
        data = os.path.join(cli.workdir, f"{algo}.jsonl")
        long = cli.long or (REAL_LONG if real else {"grpo": 12, "dpo": 32, "sft": 32})[algo]
        sides = cli.only.split(",")
        n = long - cli.short
        runs = {side: [] for side in sides}  # one entry a repeat: that repeat's two runs and their difference
        for repeat in range(cli.repeats):
            wall, cpu = {side: {} for side in sides}, {side: {} for side in sides}
            order = sides if repeat % 2 == 0 else sides[::-1]  # every other repeat starts with the other side
            for steps in (cli.short, long):  # interleaved: ours, TRL's, ours, TRL's, so both see the same load
                for side in order:
                    out = os.path.join(cli.workdir, f"{side}_{algo}_{steps}")
                    shutil.rmtree(out, ignore_errors=True)  # an earlier run's folder (our scripts refuse to overwrite one)
                    if side == "ours":
                        cmd = ours_command(algo, model_dir, data, steps, out, real)
                    else:
                        cmd = [cli.trl_python, os.path.abspath(__file__), "--trl_worker", algo, model_dir, data,
                               str(steps), "1" if real else "0", "--trl_out", out]
                    wall[side][steps], cpu[side][steps] = timed(cmd, env, out + ".log")
                    print(f"{side:4} {algo:4} {steps:3} steps: {wall[side][steps]:7.1f} s wall, "
                          f"{cpu[side][steps]:7.1f} s CPU, load {os.getloadavg()[0]:.1f}", flush=True)
            for side in sides:
                runs[side].append({"cpu_seconds_per_step": (cpu[side][long] - cpu[side][cli.short]) / n,
                                   "wall_seconds_per_step": (wall[side][long] - wall[side][cli.short]) / n,
                                   "wall_seconds": wall[side], "cpu_seconds": cpu[side]})
        for side in sides:  # the medians over the repeats (the one run's numbers with --repeats 1)
            results.setdefault(algo, {})[side] = {
                **{key: statistics.median(r[key] for r in runs[side])
                   for key in ("cpu_seconds_per_step", "wall_seconds_per_step")}, "repeats": runs[side]}
        if {"ours", "trl"} <= set(sides):  # each repeat's ratio, of two runs side by side; their median
            for kind in ("cpu", "wall"):
                key = f"{kind}_seconds_per_step"
                ratios = [o[key] / t[key] for o, t in zip(runs["ours"], runs["trl"])]
                results[algo][f"{kind}_ratio"], results[algo][f"{kind}_ratios"] = statistics.median(ratios), ratios
        elif {"ours", "trl"} <= results[algo].keys():  # one side now, the other from an earlier invocation
            for kind in ("cpu", "wall"):
                key = f"{kind}_seconds_per_step"
                results[algo][f"{kind}_ratio"] = results[algo]["ours"][key] / results[algo]["trl"][key]
        print(f"{algo}: {json.dumps(results[algo])}", flush=True)
    results["settings"] = {"common": COMMON, **{a: settings(a, real) for a in SETTINGS}, "model": cli.model or "tiny Llama",
                           "short": cli.short, "long": cli.long or (REAL_LONG if real else "12 GRPO, 32 DPO/SFT"), "repeats": cli.repeats,
                           "threads": env["OMP_NUM_THREADS"], "nproc": os.cpu_count(), "commit": commit,
                           "load_before": load_before, "load_after": os.getloadavg()}
    with open(cli.output, "w") as f:
        json.dump(results, f, indent=2)
    print(f"{'algo':5} {'ours CPU s/step':>15} {'TRL CPU s/step':>14} {'ratio':>6} {'ours wall':>10} {'TRL wall':>9} {'ratio':>6}")
    for algo in cli.algos.split(","):
        r = results.get(algo, {})
        if "cpu_ratio" in r:
            o, t = r["ours"], r["trl"]
            print(f"{algo:5} {o['cpu_seconds_per_step']:15.3f} {t['cpu_seconds_per_step']:14.3f} {r['cpu_ratio']:6.2f} "
                  f"{o['wall_seconds_per_step']:10.3f} {t['wall_seconds_per_step']:9.3f} {r['wall_ratio']:6.2f}"
                  + (f"  CPU ratio of each repeat: {' '.join(f'{x:.3f}' for x in r['cpu_ratios'])}"
                     if len(r.get("cpu_ratios", [])) > 1 else ""))


if __name__ == "__main__":
    main()
