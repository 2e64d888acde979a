"""Can the embedded world's reward model learn to see copy errors? (issue #29, CHANGELOG.md)

Until commit f83d277 the world's preference pairs held no copy error, and the demo's reward model
scored a reference and the same summary with one fact copied wrongly alike (reward.py's
`probe_accuracy`: 0.45-0.55), so PPO and GRPO through it added facts and copy errors with them.
Since f83d277 the world holds contrast pairs (`world.contrast_pair`) and reward.py trains 1200
steps on it; this study is how that was found (CHANGELOG.md, 2026-12-05). It writes preference
pairs in which a fifth, "confused" writer copies
one fact's object or action from another fact of the post (the slip the policies make), labelled
like the world's pairs (Bradley-Terry on the gold difference at `world.PREF_TEMPERATURE`), on
posts outside the test split, and measures a reward model's accuracy on the minimal pairs.

    python studies/reward_blindspot.py pairs --seed 0 --share 0.25 --num_pairs 4000 --out runs/x29/prefs_conf25.jsonl
    python reward.py --model runs/sft --dataset runs/x29/prefs_conf25.jsonl --learning_rate 3e-4 \
        --lr_scheduler_type cosine --warmup_steps 10 --batch_size 32 --output_dir runs/x29/rm_conf
    python studies/reward_blindspot.py probe runs/x29/rm_conf --seed 0

`--writer minimal` writes minimal pairs instead, the kind world.probe_pairs measures: a `share` of
the pairs the reference TL;DR against it with one fact copied wrongly, half as many the reference
against it with one fact left out, the rest the world's annotator pairs (CHANGELOG.md: a reward
model from them sees copy errors 0.84-0.86 of the time after 400 steps, 0.90-0.96 after 1200):

    python studies/reward_blindspot.py pairs --writer minimal --seed 0 --share 0.5 --num_pairs 8000 --out runs/x29/minimal.jsonl

`kinds` gives a reward model's test accuracy on the world's pairs by kind (copy error, omission,
two annotators), each against its own label-noise ceiling (docs/results.md),
and the copy errors again by `repeat_case` (below):

    python studies/reward_blindspot.py kinds runs/reward --seed 0

`kinds --logprob` scores the same pairs by a policy's own log-probability of each response instead:
the SFT policy's trunk, from which reward.py starts, already ranks nearly every copy-error pair
right that way (a copied word is one it did not predict), so what a reward model misses there it
failed to read out at its last token, not to know:

    python studies/reward_blindspot.py kinds runs/sft --logprob --seed 0

`repeats` splits its accuracy on the copy-error probes by what a counter of repeated words would
see (`repeat_case`): a fact copied from another fact of the post repeats a word, so a reward model
that penalises repeated actions and objects, rather than checking each clause against the post,
is right where the reference repeats none, wrong more often where the post's facts share an action
or an object, and wrong where the copied word is not in the post at all (a probe's wrong action
where every fact has the same action; the world's slips copy the other field there since the
eighth session, CHANGELOG.md):

    python studies/reward_blindspot.py repeats runs/reward --seed 0
"""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from worlds import world  # noqa: E402


def posts(rng, seed):
    """World posts (post, facts) drawn from `rng`, none of them a test post of the world's `seed`."""
    test_posts = set(world.build_world(seed)["test"]["post"])
    while True:
        post, facts = world.make_post(rng)
        if post not in test_posts:
            yield post, facts


def pairs(seed, share, num_pairs):
    """Preference rows (world.label_pair's) with a `share` of confused writers."""
    rng = random.Random(1000 + seed)
    kinds = {k: v * (1 - share) for k, v in world.ANNOTATORS.items()}
    kinds["confused"] = share
    rows, draw = [], posts(rng, seed)
    while len(rows) < num_pairs:
        post, facts = next(draw)
        written = []
        for _ in range(2):  # each writer drawn, then writes, in turn
            k = rng.choices(list(kinds), weights=list(kinds.values()))[0]
            written.append(world.slip(rng, facts) if k == "confused" else world.annotate(rng, post, facts, k))
        if written[0] != written[1]:
            rows.append(world.label_pair(rng, post, *written))
    return rows


