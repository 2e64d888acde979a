"""The arithmetic world: the scratchpad, the demonstrator's errors, disjoint splits, the preference
pairs and offline DPO on them, the verifiers."""

import json

import pytest

import common
from worlds import world_arith as wa
from worlds.world_arith import arith_lenient, arith_strict


def test_scratchpad_by_hand():
    assert wa.scratchpad((47, 85)) == (" 7+5=12 4+8+1=13 A: 132", 132)
    assert wa.scratchpad((12, 34)) == (" 2+4=6 1+3=4 A: 46", 46)
    assert wa.scratchpad((47, 85, 23)) == (" 7+5=12 4+8+1=13 =132 2+3=5 3+2=5 1+0=1 A: 155", 155)
    # the systematic error: a units sum of 10 or 11 carries nothing; 12 still carries
    assert wa.scratchpad((47, 83), drop_carry=True) == (" 7+3=10 4+8=12 A: 120", 120)
    assert wa.scratchpad((47, 84), drop_carry=True) == (" 7+4=11 4+8=12 A: 121", 121)
    assert wa.scratchpad((47, 85), drop_carry=True) == wa.scratchpad((47, 85))
    # a slip: one column off by one, the rest follows from it
    assert wa.scratchpad((47, 85), slip=(0, 1, -1)) == (" 7+5=12 4+8+1=12 A: 122", 122)
    assert wa.has_carry_trap((47, 83)) and not wa.has_carry_trap((47, 85))
    assert wa.has_carry_trap((41, 15, 14))  # the chain's second step: 56 + 14, units 6 + 4 = 10
    assert not wa.has_carry_trap((41, 15, 16))


@pytest.fixture(scope="module")
def small_world():
    return wa.build_world(seed=3, sizes={"sft": 2000, "rl": 300, "test": 200})


def test_demonstrator_errors_and_headroom(small_world):
    sft = small_world["sft"]
    for row in sft:
        written = wa.strict_answer(row["completion"])
        assert row["correct"] == (written == row["answer"])
        if row["carry_trap"] and written == row["answer"]:  # only a compensating slip can fix a trap
            assert row["completion"] != wa.scratchpad(tuple(map(int, row["prompt"][3:-1].split("+"))), drop_carry=True)[0]
    stats = wa.world_stats(small_world)
    # 17% of level-1 problems have the trap, 20% of demonstrations slip: about 0.83 * 0.8 right
    assert 0.60 < stats["demo_accuracy"] < 0.72
    assert 0.12 < stats["carry_trap_frac"] < 0.23
    assert stats["imitator_accuracy"] == pytest.approx(1 - stats["carry_trap_frac"])
    for row in small_world["test"]:  # references are right, and each test row names its true sum
        assert arith_strict([row["prompt"]], [row["reference"]], answer=[row["answer"]]) == [1.0]
        assert row["answer"] == sum(map(int, row["prompt"][3:-1].split("+")))


def test_splits_are_disjoint_and_deterministic(small_world):
    prompts = {name: set(ds["prompt"]) for name, ds in small_world.items()}
    assert all(len(prompts[n]) == len(small_world[n]) for n in prompts)  # no repeats within a split
    assert not prompts["test"] & prompts["sft"] and not prompts["test"] & prompts["rl"] and not prompts["sft"] & prompts["rl"]
    again = wa.build_world(seed=3, sizes={"sft": 10, "rl": 10, "test": 200})
    assert again["test"].to_list() == small_world["test"].to_list()  # train sizes leave the test split alone
    assert set(small_world["sft"].column_names) >= {"prompt", "completion", "answer"}
    assert set(small_world["rl"].column_names) >= {"prompt", "answer"} and "completion" not in small_world["rl"].column_names
    assert set(small_world["test"].column_names) >= {"prompt", "answer", "reference"}
    chains = wa.build_world(seed=0, levels=(1, 2), sizes={"sft": 50, "rl": 5, "test": 50})
    assert set(chains["test"]["level"]) == {1, 2}
    assert all(r["prompt"].count("+") == r["level"] for r in chains["test"])
    with pytest.raises(ValueError):
        wa.build_world(sizes={"sft": 9000})  # more than the 8100 level-1 problems


def test_one_test_split_for_every_seed_and_no_seed_trains_on_it():
    """eval.py reads seed 0's test split; GRPO seeds 1 and 2 once trained on a quarter of it."""
    sizes = {"sft": 3000, "rl": 1500, "test": 400}
    worlds = {s: wa.build_world(seed=s, sizes=sizes) for s in (0, 1, 2)}
    test = worlds[0]["test"].to_list()
    for s, world in worlds.items():
        assert world["test"].to_list() == test
        assert not set(world["sft"]["prompt"]) & {r["prompt"] for r in test}
        assert not set(world["rl"]["prompt"]) & {r["prompt"] for r in test}
        assert len(world["prefs"]) == 2000 and not set(world["prefs"]["prompt"]) & {r["prompt"] for r in test}
    assert worlds[1]["rl"]["prompt"] != worlds[0]["rl"]["prompt"]  # the training splits still change with the seed
    # seed 0's world is the one every published number was measured on
    import hashlib
    digest = hashlib.md5("".join(list(worlds[0]["sft"]["prompt"]) + list(worlds[0]["rl"]["prompt"])).encode()).hexdigest()
    assert digest == "4e3b939adc009df9ce4cd3d38859e1c2"  # md5 before the test split was shared


