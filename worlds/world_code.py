"""The code world: a seeded, synthetic programming task whose reward comes from running the code.

The third embedded world (`--dataset embedded:code`), beside the summarization one (world.py) and
the arithmetic one (world_arith.py). It plays the part of a code dataset with unit tests
(MBPP-like: a task, a solution, hidden asserts), small enough for a from-scratch model on a CPU:

- a **task** shows a function f on the inputs 0..4 and asks for its code:
      f(0)=3 f(1)=7 f(2)=11 f(3)=15 f(4)=19\\n   ->   "def f(x): return x*4+3"
  f is one expression of a small grammar, one FAMILIES template with its constants:
  `x*a+b`, `x*a-b`, `x//a+b`, `x%a*b`, `x*x+b`, `abs(x-a)`; a family is drawn uniformly, then
  its constants (each family holds enough functions for every split);
- the **hidden tests** are asserts on other inputs, HIDDEN_INPUTS (negative, larger, beyond every
  constant): `["assert f(-7) == -25", ...]`, in the `tests` column that sandbox.exec_tests reads;
- **demonstrations** come from a noisy demonstrator with two kinds of error:
  * one *systematic* error: it fits the visible examples only, most of the time. For
    `abs(x-a)` with a >= 4 (the `abs_trap` tasks, about 1/6 of all) the examples
    f(0..4) = a, a-1, ..., a-4 never show the kink, and on TRAP_ERROR_PROB = 0.7 of them it
    writes `a-x` ("def f(x): return 9-x" for abs(x-9)): right on every input up to a, wrong
    above it (HIDDEN_INPUTS holds 1000, above every a, so it never passes all tests; it passes
    1 to 4 of 5). On the other 30% it writes the correct abs(x-a);
  * random *slips*: with probability SLIP_PROB = 0.2 one constant is off by one (noise, which
    an imitator averages away);
  so about (5/6 + 1/6 x 0.3) x 0.8 = 71% of demonstrations pass all their tests. The headroom
  this leaves: a perfect imitator of the demonstrator's most likely output (a-x on a trap)
  solves the ~83% of tasks that are not abs traps; one that samples the demonstrator's
  distribution writes abs(x-a) on 30% of the traps, so a policy trained from it samples the
  right code on those tasks often enough for an execution reward to reinforce it, up to 100%
  (docs/worlds.md, the code world's results: the SFT policy writes abs( in 18% of its samples on the
  test split's traps, GRPO in 43% to 68%);
  before, the demonstrator always erred on a trap: abs(...) was shown only for a <= 3, about 1
  demonstration in 1000, never sampled, so no reward could fix the error.

The splits `sft` / `rl` / `test` hold disjoint functions (so disjoint prompts). The test split is
the same for every seed and the training splits, which change with the seed, never hold one of
its functions (so GRPO over training seeds 0, 1, 2 never trains on a test task). Every text uses
the same few characters, so the world trains sft.py's character-level from-scratch Qwen2
(scratch.py), as the arithmetic world does. Completions are plain code, not fenced (the
verifier takes both).
"""

import random


SPEC = "embedded:code"  # --dataset value
VISIBLE_INPUTS = (0, 1, 2, 3, 4)  # shown in the prompt
HIDDEN_INPUTS = (-7, 5, 9, 31, 1000)  # the tests: the same function elsewhere (1000 > every constant)
SLIP_PROB = 0.2  # chance that a demonstration has one constant off by one
TRAP_MIN = 4  # abs(x-a) with a >= TRAP_MIN looks like a-x on the visible inputs
TRAP_ERROR_PROB = 0.7  # share of abs-trap tasks on which the demonstrator writes a-x (else abs(x-a))
# family -> (template, {constant: range}); each holds at least 447 functions
FAMILIES = {
    "affine": ("x*{a}+{b}", {"a": range(2, 10), "b": range(0, 100)}),
    "affine_minus": ("x*{a}-{b}", {"a": range(2, 10), "b": range(1, 100)}),
    "floordiv": ("x//{a}+{b}", {"a": range(2, 5), "b": range(0, 150)}),  # a <= 4: the step shows in f(0..4)
    "mod": ("x%{a}*{b}", {"a": range(2, 5), "b": range(1, 150)}),  # a <= 4: the period shows
    "square": ("x*x+{b}", {"b": range(0, 450)}),
    "abs": ("abs(x-{a})", {"a": range(1, 450)}),
}
SPLIT_SIZES = {"sft": 1000, "rl": 400, "test": 200}  # functions per split, ~267 of each family in all


# ---------------------------------------------------------------- tasks
def expression(family, constants):
    return FAMILIES[family][0].format(**constants)


