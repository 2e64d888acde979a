"""The embedded world: the gold judge's formula, the generator's guarantees, the tokenizer."""

import pytest

from worlds import world
from worlds.world import gold_score

POST = "yesterday alice bought the bike at the park . the weather was nice . bob lost a phone near the station today ."


def test_reference_scores_one():
    assert gold_score(POST, "alice bought bike . bob lost phone .") == 1.0


def test_gold_formula_by_hand():
    # omission: 1 of 2 facts covered, 4 words fewer than the reference (no excess)
    assert gold_score(POST, "alice bought bike .") == pytest.approx(0.5)
    # hallucination: both facts + one not in the post; 12 words vs 8 -> 4 excess words
    assert gold_score(POST, "alice bought bike . carol sold lamp . bob lost phone .") == pytest.approx(
        (2 - 0.5 * 1) / 2 - 0.02 * 4)
    # a restated fact counts as repeated, not covered twice
    assert gold_score(POST, "alice bought bike . alice bought bike .") == pytest.approx((1 - 0.5) / 2)
    # verbosity: 3 extra words
    assert gold_score(POST, "alice bought the bike . bob lost the phone today .") == pytest.approx(1 - 0.02 * 3)
    # a clause with no (person, action, object) is unsupported
    assert gold_score(POST, "alice bought bike . bob lost phone . the weather was nice .") == pytest.approx(
        (2 - 0.5) / 2 - 0.02 * 5)
    # order inside a clause matters: object before person is no fact
    assert gold_score(POST, "bike bought alice .") == pytest.approx(-0.25)
    assert gold_score(POST, "") == 0.0
    # clipped at -1
    assert gold_score(POST, " ".join(["carol sold lamp ."] * 10)) == -1.0


def test_mentions_are_not_facts():
    assert world.key_facts("alice was happy . i called bob later . carol fixed the car .") == [("carol", "fixed", "car")]


def test_gold_reward_signature_and_post_recovery():
    prompt = world.PROMPT_TEMPLATE.format(post=POST)
    assert world.gold_reward([prompt], [" alice bought bike . bob lost phone ."]) == [1.0]
    assert world.gold_reward([prompt], [" alice bought bike ."], post=[POST]) == [0.5]
    convo = [{"role": "user", "content": prompt}]
    assert world.gold_reward([convo], [[{"role": "assistant", "content": "alice bought bike . bob lost phone ."}]]) == [1.0]


@pytest.fixture(scope="module")
def small_world():
    return world.build_world(seed=3, sizes={"sft": 400, "prefs": 300, "contrast": 900, "rl": 100, "test": 50})


def test_world_is_deterministic(small_world):
    again = world.build_world(seed=3, sizes={"sft": 400, "prefs": 300, "contrast": 900, "rl": 100, "test": 50})
    for name in small_world:
        assert small_world[name].to_list() == again[name].to_list()
    other = world.build_world(seed=4, sizes={"sft": 400, "prefs": 300, "contrast": 900, "rl": 100, "test": 50})
    assert other["test"]["post"] != small_world["test"]["post"]


def test_test_split_is_disjoint(small_world):
    test_posts = set(small_world["test"]["post"])
    for name in ("sft", "prefs", "rl"):
        assert not test_posts & set(small_world[name]["post"])
    # and it does not depend on how large the training splits are
    bigger = world.build_world(seed=3, sizes={"sft": 900, "prefs": 10, "contrast": 0, "rl": 10, "test": 50})
    assert bigger["test"]["post"] == small_world["test"]["post"]


def test_formats(small_world):
    assert {"prompt", "completion"} <= set(small_world["sft"].column_names)
    assert {"prompt", "chosen", "rejected"} <= set(small_world["prefs"].column_names)
    assert {"prompt", "post"} <= set(small_world["rl"].column_names)
    assert {"prompt", "reference"} <= set(small_world["test"].column_names)
    row = small_world["sft"][0]
    assert row["prompt"].startswith("POST: ") and row["prompt"].endswith("TL;DR:")
    assert row["completion"].startswith(" ")


def test_headroom_and_noisy_labels(small_world):
    stats = world.world_stats(small_world)
    assert stats["reference_gold"] == 1.0
    assert 0.6 < stats["demo_gold"] < 0.9  # demonstrations are clearly worse than references
    assert 0.9 < stats["label_ceiling"] < 0.97  # labels are noisy: the gold judge disagrees sometimes
    annotators = world.build_world(seed=3, sizes={"sft": 400, "prefs": 300, "contrast": 0, "rl": 100, "test": 50})
    assert 0.7 < world.world_stats(annotators)["label_ceiling"] < 0.9  # most of the noise is in the annotators' pairs
    kinds = set(small_world["sft"]["annotator"])
    assert kinds == set(world.ANNOTATORS)
    # the Bradley-Terry labels prefer the higher gold score more often than not
    prefs = small_world["prefs"]
    better = sum(c > r for c, r in zip(prefs["chosen_gold"], prefs["rejected_gold"]))
    assert better > 0.6 * len(prefs)