def minimal_pairs(seed, share, num_pairs):
    """Preference rows: a `share` reference vs. one copy error, share / 2 reference vs. one fact
    left out (the chosen is the reference), the rest world.label_pair's annotator pairs."""
    rng = random.Random(5000 + seed)
    rows, draw = [], posts(rng, seed)
    while len(rows) < num_pairs:
        post, facts = next(draw)
        u, ref = rng.random(), world.reference_summary(facts)
        if u < share:
            bad = world.slip(rng, facts)
        elif u < 1.5 * share:
            bad = world.omit(rng, facts)
        else:
            a, b = (world.annotate(rng, post, facts, world.sample_annotator(rng)) for _ in range(2))
            if a != b:
                rows.append(world.label_pair(rng, post, a, b))
            continue
        if bad != ref:
            rows.append({"prompt": world.PROMPT_TEMPLATE.format(post=post), "chosen": " " + ref, "rejected": " " + bad,
                         "post": post, "chosen_gold": world.gold_score(post, ref), "rejected_gold": world.gold_score(post, bad)})
    return rows


def probe(folder, seed):
    """A reward model's accuracy on the world's minimal pairs (world.probe_pairs, test posts)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf import sampling
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = {}
    for kind, (prompts, good, bad) in world.probe_pairs(world.build_world(seed)["test"], seed).items():
        with torch.no_grad():
            g = sampling.reward_model_scores(model, tokenizer, prompts, good)
            b = sampling.reward_model_scores(model, tokenizer, prompts, bad)
        out[kind] = round(float((g > b).float().mean()), 3)
    return out


def pair_kind(row):
    """Which kind of preference pair a world row is: "copy" (a careful summary against the same
    with one fact copied wrongly), "omission" (... with one fact left out; a careful and a lazy
    annotator give these too) or "annotators" (any other two summaries)."""
    careful = " " + world.reference_summary(world.key_facts(row["post"]))
    other = {row["chosen"], row["rejected"]} - {careful}
    if len(other) != 1 or careful not in (row["chosen"], row["rejected"]):
        return "annotators"
    other = other.pop()
    counts, extra = world.gold_counts(row["post"], other), len(careful.split()) - len(other.split())
    if extra == 0 and counts["unsupported"] == 1 and counts["missed"] == 1:
        return "copy"
    return "omission" if extra == 4 and counts["unsupported"] == 0 and counts["missed"] == 1 else "annotators"


def logprob_scores(model, tokenizer, prompts, completions, batch_size=64):
    """A causal LM's log-probability of each completion (EOS included) after its prompt: (N,)."""
    import torch

    from rlhf import data
    from rlhf import sampling
    stops, out = sampling.stop_token_ids(model, tokenizer), []
    for i in range(0, len(prompts), batch_size):
        p_ids, p_mask = data.encode_prompts(tokenizer, prompts[i:i + batch_size])
        c_ids, c_mask = data.encode_completions(tokenizer, completions[i:i + batch_size], None, stops)
        with torch.no_grad():
            out.append(sampling.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask).sum(1))
    return torch.cat(out)


