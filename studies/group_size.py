"""studies/group_size.py: the numbers, table and plot of the group-size study (docs/studies.md).

Design document, open question 1: "How do group sizes (G in {4, 8, 16}) in GRPO affect variance
reduction versus generation latency?" Every G gets the same budget of 64 sampled completions
per step (--batch_size 16 / 8 / 4 prompts), so G trades prompts per step for samples per prompt.

This script (1) reads the training runs of sweep.py (summary.json, metrics.jsonl) and eval.py's
results.json for them; (2) measures, at the starting SFT policy, the variance of the GRPO
gradient estimate of one 64-completion batch for each G, over --num_gradients independent
batches, and the seconds of rollout (generation) and of update (log-probs + backward) per
batch, the three G interleaved so that the load of a shared machine falls on all alike;
(3) prints the markdown table and saves the plot and the numbers.

Gradient variance: g_k is the gradient of grpo.grpo_loss (beta 0: at the SFT policy the KL term
has zero gradient anyway) on the k-th independent batch; with K batches,
    V = 1/(K-1) sum_k ||g_k - mean g||^2          (trace of the covariance, unbiased)
    S = ||mean g||^2 - V / K                      (squared norm of E g, unbiased)
and V / S is the noise-to-signal ratio of one step's gradient: lower is better.

Run (after the sweep and eval.py of docs/studies.md):
    python studies/group_size.py --runs runs/group_size --eval runs/eval_group_size --model runs/sft
"""

import argparse
import glob
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlhf import checkpoints  # noqa: E402
import common  # noqa: E402
from rlhf import data  # noqa: E402
import grpo  # noqa: E402
from rlhf import sampling  # noqa: E402

GROUPS = [(4, 16), (8, 8), (16, 4)]  # (G, prompts per step): 64 completions each


def measure_gradients(model_path, num_gradients, seed):
    """Per G: gradient noise-to-signal at the SFT policy, advantage statistics, seconds."""
    args = grpo.Args(model=model_path, beta=0.0, seed=seed, temperature=0.7, max_completion_length=32)  # the study's settings
    common.set_seed(seed)
    tokenizer = common.load_tokenizer(model_path)
    model = common.load_model(model_path, args)
    model.train()
    ds = common.embedded_world(seed)["rl"]
    prompts = [data.render_prompt(tokenizer, p) for p in ds["prompt"]]
    gold = common.load_reward_fn("gold")
    rng = np.random.default_rng(seed)
    grads = {G: [] for G, _ in GROUPS}
    stats = {G: {"rollout_seconds": [], "update_seconds": [], "reward_std": [], "frac_reward_zero_std": []} for G, _ in GROUPS}
    for k in range(num_gradients):
        for G, batch_size in GROUPS[k % 3:] + GROUPS[:k % 3]:  # interleaved, rotated: the load falls on every G alike
            idx = rng.choice(len(ds), size=batch_size, replace=False).tolist()
            prompt_ids, prompt_mask = data.encode_prompts(tokenizer, [prompts[i] for i in idx], args.max_prompt_length)
            t0 = time.perf_counter()
            completion_ids, completion_mask, truncated = sampling.generate(model, tokenizer, prompt_ids, prompt_mask,
                                                                 args.max_completion_length, args.temperature,
                                                                 num_return_sequences=G)  # (64, C)
            t1 = time.perf_counter()
            texts = sampling.decode_completions(tokenizer, completion_ids, completion_mask, truncated)
            group = [i for i in idx for _ in range(G)]
            reward = common.call_reward_fns([gold], [ds["prompt"][i] for i in group], texts, None,
                                            {"post": [ds["post"][i] for i in group]}, G)[:, 0]
            advantages = grpo.group_advantages(reward, G, "group")  # (64,)
            t2 = time.perf_counter()
            logprobs = sampling.completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, args.temperature)
            loss, _ = grpo.grpo_loss(logprobs, logprobs.detach(), None, advantages, completion_mask, args)
            model.zero_grad(set_to_none=True)
            loss.backward()
            t3 = time.perf_counter()
            grads[G].append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double())
            group_std = reward.view(-1, G).std(1)
            s = stats[G]
            s["rollout_seconds"].append(t1 - t0)
            s["update_seconds"].append(t3 - t2)
            s["reward_std"].append(float(group_std.mean()))
            s["frac_reward_zero_std"].append(float(torch.isclose(group_std, torch.zeros_like(group_std)).float().mean()))
        print(f"group_size: gradient batch {k + 1}/{num_gradients}", flush=True)
    out = {}
    for G, _ in GROUPS:
        g = torch.stack(grads[G])  # (K, P)
        variance, signal = variance_and_signal(g)
        # jackknife standard errors (leave one batch out; Efron & Tibshirani 1993, Ch. 11)
        loo = [variance_and_signal(torch.cat([g[:k], g[k + 1:]])) for k in range(num_gradients)]
        def jackknife_se(values):
            values = np.asarray(values)
            return float(np.sqrt((len(values) - 1) / len(values) * ((values - values.mean()) ** 2).sum()))
        out[G] = {"grad_variance": variance, "grad_signal": signal, "noise_to_signal": variance / signal,
                  "grad_variance_se": jackknife_se([v for v, _ in loo]),
                  "noise_to_signal_se": jackknife_se([v / s for v, s in loo]),
                  **{key: float(np.mean(v)) for key, v in stats[G].items()},
                  "rollout_seconds_sd": float(np.std(stats[G]["rollout_seconds"])),
                  "update_seconds_sd": float(np.std(stats[G]["update_seconds"]))}
    return out


