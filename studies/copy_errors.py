"""Which clauses a policy copies wrongly (issue #29, CHANGELOG.md): for each policy in eval.py's
generations.jsonl, the share of its greedy summaries' clauses that state a fact of the post, by the
clause's place in the summary, and where each wrong clause took its words from: the action or the
object of the fact `k` places before (-k) or after (+k) the one its person states in the post.

    python studies/copy_errors.py runs/eval/generations.jsonl
"""

import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from worlds import world  # noqa: E402


def copy_errors(rows, policy):
    """({place: (right, written)}, Counter of where the wrong clauses' words came from)."""
    by_place, sources = collections.defaultdict(lambda: [0, 0]), collections.Counter()
    for r in rows:
        facts = world.key_facts(world.post_from_prompt(r["prompt"]))
        for place, clause in enumerate(world._clauses(r["responses"][policy])):
            f = world._fact(clause)
            by_place[place][1] += 1
            if f in facts:
                by_place[place][0] += 1
                continue
            own = [i for i, x in enumerate(facts) if f is not None and x[0] == f[0]]
            if not own:
                sources["no fact of this person" if f else "no fact"] += 1
                continue
            i = own[0]
            tags = []
            for field, name in ((1, "action"), (2, "object")):
                if f[field] != facts[i][field]:
                    moves = [f"{j - i:+d}" for j, x in enumerate(facts) if x[field] == f[field]]
                    tags.append(f"{name} from {','.join(moves) if moves else 'outside the post'}")
            sources["; ".join(tags)] += 1
    return {p: tuple(v) for p, v in sorted(by_place.items())}, sources


def main():
    rows = [json.loads(line) for line in open(sys.argv[1])]
    for policy in rows[0]["responses"]:
        by_place, sources = copy_errors(rows, policy)
        places = ", ".join(f"clause {p + 1}: {r}/{n} = {r / n:.2f}" for p, (r, n) in by_place.items())
        print(f"{policy}: {sum(n for _, n in by_place.values()) / len(rows):.2f} clauses per summary; {places}")
        for source, count in sources.most_common():
            print(f"    {count:3d}  {source}")


if __name__ == "__main__":
    main()
