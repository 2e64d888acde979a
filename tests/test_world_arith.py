"""The arithmetic world: the scratchpad, the demonstrator's errors, disjoint splits, the verifiers."""

import pytest

import common
import world_arith as wa
from world_arith import arith_lenient, arith_strict


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
    assert worlds[1]["rl"]["prompt"] != worlds[0]["rl"]["prompt"]  # the training splits still change with the seed
    # seed 0's world is the one every published number was measured on
    import hashlib
    digest = hashlib.md5("".join(list(worlds[0]["sft"]["prompt"]) + list(worlds[0]["rl"]["prompt"])).encode()).hexdigest()
    assert digest == "4e3b939adc009df9ce4cd3d38859e1c2"  # md5 before the test split was shared


def test_parse_spec():
    assert wa.parse_spec("embedded:arith") == (1,)
    assert wa.parse_spec("embedded:arith:2") == (2,)
    assert wa.parse_spec("embedded:arith:2,1") == (1, 2)
    assert wa.parse_spec("embedded") is None and wa.parse_spec("data.jsonl") is None
    for bad in ("embedded:arith:3", "embedded:arith:x"):
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
