"""The instruction-following world: chat prompts with constraints a program can check, for RLVR
on a real model (`--dataset embedded:ifeval`).

The fourth embedded world, beside the summarization (world.py), arithmetic (world_arith.py) and
code (world_code.py) ones, and the first made for a pretrained chat model rather than a
from-scratch one: verifiable instruction following as in IFEval (Zhou et al. 2023) and Tülu 3's
RLVR (Lambert et al. 2024). A **prompt** is one user message, a small task on a topic with one or
two constraints a verifier checks exactly:

    "Describe the ocean. Answer in at most 6 words."              family max_words
    "Write one sentence about coffee. Use only lowercase letters. Include the word 'morning'."
    "What is 38 + 45? Reply with the number only."                family number_only

Each prompt has one *primary* constraint (its `family` column, what eval.py --group_by family
reports) and, on SECOND_PROB of the topic prompts, a second one of another family. The
`constraints` column lists them as "family" or "family:argument" strings ("max_words:6",
"include_word:morning", "number_only:83"); `topic` and `keyword` name what the answer is about.

**Verifiers** (TRL's reward-function signature, `--reward_fn NAME`): `ifeval_strict` (1 when the
answer is a response and meets every constraint of its prompt, else 0) and one per family,
`ifeval_<family>` (1 / 0 on the prompts that hold that family, None on the others: TRL's "does not
apply"). Every one of them first asks whether the answer is a *response* (is_response), so that no
constraint can be met by gaming it: an empty answer, the constraint's word alone, an echo of the
prompt, a degenerate repetition, or a topic answer that never names its topic, all score 0.

**The system turn**: every prompt states it, SYSTEM, which is SmolLM2's chat template's default
system prompt, so the model reads the same tokens as without it and the verifiers see what the
model reads. The first real run left it out: the template injected it unseen, and six steps of GRPO
at learning rate 4e-5 (make demo-real) turned 131 of 300 test answers into "You are a ..." (that
system prompt verbatim, or a template on it: "You are a green elephant"), 26 of them passing. Two
response checks close that hole: an answer must not echo the system turn (the echo check reads
system and user turns; a prompt without a system turn is checked against SYSTEM, the one the
template adds), and must not be *addressed to the assistant*: an answer opening with the system
turn's first OPENING_WORDS words ("You are") speaks as the system prompt does, to the model, and
is not a response to the user's task. The rule costs a user's answer that legitimately starts
"You are" (a sentence about a friend, say); the base model wrote none of those on the test split.

**IFEval's wording**: the test split's TEST_SIZE prompts are followed by the same tasks with their
constraints worded as IFEval words them (IFEVAL_WORDING: "Your entire response should be in
English, and in all lowercase letters. No capital letters are allowed.") for every prompt whose
families IFEval also has (not start_with, not number_only). Their constraints, "ifeval.<family>",
are judged by IFEval's own rule for that instruction (check_ifeval: "Finish your response with
this exact phrase today." passes "... today" and fails "... today."), beneath the same response
checks; `--group_by family` reports them apart ("ifeval.lowercase"), so the held-out score says
whether what training on the project's wording taught carries over to the benchmark's.
tests/test_world_ifeval.py runs check_ifeval and lm-eval's own checkers over the same answers.

**Splits**: `rl` (prompts for GRPO and for sampling DPO pairs) and `test` (TEST_SIZE prompts, the
same for every seed, and their IFEval-worded twins). They are disjoint by topic (TEST_TOPICS is a fixed share of TOPICS; the
arithmetic questions of number_only by their pair of numbers) and so by prompt. The families in
HELD_OUT never appear in the `rl` split, neither as primary nor as second constraint: the test
split's rows of those families measure whether what training taught carries over to constraints
it never saw.
"""

import json
import random
import re

SPEC = "embedded:ifeval"  # --dataset value
TEST_SIZE = 300  # test prompts, the same for every seed
RL_SIZE = 2000  # training prompts (they change with the seed)
SECOND_PROB = 0.25  # chance that a topic prompt carries a second constraint
MIN_WORDS = 3  # a response to a topic prompt has at least this many words
ECHO_NGRAM = 6  # an answer sharing a run of this many words with its prompt echoes it
MAX_RUN = 3  # a word repeated this many times in a row is degenerate
MIN_DISTINCT = 0.5  # ... and so is an answer of 8+ words with fewer than this share of distinct words
# SmolLM2-135M-Instruct's chat template adds this system turn when a conversation has none: every
# prompt states it (the same tokens), so that the verifiers see it (module docstring)
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
OPENING_WORDS = 2  # an answer opening with the system turn's first words ("You are") is addressed to the model

