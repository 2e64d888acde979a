"""docs/studies.md, claim 6: how often a judge agrees with the gold judge on the same comparisons.

Reads two eval.py output folders made over the same policies and prompts (the second reuses the
first's generation cache, so both judged the very same responses) and compares their verdicts
(judgments.jsonl: a win, a loss or a tie for every prompt and pair of runs):

    python eval.py sft=runs/sft grpo=... --output_dir runs/eval_c6                         # gold
    python eval.py sft=runs/sft grpo=... --judge rm:runs/reward --output_dir runs/eval_c6_rm \\
        --cache_dir runs/eval_c6/cache
    python studies/judge_agreement.py runs/eval_c6 runs/eval_c6_rm

Agreement is counted over the comparisons the gold judge decides (not a tie): the share where the
judge names the same winner, the share where it calls a tie, and the share where it names the
other one. Written to stdout and, with --output, to a JSON.
"""

import argparse
import json
import os


def verdicts(folder):
    with open(os.path.join(folder, "judgments.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {(r["prompt_id"], r["policy_a"], r["policy_b"]): r["winner"] for r in rows}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gold", help="eval.py --output_dir judged by the gold judge")
    p.add_argument("judge", help="eval.py --output_dir over the same runs, judged by the other judge")
    p.add_argument("--output", default="", help="a JSON to write")
    args = p.parse_args()
    gold, other = verdicts(args.gold), verdicts(args.judge)
    shared = [k for k in gold if k in other and "reference" not in k[1:]]
    if not shared:
        raise SystemExit(f"{args.gold} and {args.judge} share no comparisons: evaluate the same policies in both.")
    decided = [k for k in shared if gold[k] != "tie"]
    same = sum(other[k] == gold[k] for k in decided)
    ties = sum(other[k] == "tie" for k in decided)
    out = {"comparisons": len(shared), "gold_decided": len(decided), "agree": same / len(decided),
           "judge_tie": ties / len(decided), "disagree": (len(decided) - same - ties) / len(decided),
           "gold_ties_judge_decided": sum(gold[k] == "tie" and other[k] != "tie" for k in shared) / len(shared)}
    print(f"{len(shared)} comparisons, {len(decided)} decided by gold: the judge agrees on {out['agree']:.3f}, "
          f"calls a tie on {out['judge_tie']:.3f}, names the other winner on {out['disagree']:.3f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