def kinds(folder, seed, test_size=0.1, logprob=False):
    """A reward model's test accuracy by kind of pair, against each kind's label-noise ceiling, on
    the test split reward.py holds out of the embedded world's prefs (same seed, same --test_size).
    With `logprob`, `folder` is a policy and its own log-probability of each response is the score:
    how much of what a reward model must see its trunk already holds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from rlhf import sampling
    ds = world.build_world(seed)["prefs"]
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed)).tolist()  # reward.py's split
    test = ds.select(perm[:max(1, int(len(ds) * test_size))])
    model = (AutoModelForCausalLM if logprob else AutoModelForSequenceClassification).from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    score = logprob_scores if logprob else sampling.reward_model_scores
    with torch.no_grad():
        chosen = score(model, tokenizer, test["prompt"], test["chosen"])
        rejected = score(model, tokenizer, test["prompt"], test["rejected"])
    out, cases = {}, {}  # cases: the copy-error pairs again, by `repeat_case`
    for row, c, r in zip(test, chosen.tolist(), rejected.tolist()):
        kind, gold = pair_kind(row), row["chosen_gold"] - row["rejected_gold"]
        counts = [(out, kind)]
        if kind == "copy":
            good, bad = (row["chosen"], row["rejected"]) if gold > 0 else (row["rejected"], row["chosen"])
            counts.append((cases, repeat_case(row["post"], good.strip(), bad.strip())))
        for table, key in counts:
            n, right, ceiling = table.get(key, (0, 0.0, 0.0))
            table[key] = (n + 1, right + (c > r), ceiling + (0.5 if gold == 0 else float(gold > 0)))

    def rates(table):
        return {k: {"pairs": n, "accuracy": round(right / n, 3), "label_ceiling": round(ceiling / n, 3)}
                for k, (n, right, ceiling) in sorted(table.items())}
    out = rates(out)
    if cases:
        out["copy"]["by_case"] = rates(cases)
    return out


def repeat_case(post, good, bad):
    """Which case of `repeats` a copy-error probe (reference `good`, `bad` with one word changed) is:
    "wrong_word_not_in_post", "reference_repeats_a_word" (two of its facts share an action or an
    object) or "reference_repeats_none"."""
    g, b = good.split(), bad.split()
    wrong = next(y for x, y in zip(g, b) if x != y)
    if wrong not in post.split():
        return "wrong_word_not_in_post"
    actions, objects = g[1::4], g[2::4]  # clauses are "person action object ."
    repeats = len(set(actions)) < len(actions) or len(set(objects)) < len(objects)
    return "reference_repeats_a_word" if repeats else "reference_repeats_none"


def repeats(folder, seed):
    """A reward model's accuracy on the wrong-object and wrong-action probes by `repeat_case`."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf import sampling
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    test = world.build_world(seed)["test"]
    out = {}
    for kind, (prompts, good, bad) in world.probe_pairs(test, seed).items():
        if kind not in ("wrong_object", "wrong_action"):
            continue
        with torch.no_grad():
            right = (sampling.reward_model_scores(model, tokenizer, prompts, good)
                     > sampling.reward_model_scores(model, tokenizer, prompts, bad)).tolist()
        cases = {}
        for post, g, b, r in zip(test["post"], good, bad, right):
            case = repeat_case(post, g, b)
            n, k = cases.get(case, (0, 0))
            cases[case] = (n + 1, k + r)
        out[kind] = {c: {"probes": n, "accuracy": round(k / n, 3)} for c, (n, k) in sorted(cases.items())}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pairs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--share", type=float, default=0.25)
    p.add_argument("--writer", choices=["confused", "minimal"], default="confused",
                   help="confused: a share of confused writers; minimal: a share of minimal copy-error pairs (module docstring)")
    p.add_argument("--num_pairs", type=int, default=4000)
    p.add_argument("--out", required=True)
    q = sub.add_parser("probe")
    q.add_argument("model")
    q.add_argument("--seed", type=int, default=0)
    k = sub.add_parser("kinds", help="test accuracy by kind of pair (copy, omission, annotators) against each kind's ceiling")
    k.add_argument("model")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--logprob", action="store_true",
                   help="MODEL is a policy (runs/sft): score each response by the policy's own log-probability")
    r = sub.add_parser("repeats", help="copy-error probe accuracy split by whether the reference repeats a word")
    r.add_argument("model")
    r.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.cmd == "pairs":
        rows = (pairs if args.writer == "confused" else minimal_pairs)(args.seed, args.share, args.num_pairs)
        agree = [1.0 if r["chosen_gold"] > r["rejected_gold"] else 0.5 if r["chosen_gold"] == r["rejected_gold"] else 0.0
                 for r in rows]
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"{len(rows)} pairs to {args.out}; label-noise ceiling {sum(agree) / len(agree):.3f}")
    elif args.cmd == "repeats":
        print(json.dumps({"model": args.model, "probe_accuracy_by_case": repeats(args.model, args.seed)}))
    elif args.cmd == "kinds":
        print(json.dumps({"model": args.model, "score": "log-probability" if args.logprob else "reward model",
                          "test_accuracy_by_kind": kinds(args.model, args.seed, logprob=args.logprob)}))
    else:
        print(json.dumps({"model": args.model, "probe_accuracy": probe(args.model, args.seed)}))


if __name__ == "__main__":
    main()
