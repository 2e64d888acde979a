"""eval.py: bootstrap coverage, Bradley-Terry recovery, the LLM judge's position swap, and an
end-to-end run on two tiny policies (gold judge, then an LLM judge reusing the cached generations)."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import run_script

import eval as ev
import world


# ---------------------------------------------------------------- statistics
def test_outcomes_ties_count_half():
    assert ev.outcomes_from_scores([1.0, 0.2, 0.3], [0.5, 0.2, 0.9]).tolist() == [1.0, 0.5, 0.0]
    wins = ev.win_matrix({(0, 1): np.array([1.0, 0.5, 0.0, 1.0])}, 2)
    assert wins.tolist() == [[0.0, 2.5], [1.5, 0.0]]


def test_paired_bootstrap_ci_covers_true_win_rate():
    """Synthetic judgments with a known win rate: the 95% CI covers it ~95% of the time."""
    p_win, p_tie = 0.55, 0.15
    true_rate = p_win + p_tie / 2
    rng = np.random.default_rng(0)
    covered, significant = 0, 0
    for draw in range(200):
        outcomes = rng.choice([1.0, 0.5, 0.0], size=200, p=[p_win, p_tie, 1 - p_win - p_tie])
        stats = ev.win_rate_stats(outcomes, ev.bootstrap_indices(200, 500, seed=draw))
        assert stats["ci_low"] <= stats["win_rate"] <= stats["ci_high"]
        assert stats["wins"] + stats["ties"] + stats["losses"] == stats["n"] == 200
        covered += stats["ci_low"] <= true_rate <= stats["ci_high"]
        significant += stats["significant"]
    assert 0.90 <= covered / 200 <= 0.99, covered / 200
    assert significant / 200 > 0.9  # 0.625 vs 0.5 with 200 prompts: almost always detected


def test_bootstrap_is_paired_and_deterministic():
    """The same indices resample both policies: a policy against itself has a zero-width CI,
    and the same seed gives the same numbers."""
    idx = ev.bootstrap_indices(50, 300, seed=3)
    assert np.array_equal(idx, ev.bootstrap_indices(50, 300, seed=3))
    scores = np.random.default_rng(1).normal(size=50)
    same = ev.win_rate_stats(ev.outcomes_from_scores(scores, scores), idx)
    assert same["ci_low"] == same["ci_high"] == same["win_rate"] == 0.5 and not same["significant"]
    a, b = scores, scores + 0.1  # b is better on every prompt, though the scores vary a lot
    assert ev.win_rate_stats(ev.outcomes_from_scores(a, b), idx)["ci_high"] == 0.0


def simulate_games(true_elo, games_per_pair, rng, p_tie=0.1):
    """Per-pair outcome arrays drawn from the Elo model; ties (half a win) keep the expected score."""
    outcomes = {}
    for i in range(len(true_elo)):
        for j in range(i + 1, len(true_elo)):
            p = ev.expected_wins(true_elo[i], true_elo[j])
            outcomes[i, j] = rng.choice([1.0, 0.5, 0.0], size=games_per_pair,
                                        p=[p - p_tie / 2, p_tie, 1 - p - p_tie / 2])
    return outcomes


def test_bradley_terry_recovers_known_strengths():
    true_elo = np.array([1000.0, 1150.0, 900.0, 1300.0])
    outcomes = simulate_games(true_elo, 3000, np.random.default_rng(0))
    wins = ev.win_matrix(outcomes, 4)
    elo = ev.bradley_terry_elo(wins)
    assert elo[0] == 1000.0  # the anchor
    assert np.abs(elo - true_elo).max() < 30, elo

    # without the prior it is the exact maximum-likelihood fit: expected wins == observed wins
    elo = ev.bradley_terry_elo(wins, prior_games=0)
    games = wins + wins.T
    expected = (games * ev.expected_wins(elo[:, None], elo[None, :])).sum(1)
    np.testing.assert_allclose(expected, wins.sum(1), rtol=1e-7)

    # batched fits (the bootstrap) equal one-by-one fits; an undefeated player stays finite
    other = ev.win_matrix({(0, 1): np.ones(20), (0, 2): np.ones(20), (1, 2): np.full(20, 0.5)}, 3)
    both = ev.bradley_terry_elo(np.stack([wins[:3, :3], other]))
    np.testing.assert_allclose(both[0], ev.bradley_terry_elo(wins[:3, :3]), atol=1e-6)
    np.testing.assert_allclose(both[1], ev.bradley_terry_elo(other), atol=1e-6)
    assert np.isfinite(both[1]).all() and both[1][1] == pytest.approx(both[1][2]) and both[1][1] < 1000 - 400


def test_policy_names_are_unique():
    assert ev.policy_names(["runs/sft", "runs/dpo"]) == ["sft", "dpo"]
    assert ev.policy_names(["runs/a/checkpoint-10", "runs/b/checkpoint-10/", "org/model"]) == \
        ["a/checkpoint-10", "b/checkpoint-10", "model"]
    assert ev.policy_names(["runs/sft", "runs/sft", "x/reference"]) == ["sft", "sft-2", "reference-2"]


def test_bad_judge_fails_loudly():
    for spec in ["gold:x", "rm", "llm:", "gpt4"]:
        with pytest.raises(SystemExit, match="--judge"):
            ev.parse_judge(spec)
    assert ev.parse_judge("rm:runs/reward") == ("rm", "runs/reward")


# ---------------------------------------------------------------- the LLM judge
def biased_judge(bias):
    """A tiny judge LM whose next-token logit for "A" gets +bias at every position."""
    tok = world.build_tokenizer()
    tok.add_tokens(["A", "B"])
    model = world.build_model(tok, hidden_size=64, num_layers=1).eval()
    a_id = tok.convert_tokens_to_ids("A")
    model.get_output_embeddings().register_forward_hook(
        lambda module, inputs, out: out + bias * torch.nn.functional.one_hot(torch.tensor(a_id), out.shape[-1]))
    return model, tok


def test_llm_judge_position_swap_cancels_bias():
    model, tok = biased_judge(bias=6.0)
    prompts = [f"POST: {p} bought the bike . TL;DR:" for p in ["alice", "bob", "carol"]]
    a = [" alice bought bike .", " bob lost phone .", " carol fixed lamp . dave hid car ."]
    b = [" bob sold car .", " bob lost phone . bob lost phone .", " the weather was nice ."]
    first = ev.prob_first_better(model, tok, prompts, a, b)
    assert (first > 0.9).all()  # asked once, the judge says "A" whatever it is shown
    np.testing.assert_allclose(ev.llm_judge(model, tok, prompts, a, a), 0.5, atol=1e-6)  # identical: exactly even
    np.testing.assert_allclose(ev.llm_judge(model, tok, prompts, a, b) + ev.llm_judge(model, tok, prompts, b, a), 1.0,
                               atol=1e-6)
    plain = world.build_tokenizer()  # no "A"/"B" in a word-level lowercase vocabulary: a loud error
    with pytest.raises(SystemExit, match="single token"):
        ev.prob_first_better(model, plain, prompts, a, b)


# ---------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """Two tiny policies (different random weights) and a tiny LLM judge that can say A or B."""
    root = tmp_path_factory.mktemp("eval")
    tok = world.build_tokenizer()
    for seed in (0, 1):
        world.build_model(tok, hidden_size=64, num_layers=1 + seed, seed=seed).save_pretrained(root / f"pi{seed}")
        tok.save_pretrained(root / f"pi{seed}")
    judge_tok = world.build_tokenizer()
    judge_tok.add_tokens(["A", "B"])
    world.build_model(judge_tok, hidden_size=64, num_layers=1, seed=2).save_pretrained(root / "judge")
    judge_tok.save_pretrained(root / "judge")
    return root


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_end_to_end(tiny_folders):
    from PIL import Image

    root = tiny_folders
    # sampled: greedy random-init models all repeat one token, so their responses would be identical
    common_flags = ["--num_prompts", "24", "--num_bootstrap", "200", "--max_completion_length", "12",
                    "--eval_batch_size", "8", "--do_sample", "--cache_dir", str(root / "cache")]
    out = root / "gold"
    proc = run_script("eval.py", str(root / "pi0"), str(root / "pi1"), "--output_dir", str(out), *common_flags)
    assert proc.stdout.count("generated 24 responses") == 2
    assert "| pi1 |" in proc.stdout  # the table is printed

    results = json.loads((out / "results.json").read_text())
    assert set(results["elo"]) == set(results["policies"]) == {"pi0", "pi1"}
    assert results["elo"]["pi0"]["elo"] == 1000.0
    pairs = {(r["policy_a"], r["policy_b"]): r for r in results["pairwise"]}
    assert set(pairs) == {("pi1", "pi0"), ("pi0", "reference"), ("pi1", "reference")}
    assert results["reference"]["score"] == pytest.approx(1.0)
    for name, p in results["policies"].items():
        assert p["score_ci_low"] <= p["score"] <= p["score_ci_high"] and p["mean_length"] > 0
    # the gold judge's terms per summary, recomputed from the generations
    gens = read_jsonl(out / "generations.jsonl")
    test = world.build_world()["test"]
    posts = {row["prompt"]: row["post"] for row in test.select(range(24))}
    missed = [world.gold_counts(posts[g["prompt"]], g["responses"]["pi1"])["missed"] for g in gens]
    assert results["policies"]["pi1"]["gold_counts"]["missed"] == pytest.approx(sum(missed) / len(missed))
    assert results["reference"]["gold_counts"] == {"missed": 0.0, "unsupported": 0.0, "repeated": 0.0, "excess": 0.0}
    assert "facts missed" in (out / "results.md").read_text()

    # recomputing every win rate from judgments.jsonl gives the number in results.json
    judgments = read_jsonl(out / "judgments.jsonl")
    assert len(judgments) == 3 * 24
    for (a, b), r in pairs.items():
        rows = [j for j in judgments if (j["policy_a"], j["policy_b"]) == (a, b)]
        rate = sum({"a": 1.0, "tie": 0.5, "b": 0.0}[j["winner"]] for j in rows) / len(rows)
        assert rate == pytest.approx(r["win_rate"], abs=1e-12) and r["n"] == len(rows) == 24
        assert all((j["winner"] == "a") == (j["score_a"] > j["score_b"]) for j in rows)
    assert "win rate vs pi0" in (out / "results.md").read_text()
    assert len(read_jsonl(out / "generations.jsonl")) == 24
    for png in ("win_rates.png", "elo.png"):
        with Image.open(out / png) as im:
            im.verify()
            assert im.format == "PNG" and im.size[0] > 100

    # another judge: the generations come from the cache, not from the policies again
    out_llm = root / "llm"
    proc = run_script("eval.py", str(root / "pi0"), str(root / "pi1"), "--output_dir", str(out_llm),
                      "--judge", f"llm:{root / 'judge'}", *common_flags)
    assert proc.stdout.count("responses from the cache") == 2 and "generated" not in proc.stdout
    judgments = read_jsonl(out_llm / "judgments.jsonl")
    assert all(0 <= j["prob_a"] <= 1 and (j["winner"] == "tie") == (j["prob_a"] == 0.5) for j in judgments)
    llm_results = json.loads((out_llm / "results.json").read_text())
    assert "score" not in llm_results["policies"]["pi0"] and "gold_counts" not in llm_results["policies"]["pi0"]
    gens = [json.loads(line) for line in open(out_llm / "generations.jsonl")]
    assert gens == read_jsonl(out / "generations.jsonl")


def test_cache_key_follows_the_weights_content(tmp_path):
    """Weights swapped in place with the same size and mtime must not reuse stale generations."""
    folder = tmp_path / "pi"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    weights = folder / "model.safetensors"
    weights.write_bytes(b"a" * 64)
    stat = os.stat(weights)
    before = ev.weights_fingerprint(str(folder))
    weights.write_bytes(b"b" * 64)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime
    ev.weights_fingerprint.cache_clear()  # computed once per policy and run: a new run computes it again
    assert ev.weights_fingerprint(str(folder)) != before