def prompt_of(fn):
    return " ".join(f"f({x})={fn(x)}" for x in VISIBLE_INPUTS) + "\n"


def completion_of(expr):
    return f"def f(x): return {expr}"


def tests_of(expr):
    fn = eval(f"lambda x: {expr}")  # noqa: S307 -- our own grammar's expression, not model output
    return [f"assert f({x}) == {fn(x)}" for x in HIDDEN_INPUTS]


def is_trap(family, constants):
    """Whether the demonstrator's systematic error can apply (an abs kink beyond the visible inputs)."""
    return family == "abs" and constants["a"] >= TRAP_MIN


def demonstrate(rng, family, constants):
    """The noisy demonstrator's expression: (text, slipped)."""
    constants = dict(constants)
    slipped = rng.random() < SLIP_PROB
    if slipped:  # one constant off by one, kept in its range
        name = rng.choice(sorted(constants))
        allowed = FAMILIES[family][1][name]
        delta = rng.choice([-1, 1])
        constants[name] += delta if constants[name] + delta in allowed else -delta
    if is_trap(family, constants) and rng.random() < TRAP_ERROR_PROB:
        return f"{constants['a']}-x", slipped  # fits f(0..4), misses the kink
    return expression(family, constants), slipped


def passes(expr, tests):
    """Whether `expr` (trusted: ours) passes the tests, computed directly (no sandbox)."""
    fn = eval(f"lambda x: {expr}")  # noqa: S307
    return all(eval(t[len("assert "):], {"f": fn}) for t in tests)  # noqa: S307


# ---------------------------------------------------------------- datasets
def build_world(seed=0, sizes=None):
    """The world's splits as `datasets.Dataset`s in TRL's formats, every function in one split only.

    - `sft`:  prompt + completion (the noisy demonstrator), plus `tests`, `family`, `abs_trap`
              (the systematic error can apply), `correct` (the demonstration passes all tests);
    - `rl`:   prompt + `tests` (what sandbox.exec_tests reads), `family`, `abs_trap`;
    - `test`: prompt + `tests` + `reference` (the correct code), `family`, `abs_trap`.
    """
    sizes = {**SPLIT_SIZES, **(sizes or {})}
    # the test split is the same for every seed (eval.py reads seed 0's); the training splits change
    # with the seed (seed 0 draws them on from the test split's generator)
    test_rng = random.Random(0)
    rng = test_rng if seed == 0 else random.Random(seed)
    names = sorted(FAMILIES)
    seen = set()  # every function is unique, so the splits are disjoint
    for family in names:  # enough functions for a uniform draw of every family (with margin)
        capacity = 1
        for values in FAMILIES[family][1].values():
            capacity *= len(values)
        if capacity < 1.25 * sum(sizes.values()) / len(names):
            raise ValueError(f"family {family} holds {capacity} functions, too few for {sum(sizes.values())} tasks.")

    def fresh_task(rng):
        while True:
            family = rng.choice(names)
            constants = {k: rng.choice(v) for k, v in sorted(FAMILIES[family][1].items())}
            expr = expression(family, constants)
            if expr not in seen:
                seen.add(expr)
                return family, constants, expr

    def row(family, constants, expr):
        fn = eval(f"lambda x: {expr}")  # noqa: S307
        return {"prompt": prompt_of(fn), "tests": tests_of(expr), "family": family,
                "abs_trap": is_trap(family, constants)}

    test = []
    for _ in range(sizes["test"]):  # drawn first, so train sizes do not change the test split
        family, constants, expr = fresh_task(test_rng)
        test.append({**row(family, constants, expr), "reference": completion_of(expr)})
    sft = []
    for _ in range(sizes["sft"]):
        family, constants, expr = fresh_task(rng)
        r = row(family, constants, expr)
        written, _slipped = demonstrate(rng, family, constants)
        sft.append({**r, "completion": completion_of(written), "correct": passes(written, r["tests"])})
    rl = [row(*fresh_task(rng)) for _ in range(sizes["rl"])]
    from datasets import Dataset  # a slow import: not for --help

    return {"sft": Dataset.from_list(sft), "rl": Dataset.from_list(rl), "test": Dataset.from_list(test)}


def world_stats(world):
    """What the demonstrations are worth: their pass rate, the share of abs-trap tasks, and the
    pass rate of an imitator that writes the demonstrator's most likely output (a-x on a trap)."""
    sft, test = world["sft"], world["test"]
    trap = sum(test["abs_trap"]) / len(test)
    return {"demo_pass_rate": sum(sft["correct"]) / len(sft), "abs_trap_frac": trap, "imitator_pass_rate": 1 - trap}
