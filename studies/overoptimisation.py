"""studies/overoptimisation.py: the over-optimisation curves of issue #28, claim 2 (Gao et al. 2022).

Gao, Schulman & Hilton 2022 ("Scaling laws for reward model overoptimization", Fig. 1) follow a
policy trained against a learned proxy reward and plot, against d = sqrt(KL(pi || pi_ref)), the
proxy's score (which keeps rising) and the gold score (which rises, peaks and falls). Here the
proxy is reward.py's model (--reward_model) and the gold is the embedded world's judge, scored on
the runs' greedy completions of the world's test prompts by --eval_reward_fn gold.

For each run folder (metrics.jsonl of grpo.py or ppo.py) and each evaluation step this script takes
    proxy        eval_reward: the run's own (centred) reward of the greedy test completions
                 (ppo.py: completions without EOS count -missing_eos_penalty there, not in gold)
    proxy_train  reward: the training rollout's mean reward at that step (sampled completions)
    gold         eval_rewards/gold/mean: the gold judge on the same greedy completions
    kl           KL(pi || pi_ref) per completion, of the training step's sampled completions
                 (the eval completions are greedy, no sample of pi, so no KL estimate is taken on
                 them): ppo.py logs it per completion (`kl`: k1 summed over tokens); grpo.py logs
                 the per-token k3 mean (`kl`), multiplied here by the step's mean completion
                 length (`completions/mean_length`): the per-completion KL up to the covariance
                 of length and per-token KL within the batch
    sqrt_kl      sqrt(max(kl, 0)) (a batch's k1 estimate can be slightly negative)
and writes <output>.json and <output>.png (gold and proxy against sqrt(KL), one panel per method,
the runs overlaid). The training row used is the one logged at the evaluation step (or the last
before it, with --logging_steps > 1: then the window's mean).

Run (embedded world, after sft.py and reward.py):
    python grpo.py --reward_model runs/reward --eval_dataset embedded --eval_steps 10 --eval_reward_fn gold --output_dir runs/overopt/grpo
    python ppo.py --eval_dataset embedded --eval_steps 5 --eval_reward_fn gold --output_dir runs/overopt/ppo
    python studies/overoptimisation.py runs/overopt/grpo runs/overopt/ppo --output studies/overoptimisation
"""

import argparse
import json
import math
import os
import sys

GOLD = "eval_rewards/gold/mean"
KL_NOTE = {"ppo": "per completion: ppo.py's `kl` (k1 summed over tokens) of the training step's samples",
           "grpo": "per completion: grpo.py's per-token k3 `kl` x `completions/mean_length` of the training step's samples"}


def method_of(rows, run):
    """grpo or ppo, from the metrics only those scripts log."""
    keys = set().union(*rows)
    if "vf_loss" in keys:
        return "ppo"
    if "clip_ratio" in keys:
        return "grpo"
    sys.exit(f"error: {run}/metrics.jsonl logs neither ppo.py's vf_loss nor grpo.py's clip_ratio: pass runs of those two.")


def read_run(run):
    """One run's points: per evaluation step, proxy, proxy_train, gold, kl, sqrt_kl, mean_length."""
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        sys.exit(f"error: no {path}: pass the --output_dir of a grpo.py or ppo.py run.")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    method = method_of(rows, run)
    train = [r for r in rows if "eval_reward" not in r]
    evals = [r for r in rows if "eval_reward" in r]
    if not evals or GOLD not in evals[0]:
        sys.exit(f"error: {run} logs no {GOLD}: train with --eval_dataset embedded --eval_steps N --eval_reward_fn gold.")
    points = []
    for e in evals:
        before = [r for r in train if r["step"] <= e["step"]]
        if not before or "kl" not in before[-1]:
            sys.exit(f"error: {run} logs no training `kl` at or before step {e['step']} "
                             "(grpo.py --beta 0 loads no reference and logs none): rerun with --beta > 0.")
        t = before[-1]
        length = t.get("completions/mean_length")
        kl = t["kl"] * length if method == "grpo" else t["kl"]  # per completion (module docstring)
        points.append({"step": e["step"], "proxy": e["eval_reward"], "proxy_train": t.get("reward"), "gold": e[GOLD],
                       "kl": kl, "sqrt_kl": math.sqrt(max(kl, 0.0)), "mean_length": length, "train_step": t["step"]})
    return {"run": run, "method": method, "kl": KL_NOTE[method], "points": points}


def plot(path, runs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({r["method"] for r in runs})
    # top row: against sqrt(KL) (Gao et al.'s axis); bottom row: against the training step, where the
    # order of the points is plain (the logged KL of one step's samples is noisy)
    fig, axes = plt.subplots(2, len(methods), figsize=(5.5 * len(methods), 8), squeeze=False)
    for col, method in enumerate(methods):
        for row, (key, label) in enumerate((("sqrt_kl", "sqrt(KL to the reference), nats^0.5 per completion"),
                                            ("step", "training step"))):
            ax = axes[row][col]
            for j, r in enumerate(x for x in runs if x["method"] == method):
                x = [p[key] for p in r["points"]]
                color = f"C{j}"
                ax.plot(x, [p["gold"] for p in r["points"]], "o-", color=color, label=f"{r['run']}: gold")
                ax.plot(x, [p["proxy"] for p in r["points"]], "x--", color=color, label=f"{r['run']}: proxy")
            ax.set_xlabel(label)
            ax.set_ylabel("mean score of greedy test completions")
            ax.set_title(f"{method}: gold (solid) and proxy (dashed)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders of grpo.py / ppo.py (their metrics.jsonl)")
    parser.add_argument("--output", default="studies/overoptimisation", help="writes <output>.json and <output>.png")
    a = parser.parse_args(argv)
    runs = [read_run(run) for run in a.runs]
    with open(a.output + ".json", "w") as f:
        json.dump({"runs": runs}, f, indent=1)
    plot(a.output + ".png", runs)
    for r in runs:
        best = max(r["points"], key=lambda p: p["gold"])
        print(f"overoptimisation: {r['run']} ({r['method']}): gold peaks at {best['gold']:.3f} (step {best['step']}, "
              f"sqrt KL {best['sqrt_kl']:.2f}); last: gold {r['points'][-1]['gold']:.3f}, proxy {r['points'][-1]['proxy']:.3f}")


if __name__ == "__main__":
    main()