def test_level_3_four_number_chains():
    """Four numbers: three steps, an intermediate total after each but the last; the demonstrator's
    errors and the verifier as at levels 1 and 2; the texts fit the 16 characters and 81 positions."""
    assert wa.scratchpad((47, 85, 23, 61)) == (
        " 7+5=12 4+8+1=13 =132 2+3=5 3+2=5 1+0=1 =155 5+1=6 5+6=11 1+0+1=2 A: 216", 216)
    assert wa.has_carry_trap((41, 15, 16, 18)) and not wa.has_carry_trap((41, 15, 16, 15))  # the third step: 72 + 18
    longest = wa.scratchpad((99, 99, 99, 99))[0]  # a carry in every column, two hundreds columns
    assert len(longest) == 81
    world = wa.build_world(seed=0, levels=(1, 2, 3), sizes={"sft": 300, "rl": 10, "test": 60, "prefs": 100})
    assert set(world["test"]["level"]) == {1, 2, 3} and all(r["prompt"].count("+") == r["level"] for r in world["test"])
    texts = [r["prompt"] + r["completion"] for r in world["sft"]] + [r["prompt"] + r["reference"] for r in world["test"]]
    assert len(set("".join(texts))) == 16
    assert max(len(r["completion"]) for r in world["sft"]) <= len(longest)
    for row in world["sft"]:
        assert row["correct"] == (wa.strict_answer(row["completion"]) == row["answer"])


def test_prefs_are_the_demonstrators_pairs_labelled_by_the_verifier():
    """TRL's standard preference format; chosen right and rejected wrong by arith_strict; both the
    demonstrator's (a slip against the right scratchpad, or the dropped carry); the SFT split's
    problems, never an rl or test one; the carry trap is rarer than in the SFT split (few trap
    problems have a right demonstration)."""
    world = wa.build_world(seed=0, levels=(1, 2), sizes={"sft": 1500, "rl": 200, "test": 200, "prefs": 1000})
    prefs, sft = world["prefs"], world["sft"]
    assert len(prefs) == 1000 and set(prefs.column_names) == {"prompt", "chosen", "rejected", "answer", "level", "carry_trap"}
    assert all(isinstance(r[k], str) and r[k] for r in prefs for k in ("prompt", "chosen", "rejected"))
    assert arith_strict(prefs["prompt"], prefs["chosen"], prefs["answer"]) == [1.0] * len(prefs)
    assert arith_strict(prefs["prompt"], prefs["rejected"], prefs["answer"]) == [0.0] * len(prefs)
    assert set(prefs["prompt"]) <= set(sft["prompt"]) and len(set(prefs["prompt"])) == len(prefs)
    assert not set(prefs["prompt"]) & (set(world["rl"]["prompt"]) | set(world["test"]["prompt"]))
    pure_trap = 0
    for r in prefs:
        numbers = tuple(map(int, r["prompt"][3:-1].split("+")))
        assert r["answer"] == sum(numbers) and r["carry_trap"] == wa.has_carry_trap(numbers)
        if not r["carry_trap"]:  # the right demonstration is the scratchpad, the wrong one a slip
            assert r["chosen"] == wa.scratchpad(numbers)[0]
        pure_trap += r["rejected"] == wa.scratchpad(numbers, drop_carry=True)[0]
    assert 0 < pure_trap <= sum(prefs["carry_trap"]) < 0.8 * len(prefs) * sum(sft["carry_trap"]) / len(sft)
    # its own stream: the other splits are those of a world without it, and the pairs change with the seed
    bare = wa.build_world(seed=0, levels=(1, 2), sizes={"sft": 1500, "rl": 200, "test": 200, "prefs": 0})
    assert len(bare["prefs"]) == 0 and all(bare[k].to_list() == world[k].to_list() for k in ("sft", "rl", "test"))
    other = wa.build_world(seed=1, levels=(1, 2), sizes={"sft": 1500, "rl": 200, "test": 200, "prefs": 1000})["prefs"]
    assert other["prompt"] != prefs["prompt"]


def test_offline_dpo_on_the_arithmetic_world(tmp_path, monkeypatch, capsys):
    """dpo.py --dataset embedded:arith trains on the prefs split, as plain DPO (no RPO term: the
    summarization world's default), from a tiny char-level policy of the world."""
    from conftest import run_main

    import dpo
    from worlds import scratch

    sft = wa.build_world(seed=0, sizes={"sft": 200, "rl": 1, "test": 1, "prefs": 0})["sft"]
    tok = scratch.fit_tokenizer([r["prompt"] + r["completion"] for r in sft], "char")
    scratch.build_model(tok, hidden_size=32, num_layers=1).save_pretrained(tmp_path / "sft")
    tok.save_pretrained(tmp_path / "sft")
    out = tmp_path / "dpo"
    run_main(dpo, ["--model", str(tmp_path / "sft"), "--dataset", "embedded:arith", "--max_steps", "2", "--batch_size", "4",
                   "--eval_batch_size", "500", "--output_dir", str(out)], monkeypatch)
    stdout = capsys.readouterr().out
    assert "rpo_alpha 0" in stdout and "2000 preference pairs from embedded:arith" in stdout
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert rows[0]["loss"] == pytest.approx(0.6931, abs=1e-3) and "nll_loss" not in rows[0]  # DPO at step 0: ln 2
    assert json.load(open(out / "summary.json"))["completions_truncated"] == 0