def variance_and_signal(g):
    """V = 1/(K-1) sum_k ||g_k - mean g||^2 and S = ||mean g||^2 - V / K for K gradients (K, P)."""
    variance = float(((g - g.mean(0)) ** 2).sum() / (g.shape[0] - 1))
    return variance, float((g.mean(0) ** 2).sum()) - variance / g.shape[0]


def read_runs(runs_dir):
    """Per G: each seed's summary.json and the means of its logged metrics over training."""
    out = {}
    for G, batch_size in GROUPS:
        rows = []
        for run in sorted(glob.glob(os.path.join(runs_dir, f"num_generations{G}-batch_size{batch_size}", "seed*"))):
            with open(os.path.join(run, "summary.json")) as f:
                summary = json.load(f)
            with open(os.path.join(run, "metrics.jsonl")) as f:
                metrics = [json.loads(line) for line in f]
            rows.append({"run": run, "gold_score": summary["gold_score"], "seconds_per_step": summary["seconds_per_step"],
                         "train_seconds": summary["train_seconds"],
                         "reward_curve": [m["reward"] for m in metrics],  # mean gold of the step's samples
                         "reward_first_half": float(np.mean([m["reward"] for m in metrics[:len(metrics) // 2]])),
                         **{key: float(np.mean([m[key] for m in metrics])) for key in ("reward_std", "frac_reward_zero_std", "grad_norm")}})
        if not rows:
            common.fail(f"no runs for G={G} under {runs_dir}: run the sweep of docs/studies.md first.")
        out[G] = rows
    return out


def plot(path, runs, results, measured, baseline):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Gs = [G for G, _ in GROUPS]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    ax = axes[0]
    for j, G in enumerate(Gs):
        p = results["policies"][f"G{G}"]
        ax.errorbar(j - 0.08, p["score"], yerr=[[p["score"] - p["score_seed_ci_low"]], [p["score_seed_ci_high"] - p["score"]]],
                    fmt="o", capsize=5, color="tab:blue", label="mean, 95% CI seeds + prompts" if j == 0 else None)
        ax.errorbar(j + 0.08, p["score"], yerr=[[p["score"] - p["score_ci_low"]], [p["score_ci_high"] - p["score"]]],
                    fmt="o", capsize=3, color="tab:orange", label="mean, 95% CI prompts only" if j == 0 else None)
        ax.scatter([j] * len(runs[G]), [r["gold_score"] for r in runs[G]], marker="x", color="grey",
                   label="one seed" if j == 0 else None, zorder=3)
    ax.axhline(baseline, color="grey", linestyle="--", linewidth=1, label="SFT start")
    ax.set_xticks(range(3), [f"G={G}\n{64 // G} prompts" for G in Gs])
    ax.set_ylabel("test gold score")
    ax.set_title("Gold score after training")
    ax.legend(fontsize=7, loc="lower right")
    ax = axes[1]
    for j, G in enumerate(Gs):
        m = measured[G]
        ax.bar(j - 0.2, m["rollout_seconds"], 0.4, yerr=m["rollout_seconds_sd"], color="tab:green", capsize=3,
               label="rollout (generation), interleaved" if j == 0 else None)
        ax.bar(j + 0.2, m["update_seconds"], 0.4, yerr=m["update_seconds_sd"], color="tab:purple", capsize=3,
               label="update (log-probs + backward)" if j == 0 else None)
    ax.set_xticks(range(3), [f"G={G}" for G in Gs])
    ax.set_ylabel("seconds per 64 completions")
    ax.set_title("Latency per step (mean +- sd)")
    ax.legend(fontsize=7)
    ax = axes[2]
    ax.errorbar(range(3), [measured[G]["noise_to_signal"] for G in Gs], yerr=[measured[G]["noise_to_signal_se"] for G in Gs],
                fmt="o-", capsize=4, color="tab:red")
    ax.set_xticks(range(3), [f"G={G}" for G in Gs])
    ax.set_ylabel("tr Cov(g) / ||E g||^2")
    ax.set_title("Gradient noise-to-signal at SFT (+- jackknife se)")
    ax = axes[3]
    for G in Gs:  # training reward, mean over seeds, 10-step moving average
        curve = np.mean([r["reward_curve"] for r in runs[G]], 0)
        ax.plot(np.arange(10, len(curve) + 1), np.convolve(curve, np.ones(10) / 10, "valid"), label=f"G={G}")
    ax.set_xlabel("step (64 completions each)")
    ax.set_ylabel("reward of the samples (gold)")
    ax.set_title("Training reward, mean of seeds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="runs/group_size", help="sweep.py's --output_dir")
    parser.add_argument("--eval", default="runs/eval_group_size", help="eval.py's --output_dir for sft, G4, G8, G16")
    parser.add_argument("--model", default="runs/sft", help="the SFT policy every run started from")
    parser.add_argument("--num_gradients", type=int, default=16, help="independent batches per G for the gradient variance")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="studies/group_size", help="writes <output>.png and <output>.json")
    a = parser.parse_args()
    runs = read_runs(a.runs)
    with open(os.path.join(a.eval, "results.json")) as f:
        results = json.load(f)
    t = time.time()
    measured = measure_gradients(a.model, a.num_gradients, a.seed)
    measure_seconds = time.time() - t
    baseline = results["policies"]["sft"]["score"]
    plot(a.output + ".png", runs, results, measured, baseline)
    checkpoints.write_json(a.output + ".json", {"runs": runs, "measured_at_sft": measured, "measure_seconds": measure_seconds,
                                           "eval": {k: results[k] for k in ("policies", "pairwise", "elo")}})

    # the table of docs/studies.md
    def ci(p, key="score"):
        return (f"{p[key]:.3f} ({p[key + '_ci_low']:.3f}, {p[key + '_ci_high']:.3f}) | "
                f"({p[key + '_seed_ci_low']:.3f}, {p[key + '_seed_ci_high']:.3f})")

    wins = {(r["policy_a"], r["policy_b"]): r for r in results["pairwise"]}
    print("| G x prompts | gold per seed | gold (95% CI prompts) | 95% CI seeds + prompts | win rate vs sft (seeds + prompts CI) "
          "| s/step in training (seeds) | rollout s / update s per 64 (interleaved) | completions/s | reward_std | "
          "frac_reward_zero_std | train reward, first half | grad noise-to-signal |")
    print("|" + "---|" * 12)
    for G, batch_size in GROUPS:
        p, m, rs = results["policies"][f"G{G}"], measured[G], runs[G]
        w = wins[f"G{G}", "sft"]
        sps = ", ".join(f"{r['seconds_per_step']:.2f}" for r in rs)
        golds = ", ".join(f"{r['gold_score']:.3f}" for r in rs)
        print(f"| {G} x {batch_size} | {golds} | {ci(p)} | "
              f"{w['win_rate']:.2f} ({w['seed_ci_low']:.2f}, {w['seed_ci_high']:.2f}) | "
              f"{sps} | {m['rollout_seconds']:.2f} / {m['update_seconds']:.2f} | "
              f"{64 / (m['rollout_seconds'] + m['update_seconds']):.0f} | "
              f"{np.mean([r['reward_std'] for r in rs]):.3f} | {np.mean([r['frac_reward_zero_std'] for r in rs]):.3f} | "
              f"{np.mean([r['reward_first_half'] for r in rs]):.3f} | "
              f"{m['noise_to_signal']:.1f} +- {m['noise_to_signal_se']:.1f} |")
    print("\nPairs (win rate of a, 95% CI prompts | seeds + prompts):")
    for r in results["pairwise"]:
        print(f"| {r['policy_a']} | {r['policy_b']} | {r['win_rate']:.3f} ({r['ci_low']:.3f}, {r['ci_high']:.3f}) | "
              f"({r['seed_ci_low']:.3f}, {r['seed_ci_high']:.3f}) |")
    print(f"\ngroup_size: measured at the SFT policy in {measure_seconds:.0f} s; saved {a.output}.png and {a.output}.json")


if __name__ == "__main__":
    main()