# topics: (phrase as the prompt writes it, keyword the answer must name unless it is forbidden)
TOPICS = [
    ("the ocean", "ocean"), ("coffee", "coffee"), ("the moon", "moon"), ("a bicycle", "bicycle"),
    ("rain", "rain"), ("a library", "library"), ("the desert", "desert"), ("chocolate", "chocolate"),
    ("a volcano", "volcano"), ("winter", "winter"), ("a forest", "forest"), ("the sun", "sun"),
    ("a garden", "garden"), ("music", "music"), ("a river", "river"), ("bread", "bread"),
    ("a mountain", "mountain"), ("the wind", "wind"), ("a city", "city"), ("an island", "island"),
    ("a train", "train"), ("snow", "snow"), ("a castle", "castle"), ("the sky", "sky"),
    ("a dog", "dog"), ("a cat", "cat"), ("a horse", "horse"), ("an elephant", "elephant"),
    ("a whale", "whale"), ("an owl", "owl"), ("a spider", "spider"), ("a bee", "bee"),
    ("a butterfly", "butterfly"), ("a shark", "shark"), ("a penguin", "penguin"), ("a tiger", "tiger"),
    ("tea", "tea"), ("cheese", "cheese"), ("an apple", "apple"), ("a banana", "banana"),
    ("rice", "rice"), ("soup", "soup"), ("pizza", "pizza"), ("honey", "honey"),
    ("a lemon", "lemon"), ("a tomato", "tomato"), ("milk", "milk"), ("salt", "salt"),
    ("a computer", "computer"), ("a phone", "phone"), ("a camera", "camera"), ("a clock", "clock"),
    ("a lamp", "lamp"), ("a chair", "chair"), ("a window", "window"), ("a bridge", "bridge"),
    ("a ship", "ship"), ("an airplane", "airplane"), ("a car", "car"), ("a rocket", "rocket"),
    ("a book", "book"), ("a pencil", "pencil"), ("a map", "map"), ("a guitar", "guitar"),
    ("a piano", "piano"), ("a drum", "drum"), ("a painting", "painting"), ("a museum", "museum"),
    ("a school", "school"), ("a hospital", "hospital"), ("a farm", "farm"), ("a market", "market"),
    ("a beach", "beach"), ("a lake", "lake"), ("a cave", "cave"), ("a waterfall", "waterfall"),
    ("a storm", "storm"), ("lightning", "lightning"), ("a rainbow", "rainbow"), ("the stars", "star"),
    ("a cloud", "cloud"), ("fire", "fire"), ("ice", "ice"), ("a tree", "tree"),
    ("a flower", "flower"), ("grass", "grass"), ("a mushroom", "mushroom"), ("a seed", "seed"),
    ("autumn", "autumn"), ("spring", "spring"), ("summer", "summer"), ("the night", "night"),
    ("a friend", "friend"), ("a teacher", "teacher"), ("a doctor", "doctor"), ("a farmer", "farmer"),
    ("a chef", "chef"), ("a pilot", "pilot"), ("a poet", "poet"), ("a scientist", "scientist"),
    ("football", "football"), ("tennis", "tennis"), ("swimming", "swimming"), ("chess", "chess"),
    ("running", "running"), ("dancing", "dancing"), ("cooking", "cooking"), ("reading", "reading"),
    ("a birthday", "birthday"), ("a holiday", "holiday"), ("a wedding", "wedding"), ("a journey", "journey"),
    ("the internet", "internet"), ("a robot", "robot"), ("electricity", "electricity"), ("a battery", "battery"),
    ("a planet", "planet"), ("gravity", "gravity"), ("the brain", "brain"), ("the heart", "heart"),
    ("sleep", "sleep"), ("a dream", "dream"), ("a smile", "smile"), ("friendship", "friendship"),
    ("a kite", "kite"), ("a candle", "candle"), ("a key", "key"), ("a door", "door"),
    ("a mirror", "mirror"), ("a hat", "hat"), ("a shoe", "shoe"), ("an umbrella", "umbrella"),
    ("a wolf", "wolf"), ("a fox", "fox"), ("a rabbit", "rabbit"), ("a frog", "frog"),
    ("a turtle", "turtle"), ("a parrot", "parrot"), ("a dolphin", "dolphin"), ("an octopus", "octopus"),
    ("a carrot", "carrot"), ("an orange", "orange"), ("a potato", "potato"), ("sugar", "sugar"),
    ("a bus", "bus"), ("a boat", "boat"), ("a road", "road"), ("a tunnel", "tunnel"),
    ("a tower", "tower"), ("a village", "village"), ("a park", "park"), ("a zoo", "zoo"),
]
TEST_TOPIC_EVERY = 3  # every third topic is a test topic: 56 of 168, never in a training prompt
# one-sentence tasks: SmolLM2-135M-Instruct answers "Describe X." with 40+ tokens, truncated at the
# demo's --max_completion_length; a sentence it usually ends in time
TASKS = ["Write one sentence about {topic}.", "Write a short sentence about {topic}.",
         "In one sentence, describe {topic}.", "Tell me one thing about {topic}, in one sentence."]
