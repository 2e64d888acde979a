"""The code world (world_code.py): tasks, the demonstrator's errors, disjoint splits; the execution
verifier end to end on it, and on a foreign model with a user's JSONL tests column."""

import json
import os

import pytest
from conftest import run_main

import common
from rlhf import sandbox
from worlds import world_code as wc


def test_a_task_by_hand():
    fn = eval("lambda x: x*4+3")
    assert wc.prompt_of(fn) == "f(0)=3 f(1)=7 f(2)=11 f(3)=15 f(4)=19\n"
    assert wc.tests_of("x*4+3") == ["assert f(-7) == -25", "assert f(5) == 23", "assert f(9) == 39",
                                    "assert f(31) == 127", "assert f(1000) == 4003"]
    assert wc.completion_of("x*4+3") == "def f(x): return x*4+3"
    # the systematic error: the kink of abs(x-9) is beyond the visible inputs, so it writes 9-x
    assert wc.is_trap("abs", {"a": 9}) and not wc.is_trap("abs", {"a": 3})

    class Draws:  # rng.random() gives these in turn: first the slip, then (on a trap) the error
        def __init__(self, *values):
            self.values = list(values)

        def random(self):
            return self.values.pop(0)

    assert wc.demonstrate(Draws(1.0, 0.0), "abs", {"a": 9}) == ("9-x", False)  # draw < TRAP_ERROR_PROB: errs
    assert wc.demonstrate(Draws(1.0, wc.TRAP_ERROR_PROB), "abs", {"a": 9}) == ("abs(x-9)", False)  # else right
    assert wc.demonstrate(Draws(1.0), "abs", {"a": 3}) == ("abs(x-3)", False)  # no trap: no second draw
    assert wc.prompt_of(eval("lambda x: 9-x")) == wc.prompt_of(eval("lambda x: abs(x-9)"))  # the examples agree
    assert not wc.passes("9-x", wc.tests_of("abs(x-9)")) and wc.passes("abs(x-9)", wc.tests_of("abs(x-9)"))


@pytest.fixture(scope="module")
def world():
    return wc.build_world(seed=3)


def test_demonstrator_errors_and_headroom(world):
    sft = world["sft"]
    stats = wc.world_stats(world)
    # 1/6 of the tasks are abs traps, where the demonstrator writes a-x 70% of the time; 20% of
    # demonstrations slip: about (5/6 + 1/6 * 0.3) * 0.8 = 71% pass all their tests (module docstring)
    assert wc.TRAP_ERROR_PROB == 0.7 and wc.SLIP_PROB == 0.2
    assert 0.65 < stats["demo_pass_rate"] < 0.77
    assert 0.11 < stats["abs_trap_frac"] < 0.23
    assert stats["imitator_pass_rate"] == pytest.approx(1 - stats["abs_trap_frac"])
    plain = [r for r in sft if not r["abs_trap"]]
    slips = sum(not r["correct"] for r in plain) / len(plain)
    assert 0.15 < slips < 0.25  # a slip always breaks a test (HIDDEN_INPUTS tell constants apart)
    traps = [r for r in sft if r["abs_trap"]]
    minus_x = [r for r in traps if r["completion"].endswith("-x")]
    assert 0.58 < len(minus_x) / len(traps) < 0.82  # the systematic error, on 70% of the traps
    assert not any(r["correct"] for r in minus_x)
    right = [r for r in traps if r["completion"].startswith("def f(x): return abs(x-")]
    assert len(right) + len(minus_x) == len(traps)
    assert 0.15 < sum(r["correct"] for r in right) / len(traps) < 0.33  # 30%, less the slips: the headroom shows
    unslipped = [r for r in minus_x if r["completion"] == f"def f(x): return {r['prompt'].split('=')[1].split()[0]}-x"]
    assert len(unslipped) > 0.7 * len(minus_x)  # a-x with a = f(0), unless it slipped
    # the sandbox agrees with the direct check: references pass everything, a trap's a-x passes the tests below a
    test = world["test"].select(range(40))
    assert sandbox.exec_tests(test["prompt"], test["reference"], tests=test["tests"]) == [1.0] * 40
    rows = unslipped[:10]
    a = [int(r["prompt"].split("=")[1].split()[0]) for r in rows]  # passes the tests at inputs up to a
    assert sandbox.exec_tests(None, [r["completion"] for r in rows], tests=[r["tests"] for r in rows]) == \
        [sum(x <= k for x in wc.HIDDEN_INPUTS) / 5 for k in a]


