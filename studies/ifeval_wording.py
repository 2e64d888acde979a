"""studies/ifeval_wording.py: does what training on the instruction-following world's wording taught
carry over to IFEval's wording of the same instructions?

The world's test split holds its TEST_SIZE tasks in the project's wording, then every task whose
families IFEval also has again in IFEval's wording, judged by IFEval's own rule (world_ifeval.py,
"IFEval's wording"). This reads an eval.py run over the whole test split (--num_prompts 0) and
compares, on those twin tasks only, each policy's strict accuracy in the two wordings, and its
gain over the first policy (the base) in each, with 95% bootstrap CIs over the tasks (the same
resampled tasks for both wordings, so the two gains are paired). Writes <eval_dir>/wording.md.

Run (make real-ifeval-wording, after make demo-real):
    python studies/ifeval_wording.py runs/real/eval_wording
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from worlds import world_ifeval  # noqa: E402


def twin_pairs(test, test_size=world_ifeval.TEST_SIZE):
    """(original prompt id, twin prompt id) for every task of the test split `test` that has an
    IFEval-worded twin: the twins follow the originals, in the originals' order (world_ifeval.build_world)."""
    pairs, twin_id = [], test_size
    for i in range(test_size):
        if world_ifeval.ifeval_twin(test[i]) is not None:
            pairs.append((i, twin_id))
            twin_id += 1
    assert twin_id == len(test), "the test split's twins are not in the originals' order"
    return pairs


def scores_by_policy(eval_dir):
    """{policy: {prompt_id: strict score}} from eval.py's judgments.jsonl."""
    out = {}
    with open(os.path.join(eval_dir, "judgments.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            out.setdefault(j["policy_a"], {})[j["prompt_id"]] = j["score_a"]
            out.setdefault(j["policy_b"], {})[j["prompt_id"]] = j["score_b"]
    return out


def interval(values, idx):
    """The mean and its 95% bootstrap interval over the resampled tasks idx (num_bootstrap, n)."""
    means = values[idx].mean(axis=1)
    return values.mean(), np.percentile(means, 2.5), np.percentile(means, 97.5)


def table(policies, scores, pairs, num_bootstrap=2000, seed=0):
    """Markdown rows: per policy, accuracy in each wording and the gain over the first policy."""
    orig, twin = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    idx = np.random.default_rng(seed).integers(0, len(pairs), (num_bootstrap, len(pairs)))
    acc = {p: (np.array([scores[p][i] for i in orig]), np.array([scores[p][i] for i in twin])) for p in policies}
    fmt = lambda m, lo, hi: f"{m:.3f} ({lo:.3f}, {hi:.3f})"  # noqa: E731
    base = policies[0]
    lines = [f"| policy | project's wording ({len(pairs)} tasks) | IFEval's wording (the same tasks) | gain over {base}, project's wording | gain over {base}, IFEval's wording |",
             "|---|---|---|---|---|"]
    for p in policies:
        cells = [fmt(*interval(acc[p][0], idx)), fmt(*interval(acc[p][1], idx))]
        cells += ["-", "-"] if p == base else [fmt(*interval(acc[p][k] - acc[base][k], idx)) for k in (0, 1)]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("eval_dir", help="An eval.py output folder of a run over embedded:ifeval's whole test split.")
    args = ap.parse_args()
    results = json.load(open(os.path.join(args.eval_dir, "results.json")))
    policies = list(results["policies"])
    scores = scores_by_policy(args.eval_dir)
    pairs = twin_pairs(world_ifeval.build_world(0)["test"])
    missing = [p for p in policies if any(t not in scores[p] for _, t in pairs)]
    if missing:
        raise SystemExit(f"error: {args.eval_dir} has no judgment of {missing[0]} on the IFEval-worded prompts: run eval.py "
                         "with --num_prompts 0 (the whole test split).")
    text = table(policies, scores, pairs)
    with open(os.path.join(args.eval_dir, "wording.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