# arguments of the families that take one
INCLUDE_WORDS = ["blue", "quiet", "golden", "morning", "gentle", "bright", "happy", "small", "old", "green"]
START_WORDS = ["Yes", "Today", "Honestly", "Imagine", "Indeed", "Sometimes", "Look", "Well"]
END_WORDS = ["today", "forever", "everywhere", "again", "indeed", "always", "now", "too"]
# words a one-sentence description usually holds, for forbid_word: never the topic's keyword, so the
# answer must still name its topic (the first real run forbade the keyword, and GRPO passed 5 of 300
# test prompts with non-answers: "I'm not sure what you're talking about.")
FORBID_WORDS = ["and", "very", "with", "beautiful", "many", "can", "of", "its"]
MAX_WORDS = range(8, 16)  # the base answers a one-sentence task in 17 words on average
BULLETS = (2, 3)

# family -> how the prompt states it (one or more phrasings; {arg} is its argument)
INSTRUCTIONS = {
    "lowercase": ["Use only lowercase letters.", "Write it all in lowercase letters, with no capital letters."],
    "uppercase": ["Write your whole answer in capital letters.", "Use only capital letters."],
    "include_word": ["Include the word '{arg}'.", "Use the word '{arg}' in your answer."],
    "forbid_word": ["Do not use the word '{arg}'.", "Do not say '{arg}'."],
    "max_words": ["Answer in at most {arg} words.", "Use no more than {arg} words."],
    "start_with": ["Start your answer with the word '{arg}'.", "Begin your answer with '{arg}'."],
    "end_with": ["End your answer with the word '{arg}'.", "Make '{arg}' the last word of your answer."],
    "no_commas": ["Do not use any commas.", "Write it without commas."],
    "quotes": ["Wrap your whole answer in double quotation marks.", "Put your entire answer inside double quotes."],
    "bullets": ["Answer with exactly {arg} bullet points, each starting with '- '.",
                "Give exactly {arg} bullet points in markdown ('- ')."],
    "json": ["Answer in JSON format, as {{\"answer\": \"...\"}}.", "Reply with a JSON object with one key, \"answer\"."],
    "number_only": ["Reply with the number only.", "Answer with just the number."],
}
# the families with a verifier (number_only is its own kind of prompt: an arithmetic question)
FAMILIES = ("lowercase", "uppercase", "include_word", "forbid_word", "max_words", "start_with", "end_with",
            "no_commas", "quotes", "bullets", "json", "number_only")
# the families the world's prompts draw (quotes, bullets and json, whose base accuracy was 0 of 12 each
# and whose answers run past a short completion length, keep their verifiers for a user's own JSONL)
WORLD_FAMILIES = ("lowercase", "uppercase", "include_word", "forbid_word", "max_words", "start_with", "end_with",
                  "no_commas", "number_only")
HELD_OUT = ("uppercase", "end_with")  # never in the rl split: the test split's transfer families
# families that cannot share a prompt (they contradict, or one fixes the other's format)
CLASH = {frozenset(p) for p in [("lowercase", "uppercase"), ("start_with", "quotes"), ("end_with", "quotes"),
                                ("bullets", "json"), ("bullets", "quotes"), ("json", "quotes"),
                                ("json", "start_with"), ("json", "end_with"), ("bullets", "max_words"),
                                ("bullets", "start_with"), ("bullets", "end_with"), ("json", "lowercase"),
                                ("json", "uppercase")]}
