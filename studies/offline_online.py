"""docs/studies.md, claim 1 ("offline DPO suffers from distribution drift on multi-step reasoning"):
collect eval.py's per-level accuracies and the DPO runs' implicit-reward statistics in one JSON.

    python studies/offline_online.py --eval runs/eval_c1 --runs runs/c1 --output studies/offline_online.json

From results.json: each method's accuracy with its CIs, per seed, per level (`--group_by level`)
and the head-to-head win rates. From each DPO run's metrics.jsonl: the mean over its steps of
`rewards/accuracies` and `rewards/margins` (on the step's own pairs, before the step's update:
offline, the demonstrator's pairs; online, fresh samples of the current policy) and the first
and last `logps/chosen` (how far the policy moved from the chosen completions).
"""

import argparse
import glob
import json
import os


def dpo_stats(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "rewards/margins" in r]
    mean = lambda k: sum(r[k] for r in rows) / len(rows)
    return {"run": run, "steps_with_pairs": len(rows), "mean_rewards_accuracies": mean("rewards/accuracies"),
            "mean_rewards_margins": mean("rewards/margins"), "logps_chosen_first": rows[0]["logps/chosen"],
            "logps_chosen_last": rows[-1]["logps/chosen"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eval", required=True)
    p.add_argument("--runs", required=True, help="the methods' sweep folders: METHOD/<setting>/seedS")
    p.add_argument("--output", required=True)
    args = p.parse_args()
    with open(os.path.join(args.eval, "results.json")) as f:
        results = json.load(f)
    out = {"policies": {}, "pairwise": [{k: x[k] for k in ("policy_a", "policy_b", "win_rate", "ci_low", "ci_high",
                                                            "seed_ci_low", "seed_ci_high")} for x in results["pairwise"]]}
    for name, pol in results["policies"].items():
        out["policies"][name] = {k: v for k, v in pol.items() if k != "paths"}
        out["policies"][name]["per_seed"] = [results["runs"][r]["score"] for r in pol["runs"]]
    for method in sorted(os.listdir(args.runs)):
        runs = sorted(glob.glob(os.path.join(args.runs, method, "*", "seed*")))
        if runs and os.path.exists(os.path.join(runs[0], "metrics.jsonl")):
            with open(os.path.join(runs[0], "metrics.jsonl")) as f:
                if "rewards/margins" in f.readline():
                    out.setdefault("dpo_training", {})[method] = [dpo_stats(r) for r in runs]
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    for method, stats in out.get("dpo_training", {}).items():
        print(method, "mean rewards/accuracies per seed:", [round(s["mean_rewards_accuracies"], 3) for s in stats],
              "mean margins:", [round(s["mean_rewards_margins"], 3) for s in stats])
    print(f"saved {args.output}")


if __name__ == "__main__":
    main()
