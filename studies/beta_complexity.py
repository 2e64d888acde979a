"""studies/beta_complexity.py: the table and plot of the beta-versus-complexity study (docs/studies.md).

Design document, open question: "How does the distribution of prompt complexity impact the
optimal KL penalty coefficient beta?" On the arithmetic world with both difficulty levels
(`--dataset embedded:arith:1,2`: two-number additions and three-number chains), one SFT policy
is trained with GRPO and the strict verifier at beta in {0, 0.01, 0.04, 0.1}, three seeds each
(sweep.py); eval.py scores every run greedily on the held-out split, per level (--group_by
level), with the two-level bootstrap CI over seeds and prompts.

This script only reads what those runs wrote: eval.py's results.json (accuracy per method and
per level, both CIs) and each run's metrics.jsonl (the k3 KL to the reference, which grpo.py
logs for every beta but 0, which loads no reference, and the training reward). It prints the markdown table,
and saves the plot and the numbers.

Run (after the commands of docs/studies.md):
    python studies/beta_complexity.py --runs runs/beta --eval runs/eval_beta
"""

import argparse
import glob
import json
import os
import re

import numpy as np


def run_metrics(folder, last):
    """Mean KL and training reward over the last `last` logged steps of one run, and its steps."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "grad_norm" in r]  # training steps (not evaluations)
    tail = rows[-last:]
    kl = [r["kl"] for r in tail if "kl" in r]  # beta 0 loads no reference, so logs no KL
    return {"kl": float(np.mean(kl)) if kl else float("nan"), "train_reward": float(np.mean([r["reward"] for r in tail])),
            "steps": rows[-1]["step"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="runs/beta", help="sweep.py's --output_dir (folders beta<B>/seed<S>)")
    parser.add_argument("--eval", default="runs/eval_beta", help="eval.py's --output_dir for those runs, with --group_by level")
    parser.add_argument("--baseline", default="sft", help="the method name of the starting policy in eval.py's command")
    parser.add_argument("--last", type=int, default=20, help="steps averaged for the KL and the training reward")
    parser.add_argument("--output", default="studies/beta_complexity", help="writes <output>.png and <output>.json")
    args = parser.parse_args()

    results = json.load(open(os.path.join(args.eval, "results.json")))
    policies = results["policies"]
    betas = sorted((float(re.fullmatch(r"beta(.+)", name).group(1)), name) for name in policies if name.startswith("beta"))
    levels = sorted(policies[args.baseline]["by_group"], key=int)
    rows = []
    for beta, name in betas:
        train = [run_metrics(folder, args.last) for folder in sorted(glob.glob(os.path.join(args.runs, name, "seed*")))]
        p = policies[name]
        rows.append({"beta": beta, "method": name, "runs": p["runs"],
                     "accuracy": [p["score"], p["score_seed_ci_low"], p["score_seed_ci_high"]],
                     "per_run_accuracy": [results["runs"][r]["score"] for r in p["runs"]],
                     "by_level": {lv: [p["by_group"][lv][k] for k in ("score", "seed_ci_low", "seed_ci_high")] for lv in levels},
                     "kl": float(np.mean([t["kl"] for t in train])), "kl_per_run": [t["kl"] for t in train],
                     "train_reward": float(np.mean([t["train_reward"] for t in train])),
                     "steps": [t["steps"] for t in train]})
    base = policies[args.baseline]
    baseline = {"accuracy": [base["score"], base["score_ci_low"], base["score_ci_high"]],
                "by_level": {lv: [base["by_group"][lv][k] for k in ("score", "ci_low", "ci_high")] for lv in levels},
                "n_by_level": {lv: base["by_group"][lv]["n"] for lv in levels}}

    fmt = lambda v: f"{v[0]:.3f} ({v[1]:.3f}, {v[2]:.3f})"  # noqa: E731
    print("| beta | accuracy, all (95% CI seeds + prompts) | " + " | ".join(
        f"level {lv} ({baseline['n_by_level'][lv]} prompts)" for lv in levels) + " | accuracy per seed | KL to reference, last "
          f"{args.last} steps | training reward, last {args.last} steps |")
    print("|---" * (5 + len(levels)) + "|")
    print(f"| SFT (start) | {fmt(baseline['accuracy'])} | " + " | ".join(fmt(baseline["by_level"][lv]) for lv in levels)
          + " | - | 0 | - |")
    for r in rows:
        print(f"| {r['beta']:g} | {fmt(r['accuracy'])} | " + " | ".join(fmt(r["by_level"][lv]) for lv in levels)
              + f" | {', '.join(f'{a:.3f}' for a in r['per_run_accuracy'])} | "
              + ("-" if np.isnan(r["kl"]) else f"{r['kl']:.3f}") + f" | {r['train_reward']:.3f} |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(rows))
    for i, lv in enumerate(levels):
        vals = np.array([r["by_level"][lv] for r in rows])
        color = f"C{i}"
        axes[0].errorbar(x + 0.08 * (i - 0.5), vals[:, 0], yerr=[vals[:, 0] - vals[:, 1], vals[:, 2] - vals[:, 0]],
                         marker="o", capsize=4, color=color, label=f"level {lv} (GRPO, 3 seeds)")
        axes[0].axhline(baseline["by_level"][lv][0], color=color, linestyle="--", linewidth=1, label=f"level {lv}: SFT start")
    axes[0].set_xticks(x, [f"{r['beta']:g}" for r in rows])
    axes[0].set_xlabel("beta (k3 KL weight)")
    axes[0].set_ylabel("held-out strict accuracy (greedy)")
    axes[0].set_title("accuracy per level, 95% CI over seeds + prompts")
    axes[0].legend(fontsize=8)
    axes[1].plot(x, [r["kl"] for r in rows], marker="o")
    for r, xi in zip(rows, x):
        axes[1].scatter([xi] * len(r["kl_per_run"]), r["kl_per_run"], color="grey", s=10)
    axes[1].set_xticks(x, [f"{r['beta']:g}" for r in rows])
    axes[1].set_xlabel("beta (k3 KL weight)")
    axes[1].set_ylabel(f"KL to the SFT reference, last {args.last} steps")
    axes[1].set_title("how far the policy moved")
    fig.tight_layout()
    fig.savefig(args.output + ".png", dpi=120)
    with open(args.output + ".json", "w") as f:
        json.dump({"baseline": baseline, "betas": rows, "eval_settings": results["settings"]}, f, indent=2)
    print(f"saved {args.output}.png and {args.output}.json")


if __name__ == "__main__":
    main()
