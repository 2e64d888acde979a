"""docs/results.md's per-seed table of `make demo`: for each pipeline seed's folder, the SFT policy's
gold score, the reward model's test accuracy against its pairs' label ceiling and its accuracy on
minimal pairs (reward.py's `probe_accuracy`: a reference against it with one fact left out, or
with one fact's object or action copied wrongly), the best win rate
any policy can reach against that SFT (the references', which score 1.0 on every post: a win
wherever SFT's summary is imperfect, a tie where it is already perfect: 1 minus eval.py's win rate
of SFT against the references), and every method's win rate against that seed's SFT (95% CI over
the 200 test posts), from eval.py's results.json and reward.py's summary.json.

    make demo SEED=0 && make demo SEED=1 && make demo SEED=2
    python studies/demo_seeds.py runs runs/seed1 runs/seed2
"""

import json
import os
import sys

METHODS = ["ppo", "ppo_gold", "dpo", "dpo_online", "grpo", "grpo_rm"]
PROBES = ["omission", "wrong_object", "wrong_action"]  # reward.py's minimal pairs: what the reward model sees


def row(folder):
    results = json.load(open(os.path.join(folder, "eval", "results.json")))
    reward = json.load(open(os.path.join(folder, "reward", "summary.json")))
    seed = json.load(open(os.path.join(folder, "sft", "args.json"))).get("seed")
    wins = {p["policy_a"]: p for p in results["pairwise"] if p["policy_b"] == "sft"}
    best = 1 - next(p["win_rate"] for p in results["pairwise"] if (p["policy_a"], p["policy_b"]) == ("sft", "reference"))
    cells = [f"{seed}", f"{results['policies']['sft']['score']:.3f}",
             f"{reward['test_accuracy']:.3f} ({reward['test_label_ceiling']:.3f})",
             " / ".join(f"{reward['probe_accuracy'][k]:.2f}" for k in PROBES), f"{best:.2f}"]
    for m in METHODS:
        p = wins[m]
        text = f"{p['win_rate']:.3f} ({p['ci_low']:.2f}, {p['ci_high']:.2f}), {results['policies'][m]['score']:.3f}"
        cells.append(f"**{text}**" if p["win_rate"] >= 0.70 and p["ci_low"] > 0.5 else text)
    return "| " + " | ".join(cells) + " |"


def main():
    print("| seed | SFT gold | reward model accuracy (label ceiling) | reward model sees: omission / wrong object / wrong action | best possible | "
          + " | ".join(METHODS) + " |")
    print("|" + "---|" * (5 + len(METHODS)))
    for folder in sys.argv[1:]:
        print(row(folder))


if __name__ == "__main__":
    main()
