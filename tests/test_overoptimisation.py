"""studies/overoptimisation.py on two hand-written run folders: the points it reads (proxy, gold,
the per-completion KL and its square root at each evaluation step), its JSON and its plot."""

import importlib.util
import json
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _study():
    spec = importlib.util.spec_from_file_location("overoptimisation", os.path.join(ROOT, "studies", "overoptimisation.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(folder, rows):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(folder)


def test_overoptimisation_reads_proxy_gold_and_sequence_kl(tmp_path):
    grpo = _run(tmp_path / "grpo", [  # per-token k3 kl, times the mean completion length
        {"step": 1, "reward": 0.1, "kl": 0.0, "clip_ratio": 0.0, "completions/mean_length": 10.0},
        {"step": 2, "reward": 0.2, "kl": 0.01, "clip_ratio": 0.0, "completions/mean_length": 20.0},
        {"step": 2, "eval_reward": 0.3, "eval_rewards/rm/mean": 0.3, "eval_rewards/gold/mean": 0.5},
        {"step": 3, "reward": 0.4, "kl": 0.02, "clip_ratio": 0.0, "completions/mean_length": 8.0},
        {"step": 4, "reward": 0.5, "kl": 0.04, "clip_ratio": 0.0, "completions/mean_length": 25.0},
        {"step": 4, "eval_reward": 0.6, "eval_rewards/rm/mean": 0.6, "eval_rewards/gold/mean": 0.4}])
    ppo = _run(tmp_path / "ppo", [  # kl per completion already; logged every 2 steps
        {"step": 2, "reward": 1.0, "kl": 0.5, "vf_loss": 0.1, "completions/mean_length": 12.0},
        {"step": 3, "eval_reward": 1.5, "eval_rewards/gold/mean": 0.2},
        {"step": 4, "reward": 2.0, "kl": -0.01, "vf_loss": 0.1, "completions/mean_length": 12.0},
        {"step": 4, "eval_reward": 2.5, "eval_rewards/gold/mean": 0.1}])
    out = str(tmp_path / "study")
    _study().main([grpo, ppo, "--output", out])
    runs = json.load(open(out + ".json"))["runs"]
    assert [r["method"] for r in runs] == ["grpo", "ppo"] and "k3" in runs[0]["kl"]
    g, p = runs[0]["points"], runs[1]["points"]
    assert [x["step"] for x in g] == [2, 4] and [x["proxy"] for x in g] == [0.3, 0.6] and [x["gold"] for x in g] == [0.5, 0.4]
    assert [x["kl"] for x in g] == pytest.approx([0.2, 1.0]) and g[1]["sqrt_kl"] == pytest.approx(1.0)
    assert [x["proxy_train"] for x in g] == [0.2, 0.5] and [x["mean_length"] for x in g] == [20.0, 25.0]
    # ppo: step 3's evaluation takes the last training row before it; a negative k1 estimate gives sqrt 0
    assert [x["train_step"] for x in p] == [2, 4] and [x["kl"] for x in p] == [0.5, -0.01]
    assert p[0]["sqrt_kl"] == pytest.approx(math.sqrt(0.5)) and p[1]["sqrt_kl"] == 0.0
    assert os.path.getsize(out + ".png") > 1000


def test_overoptimisation_refuses_a_run_without_gold(tmp_path):
    run = _run(tmp_path / "grpo", [{"step": 1, "reward": 0.1, "kl": 0.0, "clip_ratio": 0.0},
                                   {"step": 1, "eval_reward": 0.3}])
    with pytest.raises(SystemExit) as e:
        _study().main([run, "--output", str(tmp_path / "x")])
    assert "--eval_reward_fn gold" in str(e.value)
