"""The embedded world: a seeded, synthetic TL;DR task with a rule-based gold judge.

Every test, and anyone without a GPU, runs the pipeline on this world. It plays the part of
Reddit TL;DR + human labellers in Stiennon et al. 2020:

- a **post** is a few sentences built from a fixed lexicon. Some sentences state a *fact*
  (a person, an action, an object, in that order: "yesterday alice bought the bike at the park .")
  and the others are filler ("the weather was nice .", "alice was happy .");
- the **key facts** of a post are exactly the facts it states; the **reference TL;DR** states
  them, tersely, in order: "alice bought bike . bob lost phone ." ;
- the **gold judge** `gold_score(post, summary)` (formula below) is the human labeller and the
  rule verifier that GRPO can optimise directly;
- **demonstrations** come from simulated annotators of mixed quality (careful, lazy, inventive,
  verbose), so an SFT policy that imitates them scores clearly below the references;
- **preference pairs** label two summaries with a Bradley-Terry draw on the gold-score
  difference at temperature `PREF_TEMPERATURE`, so labels are noisy, the way human labels are:
  a quarter are two annotators' summaries, the rest a careful summary against the same with one
  fact copied wrongly or left out (`contrast_pair`): the copy error is the one a from-scratch
  policy makes, and a reward model does not learn to see it from the annotators' pairs alone.

Everything is plain text, so any tokenizer and model can train on it; `build_tokenizer` and
`build_model` (scratch.py) give the tiny Qwen2, one token per word, that the tests and `make demo` train from scratch.
"""

import json
import math
import os
import random
import re


from worlds import scratch
from worlds.scratch import build_model  # noqa: F401 (world.build_model: the tiny Qwen2, for any tokenizer)

# ---------------------------------------------------------------- lexicon
PEOPLE = "alice bob carol dave erin frank grace heidi ivan judy mallory oscar".split()
ACTIONS = "bought sold lost found fixed painted borrowed broke cleaned hid moved washed".split()
OBJECTS = "bike car laptop phone guitar lamp chair book camera watch kettle sofa".split()
PLACES = "park station office kitchen garage market library school beach garden".split()
ADJECTIVES = "old new red small big shiny".split()
FILLER = [
    "the weather was nice .",
    "i was so tired after that .",
    "it was a long week .",
    "nobody knows why .",
    "anyway that is the whole story .",
    "we had a lot of fun .",
    "what do you think ?",
    "honestly i did not expect it .",
]
MENTIONS = ["{p} was happy .", "{p} says hi .", "i called {p} later ."]  # a person, but no fact
FACT_TEMPLATES = [
    "{p} {a} the {o} .",
    "{t} {p} {a} the {o} at the {pl} .",
    "i think {p} {a} the {adj} {o} .",
    "{p} {a} a {o} near the {pl} {t} .",
]
PROMPT_TEMPLATE = "POST: {post}\nTL;DR:"  # the completion is " " + summary

# ---------------------------------------------------------------- gold judge
# gold = covered / n - 0.5 * unsupported / n - 0.5 * repeated / n - 0.02 * max(0, words - ref_words)
# clipped to [-1, 1], where n is the number of key facts in the post, and each clause of the
# summary (split at ".") is read as its first (person, action, object) in order:
#   covered     key facts stated at least once;
#   unsupported clauses that state no fact, or a fact the post does not contain (hallucination);
#   repeated    clauses that restate a key fact already covered;
#   words       summary length in words (with "."), against the reference's 4 words per fact.
# The reference scores exactly 1.0; an empty summary scores 0.
W_UNSUPPORTED, W_REPEATED, W_EXCESS_WORD = 0.5, 0.5, 0.02
_WORD = re.compile(r"[a-z]+|[.?!]")
_PEOPLE, _ACTIONS, _OBJECTS = set(PEOPLE), set(ACTIONS), set(OBJECTS)


def _words(text):
    return _WORD.findall(text.lower())


def _clauses(text):
    """Split text into clauses (lists of words) at sentence ends."""
    clause, out = [], []
    for w in _words(text):
        if w in ".?!":
            if clause:
                out.append(clause)
            clause = []
        else:
            clause.append(w)
    if clause:
        out.append(clause)
    return out


def _fact(clause):
    """The first (person, action, object) of a clause, in that order, or None."""
    person = action = None
    for w in clause:
        if person is None:
            if w in _PEOPLE:
                person = w
        elif action is None:
            if w in _ACTIONS:
                action = w
        elif w in _OBJECTS:
            return (person, action, w)
    return None


def key_facts(post):
    """The facts a post states, in order, without repeats."""
    facts = []
    for clause in _clauses(post):
        f = _fact(clause)
        if f is not None and f not in facts:
            facts.append(f)
    return facts


