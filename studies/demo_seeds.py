"""The README's per-seed table of `make demo`: for each pipeline seed's folder, the SFT policy's
gold score, the reward model's test accuracy against its pairs' label ceiling, the best win rate
any policy can reach against that SFT (the references', which score 1.0 on every post: a win
wherever SFT's summary is imperfect, a tie where it is already perfect), and every method's win
rate against that seed's SFT (95% CI over the 200 test posts), from eval.py's results.json and
judgments.jsonl and reward.py's summary.json.

    make demo SEED=0 && make demo SEED=1 && make demo SEED=2
    python studies/demo_seeds.py runs runs/seed1 runs/seed2
"""

import json
import os
import sys

METHODS = ["ppo", "dpo", "dpo_online", "grpo", "grpo_rm"]


def best_win_rate(folder):
    """The references' win rate against SFT: 1 where SFT's gold score is below 1.0, 1/2 where it is 1.0."""
    sft = {}
    with open(os.path.join(folder, "eval", "judgments.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            for side in "ab":
                if j[f"policy_{side}"] == "sft":
                    sft[j["prompt_id"]] = j[f"score_{side}"]
    return sum(0.5 if s >= 1.0 - 1e-9 else 1.0 for s in sft.values()) / len(sft)


def row(folder):
    results = json.load(open(os.path.join(folder, "eval", "results.json")))
    reward = json.load(open(os.path.join(folder, "reward", "summary.json")))
    seed = json.load(open(os.path.join(folder, "sft", "args.json"))).get("seed")
    wins = {p["policy_a"]: p for p in results["pairwise"] if p["policy_b"] == "sft"}
    cells = [f"{seed}", f"{results['policies']['sft']['score']:.3f}",
             f"{reward['test_accuracy']:.3f} ({reward['test_label_ceiling']:.3f})", f"{best_win_rate(folder):.2f}"]
    for m in METHODS:
        p = wins[m]
        text = f"{p['win_rate']:.3f} ({p['ci_low']:.2f}, {p['ci_high']:.2f}), {results['policies'][m]['score']:.3f}"
        cells.append(f"**{text}**" if p["win_rate"] >= 0.70 and p["ci_low"] > 0.5 else text)
    return "| " + " | ".join(cells) + " |"


def main():
    print("| seed | SFT gold | reward model accuracy (label ceiling) | best possible | " + " | ".join(METHODS) + " |")
    print("|" + "---|" * (4 + len(METHODS)))
    for folder in sys.argv[1:]:
        print(row(folder))


if __name__ == "__main__":
    main()
