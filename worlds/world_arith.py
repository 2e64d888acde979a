"""The arithmetic world: a seeded, synthetic reasoning task with exact verifiers, for RLVR.

The second embedded world (`--dataset embedded:arith`), beside the summarization one (world.py).
It plays the part of a math dataset with worked solutions and a final-answer checker:

- a **problem** adds two-digit numbers: two at level 1 (`Q: 47+85=`), three at level 2
  (`Q: 47+85+23=`, a multi-step chain), four at level 3 (`Q: 47+85+23+61=`; completions of up
  to 81 characters, against 52 at level 2 and 23 at level 1);
- the **scratchpad** adds in columns, units first, writing the carry into the next column, and
  each intermediate total of a chain, then the answer:
      Q: 47+85=     ->  " 7+5=12 4+8+1=13 A: 132"
      Q: 47+85+23=  ->  " 7+5=12 4+8+1=13 =132 2+3=5 3+2=5 1+0=1 A: 155"
- **demonstrations** come from a noisy demonstrator with two kinds of error:
  * one *systematic* error: when a units column sums to 10 or 11 it drops the carry
    (" 7+3=10 4+8=12 A: 120" for 47+83): the same mistake every time, so a policy that imitates
    the demonstrations learns it too; 17% of level-1 problems have such a column;
  * random *slips*: with probability SLIP_PROB = 0.2 one column's sum is off by one (and the
    rest of the solution follows from it): noise, which an imitator averages away;
  so 0.83 x 0.8 = 66% of level-1 demonstrations are right. The headroom this leaves: a perfect
  imitator of the demonstrator's most likely output answers 83% of level-1 problems (all but
  the carry ones), and a verifier reward can take it to 100% by fixing the carry;
- two **verifiers** with TRL's reward-function signature fn(prompts, completions, **columns):
  `arith_strict` (1 if the text after the last "A:" is exactly the `answer` column, else 0) and
  `arith_lenient` (1 if the last number in the completion equals `answer`, else 0).

The splits `sft` / `rl` / `test` hold disjoint problems. The test split is the same for every
seed, and no seed's training splits hold one of its problems (a test split drawn per seed would
share problems with another seed's training splits). The
`prefs` split (`dpo.py --dataset embedded:arith`) is an offline preference dataset from the
demonstrator: on the SFT split's problems, two fresh demonstrations of a problem, one right and one
wrong by the verifier (chosen, rejected), 2000 pairs; mostly slips against the right scratchpad,
as the carry trap rarely gives a right demonstration (preference_pairs). Every text is made of 16
characters, so the world trains a tiny character-level Qwen2 from scratch (scratch.py, `python
sft.py --dataset embedded:arith`).

**With a calculator tool** (`--dataset embedded:arith_tools`, level 1; grpo.py `--tools
calculator.py:add`): the same problems, as conversations, and a chat template of the world's own
(CHAT_TEMPLATE) that tools.py's real path renders: the `tools=` argument lists the tools' names
(`T:add` on a line before the question; not their JSON schemas, which would fill a char-level
model's 256 positions), and a call is Qwen2.5's `<tool_call>{json}</tool_call>` in the assistant
turn, with compact JSON. An exchange, as the model reads it (<eos> ends each of its turns):
    T:add
    Q: 47+38=<tool_call>{"name":"add","arguments":{"a":47,"b":38}}</tool_call><eos> R: 85 A: 85<eos>
Half of the SFT prompts list the tool (LIST_PROB; a `tools` column of JSON schemas, as TRL's
SFTTrainer reads it); on those the demonstrator calls it on CALL_PROB = 30% of problems, at
random (it cannot tell the carry problems), and its tool-using demonstrations are right; on the
others, and on every prompt that lists no tool, it writes the scratchpad with its errors. So
imitation calls the tool on about 30% of samples and never greedily, and a verifier reward can
teach the policy to call it where its scratchpad fails.
"""

import json
import random
import re
import sys