def gold_counts(post, summary):
    """The terms of the gold judge's formula: key facts `missed` (n - covered), `unsupported`
    and `repeated` clauses, `excess` words, and `n`."""
    facts = key_facts(post)
    covered, unsupported, repeated = set(), 0, 0
    for clause in _clauses(summary):
        f = _fact(clause)
        if f is None or f not in facts:
            unsupported += 1
        elif f in covered:
            repeated += 1
        else:
            covered.add(f)
    return {"n": len(facts), "missed": len(facts) - len(covered), "unsupported": unsupported, "repeated": repeated,
            "excess": max(0, len(_words(summary)) - 4 * len(facts))}


def gold_score(post, summary):
    """The gold judge: deterministic, rule-based score of a summary of a post (formula above)."""
    c = gold_counts(post, summary)
    n = max(c["n"], 1)
    score = (c["n"] - c["missed"] - W_UNSUPPORTED * c["unsupported"] - W_REPEATED * c["repeated"]) / n
    return max(-1.0, min(1.0, score - W_EXCESS_WORD * c["excess"]))


def post_from_prompt(prompt):
    """Recover the post from a world prompt (or any text: the judge ignores non-lexicon words)."""
    if isinstance(prompt, list):  # conversational: the user turns hold the post
        prompt = " ".join(m["content"] for m in prompt if m.get("role") != "assistant")
    return prompt.split("TL;DR:")[0].replace("POST:", "")


def gold_reward(prompts, completions, **columns):
    """The gold judge as a reward function with TRL's signature: fn(prompts, completions, **cols)."""
    posts = columns.get("post") or [post_from_prompt(p) for p in prompts]
    if not all(key_facts(post) for post in posts):  # another world's prompt: every summary would score <= 0
        raise ValueError("the prompt holds no post of the embedded world (no fact such as 'alice bought bike'), and gold "
                         "judges summaries of that world's posts only: pass another reward function for this data")
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [gold_score(p, c) for p, c in zip(posts, texts)]


# ---------------------------------------------------------------- posts and annotators
def _time(rng):
    return rng.choice(["yesterday", "today", "tonight", "on monday", "on friday", "last week"])


def make_post(rng):
    """A post with 2-3 distinct facts (no person repeats) and 0-2 filler sentences."""
    n = rng.randint(2, 3)
    people = rng.sample(PEOPLE, n)
    facts = [(p, rng.choice(ACTIONS), rng.choice(OBJECTS)) for p in people]
    sentences = [
        rng.choice(FACT_TEMPLATES).format(
            p=p, a=a, o=o, t=_time(rng), pl=rng.choice(PLACES), adj=rng.choice(ADJECTIVES)
        )
        for p, a, o in facts
    ]
    for _ in range(rng.randint(0, 2)):
        if rng.random() < 0.3:
            filler = rng.choice(MENTIONS).format(p=rng.choice(PEOPLE))
        else:
            filler = rng.choice(FILLER)
        sentences.insert(rng.randint(0, len(sentences)), filler)
    return " ".join(sentences), facts


def reference_summary(facts):
    return " ".join(f"{p} {a} {o} ." for p, a, o in facts)


ANNOTATORS = {"careful": 0.25, "lazy": 0.30, "inventive": 0.20, "verbose": 0.25}


def annotate(rng, post, facts, kind):
    """A demonstration summary written by one simulated annotator."""
    facts = list(facts)
    if kind == "lazy":  # omits one fact, or two of four
        for _ in range(1 if len(facts) < 4 else 2):
            facts.pop(rng.randrange(len(facts)))
    if kind == "inventive":  # adds a fact that is not in the post
        while True:
            extra = (rng.choice(PEOPLE), rng.choice(ACTIONS), rng.choice(OBJECTS))
            if extra not in facts:
                break
        facts.insert(rng.randint(0, len(facts)), extra)
    if kind == "verbose":  # states every fact, padded with words from the post
        return " ".join(
            f"{p} {rng.choice(['really ', 'finally ', ''])}{a} the {o} "
            f"{rng.choice(['at the ' + rng.choice(PLACES), _time(rng), 'i think'])} ."
            for p, a, o in facts
        )
    return reference_summary(facts)


def sample_annotator(rng):
    return rng.choices(list(ANNOTATORS), weights=list(ANNOTATORS.values()))[0]


# ---------------------------------------------------------------- datasets
PREF_TEMPERATURE = 0.1  # P(a preferred over b) = sigmoid((gold_a - gold_b) / T)
# prefs: 4000 annotator pairs, then 12000 contrast pairs (`contrast_pair`) drawn after every other split
SPLIT_SIZES = {"sft": 8000, "prefs": 4000, "contrast": 12000, "rl": 2000, "test": 200}