SECOND_FAMILIES = ("lowercase", "include_word", "max_words", "no_commas", "start_with", "uppercase", "end_with")

# IFEval's wording (Zhou et al. 2023; lm-eval's lm_eval/tasks/ifeval/instructions.py, build_description)
# of the families IFEval also has: family -> (IFEval's instruction id, its wording, {arg} the
# argument). A test row in this wording carries the constraint "ifeval.<family>:<arg>", which
# check() judges by IFEval's own rule for that instruction (check_ifeval), not the project's.
# start_with and number_only have no IFEval instruction. max_words' "at most N" is IFEval's
# "less than N+1".
IFEVAL_WORDING = {
    "lowercase": ("change_case:english_lowercase",
                  "Your entire response should be in English, and in all lowercase letters. No capital letters are allowed."),
    "uppercase": ("change_case:english_capital", "Your entire response should be in English, and in all capital letters."),
    "include_word": ("keywords:existence", "Include keywords ['{arg}'] in the response."),
    "forbid_word": ("keywords:forbidden_words", "Do not include keywords ['{arg}'] in the response."),
    "max_words": ("length_constraints:number_words", "Answer with less than {arg_plus_one} words."),
    "end_with": ("startend:end_checker", "Finish your response with this exact phrase {arg}. No other words should follow this phrase."),
    "no_commas": ("punctuation:no_comma", "In your entire response, refrain from the use of any commas."),
    "quotes": ("startend:quotation", "Wrap your entire response with double quotation marks."),
    "bullets": ("detectable_format:number_bullet_lists", "Your answer must contain exactly {arg} bullet points. Use the "
                "markdown bullet points such as:\n* This is point 1. \n* This is point 2"),
    "json": ("detectable_format:json_format", "Entire output should be wrapped in JSON format. You can use markdown ticks such as ```."),
}
IFEVAL = "ifeval."  # the prefix of a constraint in IFEval's wording, judged by IFEval's rule


# ---------------------------------------------------------------- what the verifiers read
_WORD = re.compile(r"[A-Za-z0-9]+(?:'[A-Za-z]+)?")


def words(text):
    """The words of a text: runs of letters and digits (an apostrophe's suffix kept: "it's")."""
    return _WORD.findall(text)


def _text(completion):
    """A completion's text: a string as it is; of TRL's messages, the last assistant turn's content."""
    if isinstance(completion, str):
        return completion
    return next((m["content"] for m in reversed(completion) if m["role"] == "assistant"), "")


def _system_text(prompt):
    """The system turn the model reads: the conversation's own, else the one the template adds (SYSTEM)."""
    if not isinstance(prompt, str) and prompt and prompt[0]["role"] == "system":
        return prompt[0]["content"]
    return SYSTEM


def _prompt_text(prompt):
    """What an answer must not echo: a text prompt, or the system and user turns of a conversation,
    with the template's SYSTEM where the conversation states none."""
    if isinstance(prompt, str):
        return SYSTEM + " " + prompt
    turns = [m["content"] for m in prompt if m["role"] in ("system", "user")]
    return " ".join(turns if prompt and prompt[0]["role"] == "system" else [SYSTEM] + turns)


def split_constraint(c):
    family, _, arg = c.partition(":")
    return family, arg


def base_family(family):
    """The family a constraint belongs to, whatever its wording ("ifeval.end_with" -> "end_with")."""
    return family.removeprefix(IFEVAL)


def mentions(text, keyword):
    """Whether the text names the keyword (any word starting with it, so "oceans" names "ocean")."""
    return any(w.lower().startswith(keyword.lower()) for w in words(text))


def degenerate(text):
    """A word repeated MAX_RUN times in a row, or 8+ words of which under MIN_DISTINCT are distinct."""
    ws = [w.lower() for w in words(text)]
    if any(len(set(ws[i:i + MAX_RUN])) == 1 for i in range(len(ws) - MAX_RUN + 1)):
        return True
    return len(ws) >= 8 and len(set(ws)) < MIN_DISTINCT * len(ws)


def echoes(text, prompt):
    """Whether the answer repeats a run of ECHO_NGRAM words of its prompt (or the whole prompt, if shorter)."""
    a, p = [w.lower() for w in words(text)], [w.lower() for w in words(prompt)]
    n = min(ECHO_NGRAM, len(p))
    grams = {tuple(p[i:i + n]) for i in range(len(p) - n + 1)}
    return any(tuple(a[i:i + n]) in grams for i in range(len(a) - n + 1))


