"""studies/ifeval_report.py: the instruction-following world's table (make demo-real) from an
eval.py run on embedded:ifeval with --reward_fn ifeval_strict --group_by family.

One column per policy: held-out strict accuracy overall and per family (eval.py's numbers and 95%
bootstrap CIs over the test prompts; the families never trained on, world_ifeval.HELD_OUT, marked
"held out"), the win rate over the first policy with the verifier as the judge (eval.py's paired
bootstrap CI), and whether the answers stay answers: the share of empty answers, of truncated
ones (no stop token within --max_completion_length: eval.py's truncated_frac), of degenerate
ones (world_ifeval.degenerate: a word three times in a row, or 8+ words mostly repeated), of
answers addressed to the model (world_ifeval.addressed: opening like the system turn, "You are"),
and the mean length in words. A method with several runs (training seeds: 'grpo=runs/real*/grpo')
gets eval.py's CI over seeds + prompts on its overall accuracy (per family: over prompts), its answers' shares pooled over its runs, and a row of
each run's accuracy. Writes <eval_dir>/ifeval_table.md and prints it.

Run (make demo-real):
    python studies/ifeval_report.py runs/real/eval [--times runs/real/times.txt]
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from worlds import world_ifeval  # noqa: E402


def ci(row, key="score"):
    return f"{row[key]:.3f} ({row['ci_low']:.2f}, {row['ci_high']:.2f})" if key == "score" else ""


def over_seeds(results):
    """Whether some method has several runs (training seeds)."""
    return any(len(p["runs"]) > 1 for p in results["policies"].values())


def table(results, generations):
    """Rows: overall strict accuracy, each family's, the win rate over the first policy, the answers'
    shape; one column per policy."""
    names = list(results["policies"])
    first = names[0]
    families = sorted(results["policies"][first]["by_group"])
    rows = {"strict accuracy, all families": [], **{f: [] for f in families}, f"win rate vs {first} (verifier as judge)": [],
            "empty answers": [], "truncated answers": [], "degenerate answers": [],
            "addressed to the model ('You are ...')": [], "mean length (words)": []}
    several = over_seeds(results)
    if several:
        rows = {"per run (training seed)": [], **rows}
    for name in names:
        p = results["policies"][name]
        lo, hi = ("score_seed_ci_low", "score_seed_ci_high") if len(p["runs"]) > 1 else ("score_ci_low", "score_ci_high")
        rows["strict accuracy, all families"].append(f"**{p['score']:.3f}** ({p[lo]:.3f}, {p[hi]:.3f})")  # seeds + prompts
        for f in families:
            g = p["by_group"][f]
            rows[f].append(f"{g['score']:.2f} ({g['ci_low']:.2f}, {g['ci_high']:.2f})")
        rows[f"win rate vs {first} (verifier as judge)"].append(next(
            (f"{r['win_rate']:.2f} ({r['ci_low']:.2f}, {r['ci_high']:.2f})" for r in results["pairwise"]
             if r["policy_a"] == name and r["policy_b"] == first), "-"))
        if several:
            rows["per run (training seed)"].append(", ".join(f"{results['runs'][r]['score']:.3f}" for r in p["runs"]))
        texts = [g["responses"][r] for r in p["runs"] for g in generations]  # pooled over the method's runs
        rows["empty answers"].append(f"{sum(not t.strip() for t in texts) / len(texts):.3f}")
        rows["truncated answers"].append(f"{p['truncated_frac']:.3f}")
        rows["degenerate answers"].append(f"{sum(world_ifeval.degenerate(t) for t in texts) / len(texts):.3f}")
        rows["addressed to the model ('You are ...')"].append(
            f"{sum(world_ifeval.addressed(t, world_ifeval.SYSTEM) for t in texts) / len(texts):.3f}")
        rows["mean length (words)"].append(f"{sum(len(world_ifeval.words(t)) for t in texts) / len(texts):.1f}")
    counts = {f: results["policies"][first]["by_group"][f]["n"] for f in families}
    label = {f: f"{f} [{counts[f]}]" + (" (held out of training)" if f in world_ifeval.HELD_OUT else "") for f in families}
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {label.get(k, k)} | " + " | ".join(v) + " |" for k, v in rows.items()]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("eval_dir", help="An eval.py --output_dir on embedded:ifeval (results.json, generations.jsonl).")
    p.add_argument("--times", default="", help="A file of '<stage> <seconds> <load>' lines to print under the table.")
    args = p.parse_args()
    results = json.load(open(os.path.join(args.eval_dir, "results.json")))
    if results["settings"]["group_by"] != "family" or results["settings"]["reward_fn"] != "ifeval_strict":
        sys.exit(f"error: {args.eval_dir} is not an eval.py run with --reward_fn ifeval_strict --group_by family.")
    generations = [json.loads(line) for line in open(os.path.join(args.eval_dir, "generations.jsonl"))]
    text = (f"Held-out strict accuracy on embedded:ifeval's {results['settings']['num_prompts']} test prompts "
            f"(greedy, {results['settings']['max_completion_length']} new tokens at most; 95% CIs from "
            f"{results['settings']['num_bootstrap']} bootstrap resamples of "
            f"{'the training seeds, then the prompts (overall; per family the prompts alone)' if over_seeds(results) else 'the prompts'}; per family: the prompts "
            "whose primary constraint is that family, [count]).\n\n" + table(results, generations) + "\n")
    if args.times and os.path.exists(args.times):
        text += "\nStage times (seconds, load average when it ended):\n\n" + open(args.times).read()
    with open(os.path.join(args.eval_dir, "ifeval_table.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