def test_contrast_pairs_are_a_careful_summary_against_one_copy_error_or_omission(small_world):
    import random

    rng = random.Random(0)
    for post in small_world["test"]["post"]:  # a slip: every fact's clause, one of them copied wrongly
        facts = world.key_facts(post)
        wrong = world.slip(rng, facts)
        counts = world.gold_counts(post, wrong)
        assert counts["unsupported"] == 1 and counts["missed"] == 1 and len(wrong.split()) == len(world.reference_summary(facts).split())
        bad = [f for f in (world._fact(c.split()) for c in wrong.split(" .") if c.strip()) if f not in facts]
        assert len(bad) == 1
        p, a, o = bad[0]
        right = {f[0]: f for f in facts}[p]  # the fact's person, and one of its action and object wrong
        assert (a == right[1]) != (o == right[2])
        if len({f[1:] for f in facts}) > 1:  # copied from another fact of the post (where one differs)
            assert (a if a != right[1] else o) in post.split()
    # where every fact has the same action, the slip copies an object (an invented action is no copy error)
    facts = [("alice", "bought", "bike"), ("bob", "bought", "phone")]
    assert {world.slip(rng, facts) for _ in range(40)} == {"alice bought phone . bob bought phone .",
                                                           "alice bought bike . bob bought bike ."}
    # three quarters of the pairs (900 of 1200), labelled like the annotators' pairs: the careful summary
    # wins but for noise; two in three hold a copy error, one in three leave a fact out
    prefs = small_world["prefs"]
    kinds = {"copy": [], "omission": []}
    for r in prefs:
        careful = " " + world.reference_summary(world.key_facts(r["post"]))
        other = r["rejected"] if r["chosen"] == careful else r["chosen"] if r["rejected"] == careful else None
        if other is None:
            continue
        counts = world.gold_counts(r["post"], other)
        if counts["unsupported"] == 1 and counts["missed"] == 1 and len(other.split()) == len(careful.split()):
            kinds["copy"].append(r)
        elif counts["unsupported"] == 0 and counts["missed"] == 1 and len(other.split()) == len(careful.split()) - 4:
            kinds["omission"].append(r)  # a careful against a lazy annotator gives these too (a few)
    assert len(prefs) == 1200 and 560 <= len(kinds["copy"]) <= 640 and 270 <= len(kinds["omission"]) <= 370, {k: len(v) for k, v in kinds.items()}
    pairs = kinds["copy"] + kinds["omission"]
    assert sum(r["chosen_gold"] > r["rejected_gold"] for r in pairs) >= 0.95 * len(pairs)  # sigmoid(1 / 3 / 0.1) = 0.97 per pair at worst
    # drawn after every other split: the annotator pairs, sft, rl and test do not depend on how many there are
    none = world.build_world(seed=3, sizes={"sft": 400, "prefs": 300, "contrast": 0, "rl": 100, "test": 50})
    for name in ("sft", "rl", "test"):
        assert none[name].to_list() == small_world[name].to_list()
    assert {str(r) for r in none["prefs"]} <= {str(r) for r in prefs}


def test_write_jsonl(small_world, tmp_path):
    world.write_jsonl(small_world, tmp_path)
    lines = (tmp_path / "sft.jsonl").read_text().splitlines()
    assert len(lines) == 400


def test_tokenizer_round_trip_and_specials(small_world):
    tok = world.build_tokenizer()
    assert tok.pad_token_id != tok.eos_token_id
    for row in small_world["sft"].select(range(50)):
        text = row["prompt"] + row["completion"]
        ids = tok(text)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok(tok.decode(ids))["input_ids"] == ids


def test_probe_pairs_each_hold_one_error_of_their_kind(small_world):
    probes = world.probe_pairs(small_world["test"])
    for kind, (prompts, good, bad) in probes.items():
        assert len(prompts) == len(small_world["test"])
        for prompt, g, b in zip(prompts, good, bad):
            post = world.post_from_prompt(prompt)
            assert world.gold_score(post, g) == 1.0 and world.gold_score(post, b) < 1.0, (kind, b)
            gw, bw = world._clauses(g), world._clauses(b)
            if kind == "omission":
                assert len(bw) == len(gw) - 1
            else:  # one clause differs, in exactly the slot its kind names
                diff = [(x, y) for x, y in zip(gw, bw) if x != y]
                slot = {"wrong_person": 0, "wrong_action": 1, "wrong_object": 2}[kind]
                assert len(bw) == len(gw) and len(diff) == 1
                assert [i for i in range(3) if diff[0][0][i] != diff[0][1][i]] == [slot]