_CONTRACTIONS = {"re": "are", "m": "am", "s": "is"}


def _opening(text):
    """The first OPENING_WORDS words, lowercased, a contraction spelled out ("You're" -> you, are)."""
    out = []
    for w in words(text)[:OPENING_WORDS]:
        head, _, tail = w.lower().partition("'")
        out += [head] + ([_CONTRACTIONS.get(tail, tail)] if tail else [])
    return out[:OPENING_WORDS]


def addressed(text, system):
    """Whether the answer opens with the system turn's first OPENING_WORDS words ("You are ...",
    "You're ..."): it speaks to the model, as the system prompt does, rather than answering the user."""
    opening = _opening(system)
    return len(opening) == OPENING_WORDS and _opening(text) == opening


def is_response(text, prompt, constraints, keyword, system=SYSTEM):
    """Whether an answer is a response at all, before any constraint is checked: not empty, not
    degenerate, no echo of the prompt (system turn included), not addressed to the model (opening
    like its system turn); to a topic prompt at least MIN_WORDS words that name the
    topic's keyword (unless a constraint forbids that word). number_only's answer is checked exactly
    by its own constraint."""
    if not text.strip() or degenerate(text) or echoes(text, prompt) or addressed(text, system):
        return False
    families = {base_family(f): arg for f, arg in map(split_constraint, constraints)}
    if "number_only" in families:
        return True
    if len(words(text)) < MIN_WORDS:
        return False
    return families.get("forbid_word", "").lower() == keyword.lower() or mentions(text, keyword)


def _strip_quotes(text):
    t = text.strip()
    return t[1:-1] if len(t) >= 2 and t[0] in "\"“" and t[-1] in "\"”" else t


def _json_answer(text):
    """The "answer" string of a JSON object (a ```json fence allowed), or None."""
    t = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", t, re.S)
    t = fence.group(1) if fence else t
    try:
        obj = json.loads(t)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or set(obj) != {"answer"} or not isinstance(obj["answer"], str):
        return None
    return obj["answer"]