def test_parse_spec():
    assert wa.parse_spec("embedded:arith") == (1,)
    assert wa.parse_spec("embedded:arith:2") == (2,)
    assert wa.parse_spec("embedded:arith:2,1") == (1, 2)
    assert wa.parse_spec("embedded:arith:3") == (3,) and wa.parse_spec("embedded:arith:1,2,3") == (1, 2, 3)
    assert wa.parse_spec("embedded") is None and wa.parse_spec("data.jsonl") is None
    for bad in ("embedded:arith:4", "embedded:arith:0", "embedded:arith:x"):
        with pytest.raises(ValueError):
            wa.parse_spec(bad)


STRICT_CASES = [  # (completion, reward) for the problem 47 + 85 = 132
    (" 7+5=12 4+8+1=13 A: 132", 1.0),
    (" A: 132", 1.0),
    ("A:132", 1.0),
    (" A: 132 \n", 1.0),                 # trailing whitespace is fine
    (" 7+5=12 4+8=12 A: 122", 0.0),      # wrong answer
    (" 7+5=12 4+8+1=13 132", 0.0),       # no "A:"
    (" 7+5=12 4+8+1=13 A: 132 A: 133", 0.0),  # the last "A:" counts
    (" A: 133 A: 132", 1.0),
    (" A: 132.", 0.0),                   # anything after the number
    (" A: 132 because", 0.0),
    (" A: 13 2", 0.0),
    (" A: -132", 0.0),
    (" A:", 0.0),
    ("", 0.0),
    (" A: 0132", 1.0),                   # the same number
    ([{"role": "assistant", "content": "A: 132"}], 1.0),  # conversational completion
]
LENIENT_CASES = [
    (" 7+5=12 4+8+1=13 A: 132", 1.0),
    (" the sum is 132.", 1.0),
    (" 132", 1.0),
    (" A: 132 A: 133", 0.0),             # the last number counts
    (" 7+5=12 4+8+1=13", 0.0),           # stops before the answer: 13 is not 132
    (" A: 132 because 4+8=12", 0.0),
    (" no numbers", 0.0),
    ("", 0.0),
    ([{"role": "assistant", "content": "it is 132"}], 1.0),
]


@pytest.mark.parametrize("completion,reward", STRICT_CASES)
def test_strict_verifier(completion, reward):
    assert arith_strict(["Q: 47+85="], [completion], answer=[132]) == [reward]
    assert arith_strict(["Q: 47+85="], [completion], answer=["132"], level=[1]) == [reward]  # any column type; extra columns


@pytest.mark.parametrize("completion,reward", LENIENT_CASES)
def test_lenient_verifier(completion, reward):
    assert arith_lenient(["Q: 47+85="], [completion], answer=[132]) == [reward]


def test_verifiers_by_name_through_the_reward_contract():
    prompts, completions = ["Q: 47+85=", "Q: 10+10="], [" A: 132", " 20 A: 21"]
    for name, expected in (("arith_strict", [1.0, 0.0]), ("arith_lenient", [1.0, 0.0])):
        fn = common.load_reward_fn(name)
        assert fn.__name__ == name
        assert common.call_reward_fns([fn], prompts, completions, None, {"answer": [132, 20]})[:, 0].tolist() == expected


def test_verifiers_read_the_last_assistant_turn():
    """A tool-using exchange (TRL's messages): the answer is the policy's last turn, never a tool's reply."""
    call = {"role": "assistant", "content": wa.tool_call_text((47, 38))}
    reply = {"role": "tool", "name": "add", "content": "85"}
    assert arith_lenient(None, [[call, reply]], answer=[85]) == [0.0]  # cut after the reply: no answer of its own
    assert arith_strict(None, [[call, reply, {"role": "assistant", "content": " A: 85"}]], answer=[85]) == [1.0]
    assert arith_strict(None, [[call, reply, {"role": "assistant", "content": " A: 84"}]], answer=[85]) == [0.0]


def test_the_verifiers_read_numbers_of_more_than_4300_digits():
    """Python's int() refuses more than 4300 digits by default; an answer column or a completion
    with such a number is scored, not a ValueError."""
    big = "9" * 5000
    assert arith_strict(["p"] * 2, [f"A: {big}", f"A: {big}8"], [big, big]) == [1.0, 0.0]
    assert arith_lenient(["p"] * 2, [f"so {big}.", f"{big}7"], [big, big]) == [1.0, 0.0]
