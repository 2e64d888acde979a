"""Reasoning Gym's procedural tasks as datasets and verifiers (`--dataset reasoning_gym:TASK`,
`--reward_fn reasoning_gym`), for RLVR on the tasks and checkers the field shares.

Reasoning Gym (`pip install reasoning-gym`) generates each task's questions from a seed and
scores an answer with the task's own `score_answer(answer, entry)`. Here a task becomes a dataset
in TRL's prompt-only format:

    --dataset reasoning_gym:chain_sum                              the task with its default config
    --dataset reasoning_gym:chain_sum:min_terms=2,max_terms=2,size=500,seed=3

Options after the task's name are its config (values read as JSON: numbers, true/false, lists;
otherwise strings), besides `size` (training prompts, TRAIN_SIZE), `seed` (the training prompts'
seed; default: the script's --seed), `test_size` (TEST_SIZE) and `test_seed` (TEST_SEED). The
`test` split, what --eval_dataset and eval.py read, is drawn with TEST_SEED, the same for every
training seed, and the training split drops every question the test split holds, so the two are
disjoint in prompts and not only in seeds.

Each row: `prompt` (EXAMPLE, one question on no task's subject answered in the format, then the
user turn: the question and FORMAT, the answer format), `answer` (the
task's reference answer), `entry` (the task's whole entry as JSON, what score_answer reads),
`task`. The model must answer inside <answer>...</answer>: `extract_answer` takes the last such
span, in training (the verifiers) and in eval.py alike, and a completion without one scores 0.

Verifiers: `reasoning_gym` (score_answer's value, which some tasks make partial credit: a
training reward) and `reasoning_gym_strict` (1 when score_answer gives 1.0, else 0: an accuracy,
what eval.py's pass@k needs).
"""

import functools
import json
import re

SPEC = "reasoning_gym:"  # --dataset prefix
REWARD_NAME = "reasoning_gym"  # --reward_fn names
STRICT_NAME = "reasoning_gym_strict"
TRAIN_SIZE = 1000
TEST_SIZE = 200
TEST_SEED = 1_000_003  # the test split's seed: no training seed a sweep uses
INSTALL = "pip install -r requirements-tasks.txt"
# the answer format, stated in every prompt (Reasoning Gym's own examples ask for the same tags)
FORMAT = "Give your final answer inside <answer></answer> tags, for example <answer>your answer</answer>."
# one worked turn before the question, on no task's subject: SmolLM2-135M-Instruct, told the format
# alone, tagged none of 16 chain_sum answers; after this turn, all 16
EXAMPLE = [{"role": "user", "content": f"What is the capital of France?\n\n{FORMAT}"},
           {"role": "assistant", "content": "<answer>Paris</answer>"}]
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_OPTIONS = ("size", "seed", "test_size", "test_seed")


def _require():
    """The reasoning_gym package, or a one-sentence error naming the command that installs it."""
    try:
        import reasoning_gym
    except ImportError:
        raise SystemExit(f"error: reasoning_gym:TASK and --reward_fn reasoning_gym need the reasoning-gym package: {INSTALL}.")
    return reasoning_gym


def extract_answer(text):
    """The model's answer: the text of the last <answer>...</answer> span, stripped; None without one
    (a truncated or untagged completion). Training's verifiers and eval.py both read answers with it."""
    spans = _ANSWER.findall(text)
    return spans[-1].strip() if spans else None


def _value(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_spec(spec):
    """`reasoning_gym:TASK[:key=value,...]` -> (task, config, options {size, seed, test_size, test_seed})."""
    task, _, rest = spec[len(SPEC):].partition(":")
    config, options = {}, {}
    for item in [s for s in rest.split(",") if s]:
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise SystemExit(f"error: --dataset {spec}: {item!r} is not key=value; write options as "
                             "reasoning_gym:TASK:key=value,key=value (e.g. reasoning_gym:chain_sum:min_terms=2,size=500).")
        (options if key in _OPTIONS else config)[key] = _value(value)
    if not task:
        raise SystemExit(f"error: --dataset {spec}: name a task, e.g. reasoning_gym:chain_sum.")
    return task, config, options


def _text(completion):
    """A completion's text: a string as it is; of TRL's messages, the last assistant turn's content."""
    if isinstance(completion, str):
        return completion
    return next((m["content"] for m in reversed(completion) if m["role"] == "assistant"), "")


@functools.lru_cache(maxsize=None)
def _scorer(task):
    return _require().get_score_answer_fn(task)


def score(text, entry):
    """score_answer of the answer extracted from `text` (0.0 without one) on the row's entry (its JSON)."""
    entry = json.loads(entry) if isinstance(entry, str) else entry
    answer = extract_answer(text)
    if answer is None:
        return 0.0
    return float(_scorer(entry["metadata"]["source_dataset"])(answer, entry))


def reasoning_gym(prompts, completions, entry, **columns):
    """The task's own score_answer on the answer inside <answer></answer> (0.0 without one)."""
    return [score(_text(c), e) for c, e in zip(completions, entry)]


def reasoning_gym_strict(prompts, completions, entry, **columns):
    """1.0 when the task's score_answer gives the extracted answer full marks, else 0.0."""
    return [float(score(_text(c), e) == 1.0) for c, e in zip(completions, entry)]


VERIFIERS = {REWARD_NAME: reasoning_gym, STRICT_NAME: reasoning_gym_strict}


def _rows(task, config, size, seed, spec):
    rg = _require()
    try:
        ds = rg.create_dataset(task, size=size, seed=seed, **config)
    except (ValueError, TypeError, AssertionError) as e:
        raise SystemExit(f"error: --dataset {spec}: Reasoning Gym cannot make {task!r} with {config or 'its default config'} "
                         f"({type(e).__name__}: {str(e)[:200]}); check the task's name and its config's fields.")
    return [dict(entry) for entry in ds]


def build_split(spec, split, seed=0):
    """The rows of a split of `reasoning_gym:TASK[:options]` (module docstring) as a datasets.Dataset:
    `test` (test_size rows of test_seed), `rl` (size rows of seed, minus the test split's questions),
    `sft` (those rows with the reference answer in the format as the completion)."""
    task, config, options = parse_spec(spec)
    if split == "prefs":
        raise SystemExit(f"error: --dataset {spec} has no preference pairs; train on it with grpo.py, ppo.py or dpo.py --online.")
    test = _rows(task, config, int(options.get("test_size", TEST_SIZE)), int(options.get("test_seed", TEST_SEED)), spec)
    if split == "test":
        entries = test
    else:
        seen = {e["question"] for e in test}
        entries = [e for e in _rows(task, config, int(options.get("size", TRAIN_SIZE)), int(options.get("seed", seed)), spec)
                   if e["question"] not in seen]
        if not entries:
            raise SystemExit(f"error: --dataset {spec}: every training question is also a test question; widen the task's config.")
    rows = []
    for e in entries:
        row = {"prompt": EXAMPLE + [{"role": "user", "content": f"{e['question']}\n\n{FORMAT}"}], "answer": str(e["answer"]),
               "entry": json.dumps(e, default=str), "task": task}
        if split == "sft":
            row["completion"] = [{"role": "assistant", "content": f"<answer>{e['answer']}</answer>"}]
        rows.append(row)
    from datasets import Dataset  # a slow import: not for --help

    return Dataset.from_list(rows)
