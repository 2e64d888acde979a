"""docs/studies.md, claim 4 ("8-bit optimizer states shrink memory without degrading convergence
precision"): compare the training curves and final quality of a sweep's settings.

For one sweep (one script; settings such as optimadamw_8bit-dtypefloat32 and optimadamw-dtypefloat32,
each with the same seeds), for each setting against a baseline setting of the same dtype (fp32-state
AdamW, `--baseline_optim adamw`): per seed, the largest gap between the two runs' curves of
`--metric` (a moving mean over `--window` steps, so that step-to-step noise is not counted as
drift; the same seed means the same data order and, until the weights differ, the same samples)
and the final value of the metric (the mean of the last `--window` steps); per setting, the final
quality from eval.py's results.json (`--eval`) or, for sft.py, from each run's summary.json
(`gold_score`). Writes a JSON and one plot of the mean curve of every setting.

    python studies/optim_precision.py --runs runs/optim_sft --metric loss --output studies/optim_sft
    python studies/optim_precision.py --runs runs/optim_grpo --metric reward --eval runs/eval_optim_grpo \\
        --output studies/optim_grpo
"""

import argparse
import glob
import json
import os


def curve(run, metric):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r[metric] for r in rows if metric in r]


def moving_mean(xs, window):
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x - (xs[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def dtype_of(setting):
    return next((part[len("dtype"):] for part in setting.split("-") if part.startswith("dtype")), "")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", required=True, help="the sweep's --output_dir (SETTING/seedS folders)")
    p.add_argument("--metric", required=True, help="the metrics.jsonl key to compare (loss, reward)")
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--eval", default="", help="eval.py's --output_dir over the runs (method names free: matched by path)")
    p.add_argument("--baseline_optim", default="adamw", help="the setting each is compared with: optim<this>, same dtype")
    p.add_argument("--output", required=True, help="path prefix: writes PREFIX.json and PREFIX.png")
    args = p.parse_args()

    runs = {s: sorted(glob.glob(os.path.join(args.runs, s, "seed*"))) for s in sorted(os.listdir(args.runs))}
    runs = {s: r for s, r in runs.items() if r}
    quality, by_path = {}, {}
    if args.eval:
        with open(os.path.join(args.eval, "results.json")) as f:
            results = json.load(f)
        by_path = {os.path.normpath(r["path"]): r["score"] for r in results["runs"].values()}
        for name, pol in results["policies"].items():
            for s, rs in runs.items():
                if {os.path.normpath(x) for x in pol["paths"]} == {os.path.normpath(x) for x in rs}:
                    quality[s] = {"score": pol["score"], "ci_prompts": [pol["score_ci_low"], pol["score_ci_high"]],
                                  "ci_seeds_prompts": [pol["score_seed_ci_low"], pol["score_seed_ci_high"]]}
        quality["sft (start)"] = {"score": results["policies"].get("sft", {}).get("score")}
    out = {"runs": args.runs, "metric": args.metric, "window": args.window, "settings": {}}
    curves = {}
    for s, rs in runs.items():
        per_seed = []
        for r in rs:
            c = curve(r, args.metric)
            curves.setdefault(s, []).append(c)
            score = by_path.get(os.path.normpath(r))
            if score is None and os.path.exists(os.path.join(r, "summary.json")):
                with open(os.path.join(r, "summary.json")) as f:
                    score = json.load(f).get("gold_score")
            per_seed.append({"seed": int(os.path.basename(r)[4:]), "final_metric": sum(c[-args.window:]) / len(c[-args.window:]),
                             "score": score})
        base = f"optim{args.baseline_optim}-dtype{dtype_of(s)}"
        if base != s and base in runs:
            base_curves = {int(os.path.basename(r)[4:]): curve(r, args.metric) for r in runs[base]}
            for row, c in zip(per_seed, curves[s]):
                b = base_curves.get(row["seed"])
                if b:
                    a_m, b_m = moving_mean(c, args.window), moving_mean(b, args.window)
                    gaps = [abs(x - y) for x, y in zip(a_m, b_m)]
                    row["max_gap_vs_" + base] = max(gaps)
                    row["step_of_max_gap"] = gaps.index(max(gaps)) + 1
                    row["first_step_differing"] = next((i + 1 for i, (x, y) in enumerate(zip(c, b)) if x != y), None)
        scores = [r["score"] for r in per_seed if r["score"] is not None]
        out["settings"][s] = {"per_seed": per_seed, "mean_score": sum(scores) / len(scores) if scores else None,
                              **({"eval": quality[s]} if s in quality else {})}
    if "sft (start)" in quality:
        out["sft_score"] = quality["sft (start)"]["score"]
    with open(args.output + ".json", "w") as f:
        json.dump(out, f, indent=1)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for s, cs in curves.items():
        n = min(len(c) for c in cs)
        mean = [sum(c[i] for c in cs) / len(cs) for i in range(n)]
        ax.plot(range(1, n + 1), moving_mean(mean, args.window), label=s, linestyle="-" if "8bit" in s else "--")
    ax.set_xlabel("step")
    ax.set_ylabel(f"{args.metric} ({args.window}-step moving mean, mean over seeds)")
    ax.set_title(os.path.basename(args.runs))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output + ".png", dpi=120)

    print("| setting | score per seed | mean score | final metric per seed | largest gap of the curves vs fp32 AdamW, per seed |")
    print("|---|---|---|---|---|")
    for s, v in out["settings"].items():
        gaps = [next((f"{r[k]:.3f} (step {r['step_of_max_gap']})" for k in r if k.startswith("max_gap")), "-") for r in v["per_seed"]]
        scores = ", ".join("-" if r["score"] is None else f"{r['score']:.3f}" for r in v["per_seed"])
        mean = "-" if v["mean_score"] is None else f"{v['mean_score']:.3f}"
        finals = ", ".join(f"{r['final_metric']:.3f}" for r in v["per_seed"])
        print(f"| {s} | {scores} | {mean} | {finals} | {', '.join(gaps)} |")
    print(f"saved {args.output}.json and {args.output}.png")


if __name__ == "__main__":
    main()