SPEC = "embedded:arith"  # --dataset value; "embedded:arith:2" (chains), "embedded:arith:1,2" (mixed levels), ...
PROMPT_TEMPLATE = "Q: {question}="  # the completion is the scratchpad, " ... A: <answer>"
NUMBERS_PER_LEVEL = {1: 2, 2: 3, 3: 4}  # level -> how many two-digit numbers are added
SLIP_PROB = 0.2  # chance that a demonstration has one column off by one
SPLIT_SIZES = {"sft": 5000, "rl": 2000, "test": 400, "prefs": 2000}  # level 1 has 90 x 90 = 8100 problems in all
PREFS_DRAWS = 20  # prefs: demonstrations drawn per problem, at most, to find one right and one wrong
TOOLS_SPEC = "embedded:arith_tools"  # --dataset value of the world with a calculator tool (level 1)
TOOL_FILE = "worlds/calculator.py"  # its tool: --tools worlds/calculator.py:add
LIST_PROB = 0.5  # chance that an SFT prompt lists the tool
CALL_PROB = 0.3  # chance that the demonstrator calls it on a prompt that lists it
# the world's chat template (transformers renders it with trim_blocks and lstrip_blocks): the tools'
# names, then "Q: <question>=", the model's turns each closed by <eos>, a tool reply as " R: <reply>";
# a conversation is a prefix of itself with tool replies added (tools.tool_turn_ids needs it), and
# with no tools a prompt renders exactly as embedded:arith's "Q: 47+38="
CHAT_TEMPLATE = (
    "{% if tools %}T:{% for t in tools %}{{ t.function.name }}{% if not loop.last %},{% endif %}{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}Q: {{ m.content }}="
    "{% elif m.role == 'assistant' %}{{ m.content }}<eos>"
    "{% elif m.role == 'tool' %} R: {{ m.content }}"
    "{% endif %}{% endfor %}"
)


def parse_spec(spec):
    """--dataset embedded:arith[:LEVELS] -> the levels, e.g. (1,) or (1, 2); None if not this world."""
    if spec != SPEC and not spec.startswith(SPEC + ":"):
        return None
    text = spec[len(SPEC) + 1:] or "1"
    try:
        levels = tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        levels = ()
    if not levels or any(level not in NUMBERS_PER_LEVEL for level in levels):
        raise ValueError(f"--dataset {spec}: levels must be a comma-separated subset of "
                         f"{', '.join(map(str, NUMBERS_PER_LEVEL))}, e.g. {SPEC}:1,2.")
    return levels


# ---------------------------------------------------------------- scratchpad
def add_in_columns(x, y, drop_carry=False, slip=None):
    """Column addition of x + y, units first: (steps, total as written).

    `drop_carry`: the systematic error (a units sum of 10 or 11 carries nothing);
    `slip`: (column, delta) adds delta to that column's sum (kept within 0..19).
    """
    dx, dy = _digits(x), _digits(y)
    steps, out, carry = [], [], 0
    for i in range(max(len(dx), len(dy))):
        a, b = (dx[i] if i < len(dx) else 0), (dy[i] if i < len(dy) else 0)
        s = a + b + carry
        if slip is not None and slip[0] == i:
            s = s + slip[1] if 0 <= s + slip[1] <= 19 else s - slip[1]
        steps.append(f"{a}+{b}" + (f"+{carry}" if carry else "") + f"={s}")
        carry = 0 if (i == 0 and drop_carry and s in (10, 11)) else s // 10
        out.append(s % 10)
    if carry:
        out.append(carry)
    return steps, int("".join(str(d) for d in reversed(out)))


def _digits(n):
    return [int(c) for c in reversed(str(n))]


def scratchpad(numbers, drop_carry=False, slip=None):
    """The completion for adding `numbers`: (text, answer as written). `slip`: (step, column,
    delta); `drop_carry` as in add_in_columns, at every step."""
    parts, total = [], numbers[0]
    for k, y in enumerate(numbers[1:]):
        steps, total = add_in_columns(total, y, drop_carry, slip[1:] if slip and slip[0] == k else None)
        parts += steps + ([f"={total}"] if k < len(numbers) - 2 else [])  # intermediate totals of a chain
    return " " + " ".join(parts) + f" A: {total}", total


def has_carry_trap(numbers):
    """Whether the demonstrator's systematic error applies: some step's units column sums to 10 or 11."""
    total = numbers[0]
    for y in numbers[1:]:
        if total % 10 + y % 10 in (10, 11):
            return True
        total += y
    return False


def demonstrate(rng, numbers):
    """The noisy demonstrator's completion: (text, answer as written, slipped)."""
    slip = None
    if rng.random() < SLIP_PROB:
        step = rng.randrange(len(numbers) - 1)
        width = len(str(sum(numbers[:step + 1])))  # columns of that step
        slip = (step, rng.randrange(width), rng.choice([-1, 1]))
    text, written = scratchpad(numbers, drop_carry=True, slip=slip)
    return text, written, slip is not None


# ---------------------------------------------------------------- verifiers
_FINAL = re.compile(r"A:\s*(\d+)\s*")
_NUMBER = re.compile(r"\d+")


def _text(completion):
    """The text holding the final answer: a string as it is; of TRL's messages (a tool-using exchange
    is assistant and tool turns), the last assistant turn."""
    if isinstance(completion, str):
        return completion
    return next((m["content"] for m in reversed(completion) if m["role"] == "assistant"), "")


