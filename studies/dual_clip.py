"""docs/studies.md, claim 3 ("dual clipping prevents policy collapse"): summarise a dual-clip sweep.

Reads the sweep's run folders (metrics.jsonl of grpo.py or ppo.py runs, one folder per setting and
seed) and eval.py's results.json over them, and writes one JSON: per setting, the held-out
accuracy with eval.py's CIs, each seed's accuracy, how many runs collapsed (accuracy below
`--collapse` times SFT's), and each run's training curve in a few numbers: the training reward of
the first 4 and the last 20 steps, how often the standard clip and the dual clip bound (per token,
averaged over steps) and on how many steps the dual clip bound at all.

    python studies/dual_clip.py --runs runs/dual_grpo --eval runs/eval_dual --output studies/dual_clip_grpo.json \\
        --command_sweep "..." --command_eval "..."

The method names in results.json are the sweep's settings written as eval.py was given them
(`lr3e-4_dual3=runs/dual_grpo/learning_rate3e-4-dual_clip_c3/seed*`): the settings are matched by
the run folders each method holds.
"""

import argparse
import glob
import json
import os

# the per-token shares of the clips, as each script logs them
CLIP_METRICS = {"grpo": ("clip_ratio", "clip_ratio/dual_mean"), "ppo": ("clipfrac", "dual_clip_frac")}


def read_metrics(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "reward" in r]  # training steps (eval rows carry eval_* only)


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def summarise_run(run, seed):
    rows = read_metrics(run)
    script = "ppo" if "dual_clip_frac" in rows[0] else "grpo"
    clip, dual = CLIP_METRICS[script]
    return {"seed": seed, "script": script, "steps": len(rows),
            "reward_first_4_steps": mean([r["reward"] for r in rows[:4]]),
            "reward_last_20_steps": mean([r["reward"] for r in rows[-20:]]),
            "clip_mean": mean([r[clip] for r in rows]), "dual_clip_mean": mean([r[dual] for r in rows]),
            "steps_dual_binds": sum(r[dual] > 0 for r in rows)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", required=True, help="the sweep's --output_dir (SETTING/seedS folders)")
    p.add_argument("--eval", required=True, help="eval.py's --output_dir over the sweep's runs and sft=")
    p.add_argument("--output", required=True, help="the JSON to write")
    p.add_argument("--collapse", type=float, default=0.5, help="a run collapses below this share of SFT's accuracy")
    p.add_argument("--command_sweep", default="")
    p.add_argument("--command_eval", default="")
    args = p.parse_args()

    with open(os.path.join(args.eval, "results.json")) as f:
        results = json.load(f)
    sft = results["policies"]["sft"]["score"]
    by_path = {os.path.normpath(r["path"]): r for r in results["runs"].values()}
    out = {"command_sweep": args.command_sweep, "command_eval": args.command_eval, "sft_accuracy": sft,
           "collapse_below": args.collapse * sft, "settings": {}}
    for setting in sorted(os.listdir(args.runs)):
        runs = sorted(glob.glob(os.path.join(args.runs, setting, "seed*")))
        if not runs:
            continue
        method = next((m for m, pol in results["policies"].items()
                       if {os.path.normpath(x) for x in pol["paths"]} == {os.path.normpath(x) for x in runs}), None)
        if method is None:
            raise SystemExit(f"{args.eval}/results.json has no policy made of exactly {runs}: evaluate the sweep first.")
        pol = results["policies"][method]
        per_seed = [by_path[os.path.normpath(r)]["score"] for r in runs]
        out["settings"][setting] = {
            "method": method, "accuracy": pol["score"], "ci_prompts": [pol["score_ci_low"], pol["score_ci_high"]],
            "ci_seeds_prompts": [pol["score_seed_ci_low"], pol["score_seed_ci_high"]],
            "accuracy_per_seed": per_seed, "runs_collapsed": sum(a < args.collapse * sft for a in per_seed),
            "training": [summarise_run(r, int(os.path.basename(r)[4:])) for r in runs]}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    print("| setting | accuracy (CI prompts) | CI seeds + prompts | per seed | collapsed | reward first 4 -> last 20 | steps dual binds |")
    print("|---|---|---|---|---|---|---|")
    for setting, s in out["settings"].items():
        curves = ", ".join(f"{t['reward_first_4_steps']:.2f}->{t['reward_last_20_steps']:.2f}" for t in s["training"])
        print(f"| {setting} | {s['accuracy']:.3f} ({s['ci_prompts'][0]:.3f}, {s['ci_prompts'][1]:.3f}) | "
              f"({s['ci_seeds_prompts'][0]:.3f}, {s['ci_seeds_prompts'][1]:.3f}) | "
              f"{', '.join(f'{a:.3f}' for a in s['accuracy_per_seed'])} | {s['runs_collapsed']} of {len(s['training'])} | "
              f"{curves} | {', '.join(str(t['steps_dual_binds']) for t in s['training'])} |")
    print(f"saved {args.output}")


if __name__ == "__main__":
    main()