def label_pair(rng, post, a, b):
    """A preference row for two summaries of `post`: the labeller prefers a with probability
    sigmoid((gold_a - gold_b) / PREF_TEMPERATURE), a noisy Bradley-Terry draw."""
    ga, gb = gold_score(post, a), gold_score(post, b)
    if rng.random() >= 1 / (1 + math.exp(-(ga - gb) / PREF_TEMPERATURE)):
        a, b, ga, gb = b, a, gb, ga  # the labeller preferred b
    return {"prompt": PROMPT_TEMPLATE.format(post=post), "chosen": " " + a, "rejected": " " + b,
            "post": post, "chosen_gold": ga, "rejected_gold": gb}


def slip(rng, facts):
    """The reference TL;DR with one fact copied wrongly: its object (or action) taken from another
    fact of the post (`miscopy`), the copy error a from-scratch policy makes. Where every fact of
    the post has the same action (or object), no other fact can give one, so the slip copies the
    other field; `miscopy` would take a word the post does not hold: an invention, not a copy
    error, and one the annotators' pairs already cover (an inventive annotator adds a whole fact):
    trained on such inventions, reward models scored them 0.00-0.34, preferring the invented word."""
    i = rng.randrange(len(facts))
    field = 2 if rng.random() < 0.5 else 1
    if all(f[field] == facts[i][field] for f in facts):  # no other fact has another one to copy
        field = 3 - field  # 1 <-> 2; where both fields are shared, `miscopy` falls back to the lexicon
    return reference_summary(miscopy(rng, facts, i, field))


def omit(rng, facts):
    """The reference TL;DR with one fact left out (what a lazy annotator does)."""
    kept = list(facts)
    kept.pop(rng.randrange(len(kept)))
    return reference_summary(kept)


def contrast_pair(rng, post, facts):
    """A careful annotator's summary of `post` against the same summary with one slip: one fact
    copied wrongly (`slip`, two pairs in three) or left out (one in three), labelled like every
    pair (`label_pair`), so the careful one wins but for label noise. Contrast pairs of this kind
    are how a factual-consistency judge learns to see a swapped entity (Kryscinski et al. 2020,
    FactCC): the annotators' pairs never hold a copy error (an inventive annotator invents a whole
    fact), and a reward model trained on those alone scores one like the right fact. The
    omissions matter too: without them, or with the annotators' pairs at half the data instead of
    a quarter, a reward model learns the copy errors far more slowly (docs/worlds.md)."""
    careful = reference_summary(facts)
    return label_pair(rng, post, careful, omit(rng, facts) if rng.random() < 1 / 3 else slip(rng, facts))


def build_world(seed=0, sizes=None):
    """The world's splits as `datasets.Dataset`s in TRL's standard formats.

    - `sft`:   prompt + completion (annotator demonstrations), plus `post`, `annotator`;
    - `prefs`: prompt + chosen + rejected (noisy Bradley-Terry labels), plus `post`,
               `chosen_gold`, `rejected_gold`: `sizes["prefs"]` pairs of two annotators'
               summaries and `sizes["contrast"]` contrast pairs (`contrast_pair`), shuffled together;
    - `rl`:    prompt only, plus `post` (passed on to reward functions);
    - `test`:  prompt + `reference`, plus `post`; its posts appear in no other split.
    """
    sizes = {**SPLIT_SIZES, **(sizes or {})}
    rng = random.Random(seed)
    seen = set()  # every post is unique, so the test split is disjoint from the others

    def fresh_post():
        while True:
            post, facts = make_post(rng)
            if post not in seen:
                seen.add(post)
                return post, facts

    def prompt(post):
        return PROMPT_TEMPLATE.format(post=post)

    test = []
    for _ in range(sizes["test"]):  # drawn first, so train sizes do not change the test split
        post, facts = fresh_post()
        test.append({"prompt": prompt(post), "reference": " " + reference_summary(facts), "post": post})
    sft = []
    for _ in range(sizes["sft"]):
        post, facts = fresh_post()
        kind = sample_annotator(rng)
        sft.append({"prompt": prompt(post), "completion": " " + annotate(rng, post, facts, kind),
                    "post": post, "annotator": kind})
    prefs = []
    while len(prefs) < sizes["prefs"]:
        post, facts = fresh_post()
        a = annotate(rng, post, facts, sample_annotator(rng))
        b = annotate(rng, post, facts, sample_annotator(rng))
        if a == b:
            continue
        prefs.append(label_pair(rng, post, a, b))
    rl = []
    for _ in range(sizes["rl"]):
        post, _facts = fresh_post()
        rl.append({"prompt": prompt(post), "post": post})
    for _ in range(sizes["contrast"]):  # drawn last: they change no other split, nor the annotator pairs
        prefs.append(contrast_pair(rng, *fresh_post()))
    if sizes["contrast"]:  # without them the split is the annotator pairs, in the order they always had
        rng.shuffle(prefs)
    from datasets import Dataset  # a slow import: not for --help

    return {name: Dataset.from_list(rows) for name, rows in
            [("sft", sft), ("prefs", prefs), ("rl", rl), ("test", test)]}