def _number(text):
    """int() of a decimal integer's text of any length (Python refuses more than 4300 digits by
    default: a long answer, or a long number a model wrote, is a number all the same)."""
    text = str(text).strip()
    if len(text.lstrip("+-")) <= 4000 or not hasattr(sys, "set_int_max_str_digits"):
        return int(text)
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return int(text)
    finally:
        sys.set_int_max_str_digits(old)


def strict_answer(text):
    """The answer after the last "A:", if all that follows it is one number; else None."""
    _, sep, tail = text.rpartition("A:")
    m = _FINAL.fullmatch(sep + tail) if sep else None
    return _number(m.group(1)) if m else None


def lenient_answer(text):
    """The last number anywhere in the text, or None."""
    numbers = _NUMBER.findall(text)
    return _number(numbers[-1]) if numbers else None


def arith_strict(prompts, completions, answer, **columns):
    """1.0 when the text after the last "A:" is exactly the `answer` column's number, else 0.0."""
    return [float(strict_answer(_text(c)) == _number(a)) for c, a in zip(completions, answer)]


def arith_lenient(prompts, completions, answer, **columns):
    """1.0 when the last number in the completion equals the `answer` column, else 0.0."""
    return [float(lenient_answer(_text(c)) == _number(a)) for c, a in zip(completions, answer)]


VERIFIERS = {"arith_strict": arith_strict, "arith_lenient": arith_lenient}  # --reward_fn names


# ---------------------------------------------------------------- datasets
def build_world(seed=0, levels=(1,), sizes=None, tools=False):
    """The world's splits as `datasets.Dataset`s in TRL's formats, every problem in one split only
    (but `prefs`, whose problems are the `sft` split's).

    - `sft`:   prompt + completion (the noisy demonstrator), plus `answer` (the true sum),
               `level`, `carry_trap` (the systematic error applies), `correct` (the demo's answer is);
    - `rl`:    prompt + `answer` (what the verifiers read), `level`, `carry_trap`;
    - `test`:  prompt + `answer` + `reference` (the correct scratchpad), `level`, `carry_trap`;
    - `prefs`: prompt + chosen + rejected (TRL's standard preference format), plus `answer`, `level`,
               `carry_trap`: an offline preference dataset from the demonstrator (preference_pairs).

    `tools` (embedded:arith_tools): the same problems and demonstrations, made conversational and
    given the calculator (with_tools); no `prefs`.
    """
    sizes = {**SPLIT_SIZES, **(sizes or {})}
    # the test split is the same for every seed (eval.py reads seed 0's), and no seed's training
    # splits hold one of its problems; seed 0 draws its training splits on from the test split's
    # generator (so seed 0's world is what it always was), another seed from its own
    rng = random.Random(0)
    capacity = sum(90 ** NUMBERS_PER_LEVEL[level] for level in levels)
    drawn = sizes["sft"] + sizes["rl"] + sizes["test"]  # prefs draw no problems of their own
    if drawn > capacity:
        raise ValueError(f"levels {levels} hold {capacity} distinct problems, fewer than the {drawn} asked for.")
    seen = set()  # every problem is unique, so the splits are disjoint

    def fresh_problem():
        while True:
            level = rng.choice(levels)
            numbers = tuple(rng.randint(10, 99) for _ in range(NUMBERS_PER_LEVEL[level]))
            if numbers not in seen:
                seen.add(numbers)
                return level, numbers

    test = []
    for _ in range(sizes["test"]):  # drawn first, so train sizes do not change the test split
        level, numbers = fresh_problem()
        test.append({**_row(level, numbers), "reference": scratchpad(numbers)[0]})
    if seed != 0:
        rng = random.Random(seed)
    sft, sft_problems = [], []
    for _ in range(sizes["sft"]):
        level, numbers = fresh_problem()
        text, written, _slipped = demonstrate(rng, numbers)
        sft.append({**_row(level, numbers), "completion": text, "correct": written == sum(numbers)})
        sft_problems.append((level, numbers))
    rl = [_row(*fresh_problem()) for _ in range(sizes["rl"])]
    from datasets import Dataset  # a slow import: not for --help

    if tools:
        sft, rl, test = with_tools(sft, rl, test, seed)
        return {"sft": Dataset.from_list(sft), "rl": Dataset.from_list(rl), "test": Dataset.from_list(test)}
    prefs = preference_pairs(sft_problems, sizes["prefs"], seed)
    return {"sft": Dataset.from_list(sft), "rl": Dataset.from_list(rl), "test": Dataset.from_list(test),
            "prefs": Dataset.from_list(prefs)}