def test_splits_are_disjoint_and_deterministic(world):
    prompts = {name: set(ds["prompt"]) for name, ds in world.items()}
    assert all(len(prompts[n]) == len(world[n]) for n in prompts)  # no repeats within a split
    assert not prompts["test"] & prompts["sft"] and not prompts["test"] & prompts["rl"] and not prompts["sft"] & prompts["rl"]
    tests = {name: {tuple(t) for t in ds["tests"]} for name, ds in world.items()}  # the functions, too
    assert not tests["test"] & tests["sft"] and not tests["test"] & tests["rl"] and not tests["sft"] & tests["rl"]
    again = wc.build_world(seed=3, sizes={"sft": 10, "rl": 10})
    assert again["test"].to_list() == world["test"].to_list()  # train sizes leave the test split alone
    other = wc.build_world(seed=4, sizes={"sft": 300, "rl": 300})  # another training seed:
    assert other["test"].to_list() == world["test"].to_list() == wc.build_world(seed=0)["test"].to_list()  # same test split,
    assert other["rl"]["prompt"] != world["rl"]["prompt"][:300]  # other training splits,
    assert not tests["test"] & {tuple(t) for t in list(other["sft"]["tests"]) + list(other["rl"]["tests"])}  # never a test function
    assert set(world["sft"].column_names) >= {"prompt", "completion", "tests", "abs_trap"}
    assert set(world["rl"].column_names) >= {"prompt", "tests"} and "completion" not in world["rl"].column_names
    assert set(world["test"].column_names) >= {"prompt", "tests", "reference"}
    sft_chars = set("".join(world["sft"]["prompt"]) + "".join(world["sft"]["completion"]))
    assert set("".join(world["test"]["prompt"]) + "".join(world["rl"]["prompt"])) <= sft_chars  # a char tokenizer fitted on sft reads all
    assert {r["family"] for r in world["test"]} == set(wc.FAMILIES)
    with pytest.raises(ValueError):
        wc.build_world(sizes={"sft": 5000})  # more than the smallest family holds


def test_sft_grpo_eval_on_the_code_world(tmp_path, monkeypatch):
    import eval as eval_script
    import grpo
    import sft

    sft_dir, grpo_dir = str(tmp_path / "sft_code"), str(tmp_path / "grpo_code")
    run_main(sft, ["--dataset", "embedded:code", "--hidden_size", "32", "--num_layers", "1", "--max_steps", "2",
                   "--batch_size", "8", "--output_dir", sft_dir], monkeypatch)
    assert len(common.load_tokenizer(sft_dir)) == 3 + 32  # special tokens + the world's characters
    run_main(grpo, ["--model", sft_dir, "--dataset", "embedded:code", "--reward_fn", "exec_tests", "--max_steps", "2",
                    "--batch_size", "2", "--num_generations", "2", "--output_dir", grpo_dir], monkeypatch)
    rows = [json.loads(line) for line in open(os.path.join(grpo_dir, "metrics.jsonl"))]
    assert len(rows) == 2 and all(0 <= r["rewards/exec_tests/mean"] <= 1 for r in rows)
    run_main(eval_script, [sft_dir, grpo_dir, "--dataset", "embedded:code", "--reward_fn", "exec_tests_strict",
                           "--num_prompts", "4", "--num_samples", "2", "--pass_k", "1,2", "--group_by", "abs_trap",
                           "--num_bootstrap", "20", "--output_dir", str(tmp_path / "eval"),
                           "--cache_dir", str(tmp_path / "cache")], monkeypatch)
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["settings"]["judge_name"] == "exec_tests_strict" and results["reference"]["score"] == 1.0
    assert set(results["policies"]["grpo_code"]["pass_at_k"]) == {"pass@1", "pass@2"}


def test_a_foreign_model_trains_on_a_user_tests_column(tmp_path, tiny_llama, monkeypatch):
    """A Llama-shaped model with a chat template, a user's JSONL with conversational prompts and
    a `tests` column, --reward_fn exec_tests: no user code."""
    path = tmp_path / "code.jsonl"
    with open(path, "w") as f:
        for k in range(4):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"write f that adds {k}"}],
                                "tests": [f"assert f(1) == {1 + k}", "assert f(0) == 0" if k == 0 else f"assert f(0) == {k}"]}) + "\n")
    out = str(tmp_path / "grpo_llama_code")
    run_main(__import__("grpo"), ["--model", tiny_llama, "--dataset", str(path), "--reward_fn", "exec_tests",
                                  "--max_steps", "2", "--batch_size", "2", "--num_generations", "2",
                                  "--max_completion_length", "6", "--output_dir", out], monkeypatch)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2] and all(r["rewards/exec_tests/mean"] == 0.0 for r in rows)  # words are not code
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "llama"