def world_stats(world):
    """Headline numbers of the world: what the references, demos and labels are worth."""
    test, sft, prefs = world["test"], world["sft"], world["prefs"]
    ref = [gold_score(p, r) for p, r in zip(test["post"], test["reference"])]
    demo = [gold_score(p, c) for p, c in zip(sft["post"], sft["completion"])]
    # label-noise ceiling: how often the gold judge itself agrees with the noisy labels (ties 1/2)
    agree = [1.0 if c > r else 0.5 if c == r else 0.0
             for c, r in zip(prefs["chosen_gold"], prefs["rejected_gold"])]
    return {"reference_gold": sum(ref) / len(ref), "demo_gold": sum(demo) / len(demo),
            "label_ceiling": sum(agree) / len(agree)}


def write_jsonl(world, folder):
    """Write every split to <folder>/<split>.jsonl, for people to look at or reuse as --dataset."""
    os.makedirs(folder, exist_ok=True)
    for name, ds in world.items():
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            for row in ds:
                f.write(json.dumps(row) + "\n")


def miscopy(rng, facts, i, field):
    """`facts` with fact i's object (field 2) or action (field 1) taken from another fact of the
    post, or any other one when all facts share it: the copy error a from-scratch policy makes."""
    old = facts[i][field]
    lexicon = OBJECTS if field == 2 else ACTIONS
    others = [x[field] for x in facts if x[field] != old] or [x for x in lexicon if x != old]
    wrong = list(facts[i])
    wrong[field] = rng.choice(others)
    return [tuple(wrong) if j == i else x for j, x in enumerate(facts)]


def probe_pairs(split, seed=0):
    """Minimal pairs for a reward model: the reference TL;DR of each post against a copy with
    one error of one kind, so accuracy on each kind says what the reward model can see.

    - `omission`:  one fact left out (what lazy annotators do);
    - `wrong_object`: one fact's object taken from another fact of the post (the slip a
      from-scratch policy makes most: "bob lost bike" where the post says bob lost the phone);
    - `wrong_action`: one fact's action taken from another fact of the post, or any other action
      when all facts share it;
    - `wrong_person`: one fact's person replaced by someone the post never names.
    Returns {kind: (prompts, good, bad)}, lists of texts; the gold judge prefers every good one.
    """
    rng = random.Random(seed)
    out = {k: ([], [], []) for k in ("omission", "wrong_object", "wrong_action", "wrong_person")}
    for row in split:
        facts = key_facts(row["post"])
        named = set(_words(row["post"]))
        for kind, (prompts, good, bad) in out.items():
            f = list(facts)
            i = rng.randrange(len(f))
            p, a, o = f[i]
            if kind == "omission":
                f.pop(i)
            elif kind in ("wrong_object", "wrong_action"):
                f = miscopy(rng, facts, i, 2 if kind == "wrong_object" else 1)
            else:
                f[i] = (rng.choice([x for x in PEOPLE if x not in named]), a, o)
            prompts.append(row["prompt"])
            good.append(" " + reference_summary(facts))
            bad.append(" " + reference_summary(f))
    return out


# ---------------------------------------------------------------- tokenizer and tiny model
def vocabulary():
    """Every word the world writes, sorted."""
    words = set(PEOPLE + ACTIONS + OBJECTS + PLACES + ADJECTIVES)
    for text in FILLER + MENTIONS + FACT_TEMPLATES + ["yesterday today tonight on monday friday last week"]:
        words.update(w for w in text.split() if "{" not in w)
    words.update(["POST:", "TL;DR:", ".", "?", "!", "really", "finally", "i", "think", "at", "the"])
    return sorted(words)


def build_tokenizer():
    """The world's tokenizer (scratch.added_words_tokenizer): Qwen2's byte-level layout over the
    256 bytes, with every word of the world after its space (" carol", " .") and "POST:", "TL;DR:"
    one added token each, so `AutoTokenizer` loads it exactly; pad and EOS are distinct."""
    bare = ("POST:", "TL;DR:")
    return scratch.added_words_tokenizer([w for w in vocabulary() if w not in bare], bare)