def _row(level, numbers):
    """The columns every split's row has: the prompt, the true sum, the level, the carry trap."""
    return {"prompt": PROMPT_TEMPLATE.format(question="+".join(map(str, numbers))), "answer": sum(numbers),
            "level": level, "carry_trap": has_carry_trap(numbers)}


def preference_pairs(problems, size, seed):
    """The `prefs` split: what an offline preference dataset from the demonstrator is. For each
    (level, numbers) of `problems` in turn, draw fresh demonstrations until one is right and one
    wrong by the verifier (arith_strict's check: the answer written is the sum); chosen = the right
    one, rejected = the first wrong one; a problem with no pair in PREFS_DRAWS draws is skipped.
    Stops at `size` pairs (fewer if the problems run out).

    The problems are the SFT split's, with fresh demonstrations: an offline dataset is sampled from
    the demonstrator on the prompts it was collected for, and the SFT policy imitates the same
    demonstrator on the same prompts, so offline DPO starts on-distribution and any drift is the
    policy's own. It also keeps every problem outside the rl and test splits at every level (level
    1's 8100 problems leave 700 beside sft, rl and test: too few for fresh ones).
    What the pairs hold: on a problem without the carry trap the right demonstration is the correct
    scratchpad and the wrong one a slip (SLIP_PROB); on a trap problem the wrong one drops the carry
    and the right one is rare (a slip of +1 in the column after the dropped carry gives the true sum
    with a wrong step written, e.g. " 7+3=10 4+8=13 A: 130"), so many trap problems are skipped:
    the pairs mostly teach "no slips", and only some teach the carry.
    """
    rng = random.Random(seed + 104_729)  # its own stream, so the sft, rl and test splits are what they were
    pairs = []
    for level, numbers in problems:
        if len(pairs) == size:
            break
        right = wrong = None
        for _ in range(PREFS_DRAWS):
            text, written, _slipped = demonstrate(rng, numbers)
            if written == sum(numbers):
                right = right or text
            else:
                wrong = wrong or text
            if right and wrong:
                pairs.append({**_row(level, numbers), "chosen": right, "rejected": wrong})
                break
    return pairs


def tool_call_text(numbers):
    """The demonstrator's call: Qwen2.5's format (tools.parse_tool_calls), compact JSON."""
    arguments = dict(zip("ab", numbers))
    return "<tool_call>" + json.dumps({"name": "add", "arguments": arguments}, separators=(",", ":")) + "</tool_call>"


def tool_schemas():
    """The `tools` column's value: the calculator's JSON schema, as tools.load_tools and TRL build it."""
    from transformers.utils import get_json_schema

    from worlds import calculator

    return [get_json_schema(calculator.add)]


def with_tools(sft, rl, test, seed):
    """embedded:arith_tools from the plain rows (module docstring): prompts become one user message
    with the question; SFT rows get a `tools` column (the schemas, or None: no tool listed) and, where
    the demonstrator calls the tool, the exchange [call, tool reply, " A: <sum>"] as the completion.
    Its own random stream, so the problems and the scratchpads are those of embedded:arith."""
    if any(len(r["prompt"].split("+")) != 2 for r in test + sft + rl):
        raise ValueError(f"{TOOLS_SPEC} is level 1 (two numbers): the calculator adds two.")
    rng, schemas = random.Random(seed + 7_919), tool_schemas()

    def conversation(r):
        return [{"role": "user", "content": r["prompt"][len("Q: "):-1]}]

    out_sft = []
    for r in sft:
        listed = rng.random() < LIST_PROB
        calls = listed and rng.random() < CALL_PROB
        completion = [{"role": "assistant", "content": r["completion"]}]
        if calls:
            numbers = tuple(map(int, r["prompt"][len("Q: "):-1].split("+")))
            completion = [{"role": "assistant", "content": tool_call_text(numbers)},
                          {"role": "tool", "name": "add", "content": str(sum(numbers))},
                          {"role": "assistant", "content": f" A: {sum(numbers)}"}]
        out_sft.append({**r, "prompt": conversation(r), "completion": completion, "tools": schemas if listed else None,
                        "correct": True if calls else r["correct"]})
    return (out_sft, [{**r, "prompt": conversation(r)} for r in rl],
            [{**r, "prompt": conversation(r)} for r in test])


def world_stats(world):
    """What the demonstrations are worth: their accuracy, the share of problems with the carry
    trap, and the accuracy of an imitator that learns the demonstrator's most likely output."""
    sft, test = world["sft"], world["test"]
    trap = sum(test["carry_trap"]) / len(test)
    return {"demo_accuracy": sum(sft["correct"]) / len(sft), "carry_trap_frac": trap, "imitator_accuracy": 1 - trap}