def _bullets(text):
    """The bullet items if every non-empty line is a '- ' (or '* ') bullet with text, else None."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines or not all(re.match(r"[-*] \S", ln) for ln in lines):
        return None
    return [ln[2:] for ln in lines]


def check_ifeval(family, arg, text):
    """IFEval's own rule for the instruction of `family` (IFEVAL_WORDING), on the whole answer, as
    lm-eval's checkers judge it, except the language: lowercase and uppercase there also ask
    langdetect for English, which this does not."""
    if family == "lowercase":
        return text.islower()
    if family == "uppercase":
        return text.isupper()
    if family == "include_word":  # anywhere, any case: "golden" holds "old"
        return arg.lower() in text.lower()
    if family == "forbid_word":  # the word alone, any case ("very" forbids neither "every" nor "verys")
        return re.search(rf"\b{re.escape(arg)}\b", text, flags=re.IGNORECASE) is None
    if family == "max_words":  # less than N + 1 runs of word characters ("it's" is two)
        return len(re.findall(r"\w+", text)) < int(arg) + 1
    if family == "end_with":  # the exact phrase last, after an outer quote is dropped: no full stop after it
        return text.strip().strip('"').lower().endswith(arg.strip().lower())
    if family == "no_commas":
        return "," not in text
    if family == "quotes":
        t = text.strip()
        return len(t) > 1 and t[0] == '"' and t[-1] == '"'
    if family == "bullets":  # lines starting "*" (not "**") or "-", however many other lines there are
        return len(re.findall(r"^\s*\*[^\*].*$", text, flags=re.M)) + len(re.findall(r"^\s*-.*$", text, flags=re.M)) == int(arg)
    if family == "json":  # any JSON value, a ``` fence (```json) around it allowed
        t = text.strip()
        for fence in ("```json", "```Json", "```JSON", "```"):
            t = t.removeprefix(fence)
        try:
            json.loads(t.removesuffix("```").strip())
        except ValueError:
            return False
        return True
    raise ValueError(f"IFEval has no instruction for the family {family!r}")


def check(family, arg, text):
    """Whether the text meets one constraint (the response checks are is_response's); a constraint
    in IFEval's wording ("ifeval.<family>") by IFEval's rule (check_ifeval)."""
    if family.startswith(IFEVAL):
        return check_ifeval(base_family(family), arg, text)
    ws = words(text)
    if family == "lowercase":
        return any(c.isalpha() for c in text) and text == text.lower()
    if family == "uppercase":
        return any(c.isalpha() for c in text) and text == text.upper()
    if family == "include_word":
        return arg.lower() in (w.lower() for w in ws)
    if family == "forbid_word":  # the word nor its plural ("oceans"), any case; "the" allows "they"
        return not any(w.lower() in (arg.lower(), arg.lower() + "s", arg.lower() + "es") for w in ws)
    if family == "max_words":
        return len(ws) <= int(arg)
    if family == "start_with":  # the first word, after any opening quote or markdown
        return bool(ws) and ws[0].lower() == arg.lower() and not re.match(r"[^\w\s\"'*]", text.strip())
    if family == "end_with":  # the last word, followed only by punctuation
        return bool(ws) and ws[-1].lower() == arg.lower()
    if family == "no_commas":
        return "," not in text and "，" not in text
    if family == "quotes":
        t = text.strip()
        return len(t) >= 2 and t[0] in "\"“" and t[-1] in "\"”" and len(words(t[1:-1])) > 0
    if family == "bullets":
        items = _bullets(text)
        return items is not None and len(items) == int(arg) and len({i.lower() for i in items}) == len(items)
    if family == "json":
        answer = _json_answer(text)
        return answer is not None and len(words(answer)) > 0
    if family == "number_only":
        return re.fullmatch(r"\s*-?\d+\.?\s*", text) is not None and int(text.strip().rstrip(".")) == int(arg)
    raise ValueError(f"unknown constraint family {family!r}")


def follows(text, prompt, constraints, keyword, only=None):
    """1.0 when the answer is a response (is_response) and meets every constraint (or the one family
    `only`), else 0.0; the text checked for JSON answers is the "answer" string, for quotes the quoted."""
    system, prompt = _system_text(prompt), _prompt_text(prompt)
    families = [split_constraint(c) for c in constraints]
    body = text
    if any(f == "json" for f, _ in families):
        body = _json_answer(text) or ""
    elif any(f == "quotes" for f, _ in families):
        body = _strip_quotes(text)
    elif any(f == "bullets" for f, _ in families):
        body = " ".join(_bullets(text) or [])
    if not is_response(body, prompt, constraints, keyword, system):
        return 0.0
    for family, arg in families:
        if only is not None and base_family(family) != only:
            continue
        target = text if family in ("json", "quotes", "bullets", "number_only") or family.startswith(IFEVAL) else body
        if not check(family, arg, target):
            return 0.0
    return 1.0


def ifeval_strict(prompts, completions, constraints, keyword, **columns):
    """1.0 when the completion is a response and meets every constraint of its prompt, else 0.0."""
    return [follows(_text(c), p, cs, k) for p, c, cs, k in zip(prompts, completions, constraints, keyword)]


def family_verifier(family):
    """`ifeval_<family>`: 1.0 / 0.0 whether a response meets that family's constraint, None on the
    prompts that do not hold it (TRL: the function does not apply)."""
    def verifier(prompts, completions, constraints, keyword, **columns):
        return [follows(_text(c), p, cs, k, only=family) if any(base_family(split_constraint(x)[0]) == family for x in cs) else None
                for p, c, cs, k in zip(prompts, completions, constraints, keyword)]

    verifier.__name__ = f"ifeval_{family}"
    verifier.__doc__ = f"1.0 when a response meets its '{family}' constraint, 0.0 if not, None where it has none."
    return verifier


VERIFIERS = {"ifeval_strict": ifeval_strict, **{f"ifeval_{f}": family_verifier(f) for f in FAMILIES}}  # --reward_fn names


# ---------------------------------------------------------------- prompts
def constraint(rng, family):
    """A constraint string of the family, its argument drawn ("max_words:7"); forbid_word forbids a
    word of FORBID_WORDS, never the keyword, so that is_response's topic check applies."""
    arg = {"include_word": lambda: rng.choice(INCLUDE_WORDS), "forbid_word": lambda: rng.choice(FORBID_WORDS),
           "max_words": lambda: str(rng.choice(MAX_WORDS)), "start_with": lambda: rng.choice(START_WORDS),
           "end_with": lambda: rng.choice(END_WORDS), "bullets": lambda: str(rng.choice(BULLETS))}.get(family)
    return f"{family}:{arg()}" if arg else family


def instruction(rng, c):
    family, arg = split_constraint(c)
    return rng.choice(INSTRUCTIONS[family]).format(arg=arg)


def conversation(text):
    """A prompt: the system turn SYSTEM, stated, and the user's message."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def topic_row(rng, families, topic):
    """A topic prompt: a task, its primary family's constraint, sometimes a second one."""
    phrase, keyword = topic
    family = rng.choice([f for f in families if f != "number_only"])
    cs = [constraint(rng, family)]
    seconds = [f for f in SECOND_FAMILIES if f in families and f != family and frozenset((f, family)) not in CLASH]
    if seconds and rng.random() < SECOND_PROB:
        cs.append(constraint(rng, rng.choice(seconds)))
    text = " ".join([rng.choice(TASKS).format(topic=phrase)] + [instruction(rng, c) for c in cs])
    return {"prompt": conversation(text), "constraints": cs, "family": family,
            "topic": phrase, "keyword": keyword}


def number_row(rng, a, b):
    c = f"number_only:{a + b}"
    text = f"What is {a} + {b}? {instruction(rng, c)}"
    return {"prompt": conversation(text), "constraints": [c], "family": "number_only",
            "topic": f"{a} + {b}", "keyword": str(a + b)}


def ifeval_twin(row):
    """The row in IFEval's wording: the same task, each constraint stated as IFEval states it and
    judged by IFEval's rule ("ifeval.<family>:<arg>"); None when IFEval lacks one of its families."""
    cs = [split_constraint(c) for c in row["constraints"]]
    if row["family"] == "number_only" or not all(f in IFEVAL_WORDING for f, _ in cs):
        return None
    text = row["prompt"][-1]["content"]
    task = next(t.format(topic=row["topic"]) for t in TASKS if text.startswith(t.format(topic=row["topic"])))
    stated = [IFEVAL_WORDING[f][1].format(arg=arg, arg_plus_one=int(arg) + 1 if arg.isdigit() else "") for f, arg in cs]
    return {**row, "prompt": conversation(" ".join([task] + stated)), "constraints": [f"{IFEVAL}{f}:{arg}" if arg else f"{IFEVAL}{f}" for f, arg in cs],
            "family": IFEVAL + row["family"]}


def draw_rows(rng, size, families, topics, pairs):
    """`size` rows, each family drawn uniformly as the primary one (number_only from `pairs`, which are used up)."""
    rows = []
    for _ in range(size):
        if "number_only" in families and rng.random() < 1 / len(families):
            rows.append(number_row(rng, *pairs.pop()))
        else:
            rows.append(topic_row(rng, families, rng.choice(topics)))
    return rows


def build_world(seed=0, sizes=None):
    """The world's splits as `datasets.Dataset`s of conversational prompts with the columns
    `constraints`, `family`, `topic`, `keyword` (module docstring):

    - `rl`: RL_SIZE prompts on the training topics, without the HELD_OUT families (changes with the seed);
    - `test`: TEST_SIZE prompts on the test topics, every family (the same for every seed), then
      those whose every family IFEval has again, in IFEval's wording (ifeval_twin: family "ifeval.<family>").
    """
    sizes = {"rl": RL_SIZE, "test": TEST_SIZE, **(sizes or {})}
    test_topics = TOPICS[::TEST_TOPIC_EVERY]
    train_topics = [t for t in TOPICS if t not in test_topics]
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(12345).shuffle(pairs)
    test_pairs, train_pairs = pairs[:2000], pairs[2000:]  # the number_only questions, disjoint
    test = draw_rows(random.Random(0), sizes["test"], WORLD_FAMILIES, test_topics, test_pairs)
    test += [twin for twin in map(ifeval_twin, test) if twin is not None]  # the same tasks in IFEval's wording
    train_families = tuple(f for f in WORLD_FAMILIES if f not in HELD_OUT)
    rng = random.Random(1_000_003 + seed)
    rng.shuffle(train_pairs)
    rl = draw_rows(rng, sizes["rl"], train_families, train_topics, train_pairs)
    from datasets import Dataset  # a slow import: not for --help

    return {"rl": Dataset.from_list(rl), "test": Dataset.from_list(test)}
