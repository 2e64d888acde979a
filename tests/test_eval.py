"""eval.py: bootstrap coverage (prompt-only, and two-level over training seeds against a direct
simulation), one run per method == the prompt bootstrap, Bradley-Terry recovery, the LLM judge's
position swap and ties, methods on the command line, and end-to-end runs on tiny policies (gold
judge, an LLM judge reusing the cached generations, and two methods of two runs each)."""

import json
import math
import os

import numpy as np
import pytest
import torch
from conftest import run_main

import eval as ev
from rlhf.evaluation import judges
from rlhf.evaluation import policies
from worlds import scratch
from worlds import world


# ---------------------------------------------------------------- statistics
def test_outcomes_ties_count_half():
    assert ev.outcomes_from_scores([1.0, 0.2, 0.3], [0.5, 0.2, 0.9]).tolist() == [1.0, 0.5, 0.0]
    wins = ev.win_matrix({(0, 1): np.array([1.0, 0.5, 0.0, 1.0]).sum()}, 4, 2)
    assert wins.tolist() == [[0.0, 2.5], [1.5, 0.0]]


def prompt_counts(n, num_bootstrap, seed):
    return ev.resample_counts(ev.bootstrap_indices(n, num_bootstrap, seed), n)


def test_paired_bootstrap_ci_covers_true_win_rate():
    """Synthetic judgments with a known win rate: the 95% CI covers it 95% of the time, and a 90%
    (or 99%) interval would not pass. 2000 draws: the coverage's standard error is 0.005 at 0.95
    and 0.007 at 0.90, so the band 0.93-0.97 is >3 standard errors from 0.95 and from 0.90
    (measured: 0.9465 at 95%, 0.905 with CI_LEVEL = 0.90). The draws cycle through 20 resample
    plans (independent of the data, as in eval.main), which keeps the test fast."""
    p_win, p_tie = 0.55, 0.15
    true_rate = p_win + p_tie / 2
    rng = np.random.default_rng(0)
    plans = [prompt_counts(200, 500, seed=s) for s in range(20)]
    covered, significant, draws = 0, 0, 2000
    for draw in range(draws):
        outcomes = rng.choice([1.0, 0.5, 0.0], size=200, p=[p_win, p_tie, 1 - p_win - p_tie])
        stats = ev.win_rate_stats(outcomes, plans[draw % 20])
        assert stats["ci_low"] <= stats["win_rate"] <= stats["ci_high"]
        assert stats["wins"] + stats["ties"] + stats["losses"] == stats["n"] == 200
        covered += stats["ci_low"] <= true_rate <= stats["ci_high"]
        significant += stats["significant"]
    assert 0.93 <= covered / draws <= 0.97, covered / draws
    assert significant / draws > 0.9  # 0.625 vs 0.5 with 200 prompts: almost always detected


def test_bootstrap_is_paired_and_deterministic():
    """The same indices resample both policies: a policy against itself has a zero-width CI,
    and the same seed gives the same numbers."""
    idx = prompt_counts(50, 300, seed=3)
    assert np.array_equal(idx, prompt_counts(50, 300, seed=3))
    scores = np.random.default_rng(1).normal(size=50)
    same = ev.win_rate_stats(ev.outcomes_from_scores(scores, scores), idx)
    assert same["ci_low"] == same["ci_high"] == same["win_rate"] == 0.5 and not same["significant"]
    a, b = scores, scores + 0.1  # b is better on every prompt, though the scores vary a lot
    assert ev.win_rate_stats(ev.outcomes_from_scores(a, b), idx)["ci_high"] == 0.0


def test_one_run_per_method_equals_the_prompt_bootstrap():
    """With one run per method, both CIs equal the prompt-only paired bootstrap written directly
    (resampled prompt indices, means over them, Bradley-Terry on the resampled win counts)."""
    n, B = 60, 300
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(3, n)).round(1)  # rounded: some ties
    idx = ev.bootstrap_indices(n, B, seed=7)  # (B, n)
    counts, run_counts, all_runs = ev.bootstrap_plan(n, [1, 1, 1], B, seed=7)
    assert np.array_equal(run_counts, all_runs)  # one run: resampling the runs changes nothing

    # score of one method: mean and percentile CI of the resampled means
    direct = ev.percentile_ci(scores[0][idx].mean(1))
    mean, lo, hi, seed_lo, seed_hi = ev.mean_cis(scores[:1], counts, run_counts[:1], all_runs[:1])
    assert mean == scores[0].mean()
    np.testing.assert_allclose([lo, hi], direct, rtol=1e-12)
    assert (lo, hi) == (seed_lo, seed_hi)

    # win rate of 1 over 0: ties and counts are half-integers, so the sums are exact: equal to the bit
    outcomes = ev.outcomes_from_scores(scores[1], scores[0])
    stats = ev.win_rate_stats(outcomes[None, None], counts, run_counts[:2], all_runs[:2])
    assert stats["win_rate"] == outcomes.mean()
    assert (stats["ci_low"], stats["ci_high"]) == ev.percentile_ci(outcomes[idx].mean(1))
    assert (stats["ci_low"], stats["ci_high"]) == (stats["seed_ci_low"], stats["seed_ci_high"])
    assert stats == ev.win_rate_stats(outcomes, counts)  # (n,) outcomes: one run each

    # Elo: bootstrap win matrices from resampled totals == from the resampled per-prompt outcomes
    pairs = {(1, 0): ev.outcomes_from_scores(scores[1], scores[0]), (2, 0): ev.outcomes_from_scores(scores[2], scores[0]),
             (2, 1): ev.outcomes_from_scores(scores[2], scores[1])}
    direct = np.zeros((B, 3, 3))
    for (i, j), o in pairs.items():
        direct[:, i, j] += o[idx].sum(1)
        direct[:, j, i] += (1 - o[idx]).sum(1)
    totals = {(i, j): ev.resampled_totals(o[None, None], counts, [run_counts[i], run_counts[j]]) for (i, j), o in pairs.items()}
    assert np.array_equal(ev.win_matrix(totals, n, 3), direct)


def simulate_methods(rng, num_runs, n, delta, seed_sd, noise_sd=1.0):
    """Gold-like scores of two methods' runs: s = delta_m + u_run + v_prompt + e, with a seed
    effect u ~ N(0, seed_sd^2) per run, a prompt difficulty v shared by every run (paired) and
    noise e: (R, n) each."""
    prompt = rng.normal(size=n)
    a = delta + seed_sd * rng.normal(size=(num_runs, 1)) + prompt + noise_sd * rng.normal(size=(num_runs, n))
    b = seed_sd * rng.normal(size=(num_runs, 1)) + prompt + noise_sd * rng.normal(size=(num_runs, n))
    return a, b


def test_two_level_bootstrap_coverage():
    """A direct simulation with a known seed effect: the two-level 95% CI covers the true method
    difference ~95% of the time, the prompt-only CI (which treats the runs as fixed) far less.

    Truth: a's score minus b's on a new prompt with new seeds is N(delta, 2 seed_sd^2 + 2 noise_sd^2),
    so the method win rate is Phi(delta / sqrt(2 seed_sd^2 + 2)) and a's mean score is delta.
    Measured (200 repetitions, 100 prompts, seed_sd 0.3): 10 runs per method: two-level 0.94,
    prompt-only 0.46 (win rate); 5 runs: 0.93; 3 runs: 0.89 (a bootstrap of 3 runs is too narrow)."""
    num_runs, n, delta, seed_sd, reps = 10, 100, 0.3, 0.3, 200
    true_win_rate = 0.5 * (1 + math.erf(delta / np.sqrt(2 * seed_sd**2 + 2) / math.sqrt(2)))  # Phi
    rng = np.random.default_rng(0)
    covered = {"win": [0, 0], "score": [0, 0]}  # [prompt-only, two-level]
    for rep in range(reps):
        a, b = simulate_methods(rng, num_runs, n, delta, seed_sd)
        counts, run_counts, all_runs = ev.bootstrap_plan(n, [num_runs, num_runs], 400, seed=rep)
        outcomes = ev.outcomes_from_scores(a[:, None, :], b[None, :, :])  # (R_a, R_b, n): every run pair
        stats = ev.win_rate_stats(outcomes, counts, run_counts, all_runs)
        covered["win"][0] += stats["ci_low"] <= true_win_rate <= stats["ci_high"]
        covered["win"][1] += stats["seed_ci_low"] <= true_win_rate <= stats["seed_ci_high"]
        _, lo, hi, seed_lo, seed_hi = ev.mean_cis(a, counts, run_counts[:1], all_runs[:1])
        covered["score"][0] += lo <= delta <= hi
        covered["score"][1] += seed_lo <= delta <= seed_hi
    win, score = np.array(covered["win"]) / reps, np.array(covered["score"]) / reps
    assert 0.90 <= win[1] <= 0.99 and 0.90 <= score[1] <= 0.99, (win, score)
    assert win[0] < 0.7 and score[0] < 0.9, (win, score)  # seed variance ignored: visibly too narrow


def test_two_level_bootstrap_without_seed_effect_stays_close_to_prompt_only():
    """No seed effect, runs nearly identical: the two-level CI is not much wider than the
    prompt-only one (the second level adds only what the runs disagree on)."""
    rng = np.random.default_rng(1)
    a, _ = simulate_methods(rng, 4, 200, 0.3, seed_sd=0.0, noise_sd=0.01)
    counts, run_counts, all_runs = ev.bootstrap_plan(200, [4, 4], 500, seed=0)
    _, lo, hi, seed_lo, seed_hi = ev.mean_cis(a, counts, run_counts[:1], all_runs[:1])
    assert seed_hi - seed_lo < 1.05 * (hi - lo)


def test_methods_from_the_command_line(tmp_path, monkeypatch):
    for run in ["a/seed0", "a/seed1", "a/seed10", "b/seed0", "sft"]:
        (tmp_path / run).mkdir(parents=True)
        (tmp_path / run / "config.json").write_text("{}")
    (tmp_path / "a" / "seed1.log").write_text("a training log")  # a glob's files and other folders are not runs
    (tmp_path / "a" / "seed2").mkdir()
    monkeypatch.chdir(tmp_path)
    methods = policies.parse_methods(["sft", "a=a/seed*", "mine=b/seed0,sft"])
    assert methods == [("sft", ["sft"]), ("a", ["a/seed0", "a/seed1", "a/seed10"]), ("mine", ["b/seed0", "sft"])]
    assert policies.run_names(methods) == [["sft"], ["a/seed0", "a/seed1", "a/seed10"], ["mine/seed0", "mine/sft"]]
    assert policies.parse_methods(["runs/x/sft", "runs/y/sft"]) == [("x/sft", ["runs/x/sft"]), ("y/sft", ["runs/y/sft"])]
    with pytest.raises(SystemExit, match="matches no model folder"):
        policies.parse_methods(["a=c/seed*"])
    with pytest.raises(SystemExit, match=r"matches no model folder \(a folder with config.json\); it matches only a/seed1.log"):
        policies.parse_methods(["a=a/*.log"])
    with pytest.raises(SystemExit, match="two methods are named"):
        policies.parse_methods(["a=a/seed0", "a=b/seed0"])
    with pytest.raises(SystemExit, match="name"):
        policies.parse_methods(["=a/seed0"])


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
    wins = ev.win_matrix({p: o.sum() for p, o in outcomes.items()}, 3000, 4)
    elo = ev.bradley_terry_elo(wins)
    assert elo[0] == 1000.0  # the anchor
    assert np.abs(elo - true_elo).max() < 30, elo

    # without the prior it is the exact maximum-likelihood fit: expected wins == observed wins
    elo = ev.bradley_terry_elo(wins, prior_games=0)
    games = wins + wins.T
    expected = (games * ev.expected_wins(elo[:, None], elo[None, :])).sum(1)
    np.testing.assert_allclose(expected, wins.sum(1), rtol=1e-7)

    # batched fits (the bootstrap) equal one-by-one fits; an undefeated player stays finite
    other = ev.win_matrix({(0, 1): 20.0, (0, 2): 20.0, (1, 2): 10.0}, 20, 3)
    both = ev.bradley_terry_elo(np.stack([wins[:3, :3], other]))
    np.testing.assert_allclose(both[0], ev.bradley_terry_elo(wins[:3, :3]), atol=1e-6)
    np.testing.assert_allclose(both[1], ev.bradley_terry_elo(other), atol=1e-6)
    assert np.isfinite(both[1]).all() and both[1][1] == pytest.approx(both[1][2]) and both[1][1] < 1000 - 400


def test_policy_names_are_unique():
    assert policies.policy_names(["runs/sft", "runs/dpo"]) == ["sft", "dpo"]
    assert policies.policy_names(["runs/a/checkpoint-10", "runs/b/checkpoint-10/", "org/model"]) == \
        ["a/checkpoint-10", "b/checkpoint-10", "model"]
    assert policies.policy_names(["runs/sft", "runs/sft", "x/reference"]) == ["sft", "sft-2", "reference-2"]


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
    first = judges.prob_first_better(model, tok, prompts, a, b)
    assert (first > 0.9).all()  # asked once, the judge says "A" whatever it is shown
    np.testing.assert_allclose(judges.llm_judge(model, tok, prompts, a, a), 0.5, atol=1e-6)  # identical: exactly even
    np.testing.assert_allclose(judges.llm_judge(model, tok, prompts, a, b) + judges.llm_judge(model, tok, prompts, b, a), 1.0,
                               atol=1e-6)
    plain = scratch.fit_tokenizer(["alice bought bike ."], "char")  # no "A"/"B" tokens: a loud error
    with pytest.raises(SystemExit, match="single token"):
        judges.prob_first_better(model, plain, prompts, a, b)


def test_random_llm_judge_gives_ties_not_wins():
    """A randomly initialised judge has no preference: after the position swap P(a better) is
    0.5 +- 1e-4. Read as 'a wins when P > 0.5' (tie_margin 0, the old rule) every comparison is
    a decision, and a judge whose noise leans one way (P = 0.50004 on every prompt) gives 40-0,
    "significant"; with the default margin every comparison is a tie and the CI covers 0.5."""
    model, tok = biased_judge(bias=0.0)
    test = world.build_world()["test"].select(range(40))
    a = [" " + post.split(" . ")[0] + " ." for post in test["post"]]  # the post's first fact
    b = [" " + " . ".join(post.split(" . ")[:2]) + " ." for post in test["post"]]  # its first two
    prob = judges.llm_judge(model, tok, test["prompt"], a, b)
    assert np.abs(prob - 0.5).max() < 0.01  # no preference
    counts = prompt_counts(40, 500, seed=0)
    assert ev.win_rate_stats(ev.outcomes_from_probs(prob, tie_margin=0.0), counts)["ties"] == 0  # the old rule
    stats = ev.win_rate_stats(ev.outcomes_from_probs(prob, ev.Args.tie_margin), counts)
    assert stats["ci_low"] <= 0.5 <= stats["ci_high"] and not stats["significant"] and stats["ties"] == 40

    leaning = np.full(40, 0.50004)  # the judge: no preference, noise of one sign
    old = ev.win_rate_stats(ev.outcomes_from_probs(leaning, tie_margin=0.0), counts)
    assert old["wins"] == 40 and old["ci_low"] == 1.0 and old["significant"]  # the bug: 40-0, "significant"
    stats = ev.win_rate_stats(ev.outcomes_from_probs(leaning, ev.Args.tie_margin), counts)
    assert stats["win_rate"] == 0.5 and not stats["significant"]
    # a judge with a preference still decides: 0.56 is a win, 0.44 a loss, 0.53 a tie at the default 0.05
    assert ev.outcomes_from_probs([0.56, 0.44, 0.53, 0.5], 0.05).tolist() == [1.0, 0.0, 0.5, 0.5]


# ---------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """Four tiny policies (different random weights) and a tiny LLM judge that can say A or B."""
    root = tmp_path_factory.mktemp("eval")
    tok = world.build_tokenizer()
    for seed in (0, 1, 2, 3):
        world.build_model(tok, hidden_size=64, num_layers=1 + seed, seed=seed).save_pretrained(root / f"pi{seed}")
        tok.save_pretrained(root / f"pi{seed}")
    judge_tok = world.build_tokenizer()
    judge_tok.add_tokens(["A", "B"])
    world.build_model(judge_tok, hidden_size=64, num_layers=1, seed=2).save_pretrained(root / "judge")
    judge_tok.save_pretrained(root / "judge")
    return root


def run_eval(argv, monkeypatch, capsys):
    """eval.py in this process (as `python eval.py ARGV`); returns what it printed."""
    capsys.readouterr()
    run_main(ev, [str(a) for a in argv], monkeypatch)
    return capsys.readouterr().out


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_end_to_end(tiny_folders, monkeypatch, capsys):
    from PIL import Image

    root = tiny_folders
    # sampled: greedy random-init models all repeat one token, so their responses would be identical
    common_flags = ["--num_prompts", "24", "--num_bootstrap", "200", "--max_completion_length", "12",
                    "--eval_batch_size", "8", "--do_sample", "--cache_dir", str(root / "cache")]
    out = root / "gold"
    stdout = run_eval([root / "pi0", root / "pi1", "--output_dir", out, *common_flags], monkeypatch, capsys)
    assert stdout.count("generated 24 responses") == 2
    assert "| pi1 |" in stdout  # the table is printed

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
    stdout = run_eval([root / "pi0", root / "pi1", "--output_dir", out_llm, "--judge", f"llm:{root / 'judge'}",
                       *common_flags], monkeypatch, capsys)
    assert stdout.count("responses from the cache") == 2 and "generated" not in stdout
    judgments = read_jsonl(out_llm / "judgments.jsonl")
    assert all(0 <= j["prob_a"] <= 1 and (j["winner"] == "tie") == (abs(j["prob_a"] - 0.5) <= 0.05) for j in judgments)
    llm_results = json.loads((out_llm / "results.json").read_text())
    assert "score" not in llm_results["policies"]["pi0"] and "gold_counts" not in llm_results["policies"]["pi0"]
    gens = [json.loads(line) for line in open(out_llm / "generations.jsonl")]
    assert gens == read_jsonl(out / "generations.jsonl")


def test_end_to_end_methods_of_several_runs(tiny_folders, monkeypatch, capsys):
    """Two methods of two runs each (glob and comma list): the win rate averages over the four run
    pairs, both CIs are reported, and the two-level one is at least as wide here."""
    root = tiny_folders
    out = root / "methods"
    stdout = run_eval([f"a={root}/pi[01]", f"b={root / 'pi2'},{root / 'pi3'}", "--output_dir", out,
                       "--num_prompts", "24", "--num_bootstrap", "200", "--max_completion_length", "12",
                       "--eval_batch_size", "8", "--do_sample", "--cache_dir", root / "cache"], monkeypatch, capsys)
    assert "2 methods (4 runs)" in stdout
    results = json.loads((out / "results.json").read_text())
    assert results["policies"]["a"]["runs"] == ["a/pi0", "a/pi1"] and results["policies"]["b"]["runs"] == ["b/pi2", "b/pi3"]
    (pair,) = [r for r in results["pairwise"] if (r["policy_a"], r["policy_b"]) == ("b", "a")]
    assert (pair["runs_a"], pair["runs_b"], pair["n"]) == (2, 2, 24) and pair["wins"] + pair["ties"] + pair["losses"] == 96
    judgments = [j for j in read_jsonl(out / "judgments.jsonl") if (j["method_a"], j["method_b"]) == ("b", "a")]
    assert len(judgments) == 96 and {j["policy_a"] for j in judgments} == {"b/pi2", "b/pi3"}
    rate = np.mean([{"a": 1.0, "tie": 0.5, "b": 0.0}[j["winner"]] for j in judgments])
    assert pair["win_rate"] == pytest.approx(rate, abs=1e-12)
    for r in results["pairwise"] + list(results["elo"].values()):
        assert r["seed_ci_low"] <= r.get("win_rate", r.get("elo")) <= r["seed_ci_high"]
    score_a = np.mean([results["runs"][r]["score"] for r in ["a/pi0", "a/pi1"]])
    assert results["policies"]["a"]["score"] == pytest.approx(score_a)
    p = results["policies"]["a"]
    assert p["score_seed_ci_high"] - p["score_seed_ci_low"] >= 0.9 * (p["score_ci_high"] - p["score_ci_low"])
    report = (out / "results.md").read_text()
    assert "seeds + prompts CI" in report and "| a/pi1 | a |" in report


def test_elo_bootstrap_resamples_the_prompts_once_for_every_pair(tiny_folders, monkeypatch, capsys):
    """eval.main with three methods, two of them the same policy under two names: every bootstrap
    draw resamples the prompts once for all pairs, so in every draw the twins win the same games
    against pi0 and tie each other, get the same Elo, and so the same interval to the last digit.
    (Each pair with its own resample would give them different draws, hence different intervals.)"""
    root = tiny_folders
    out = root / "twins"
    (root / "length.py").write_text("def length(prompts, completions, **kw):\n    return [len(c) for c in completions]\n")
    run_eval(["pi0=" + str(root / "pi0"), "b=" + str(root / "pi1"), "c=" + str(root / "pi1"), "--output_dir", out,
              "--reward_fn", f"{root / 'length.py'}:length", "--num_prompts", "24", "--num_bootstrap", "200", "--max_completion_length", "12", "--eval_batch_size", "8",
              "--do_sample", "--cache_dir", root / "cache"], monkeypatch, capsys)
    results = json.loads((out / "results.json").read_text())
    pairs = {(r["policy_a"], r["policy_b"]): r for r in results["pairwise"]}
    twins = pairs.get(("c", "b"), pairs.get(("b", "c")))
    assert twins["ties"] == 24 and twins["ci_low"] == twins["ci_high"] == 0.5
    b, c = results["elo"]["b"], results["elo"]["c"]
    assert b["ci_high"] > b["ci_low"]  # pi1 and pi0 do differ across the resamples
    assert (b["elo"], b["ci_low"], b["ci_high"]) == (c["elo"], c["ci_low"], c["ci_high"])
    assert (b["seed_ci_low"], b["seed_ci_high"]) == (c["seed_ci_low"], c["seed_ci_high"])


# ---------------------------------------------------------------- pass@k
def test_pass_at_k_matches_counting_every_subset():
    from itertools import combinations
    from math import comb

    for n, c, k in [(5, 0, 1), (5, 2, 1), (5, 2, 2), (5, 2, 4), (6, 3, 3), (6, 6, 2), (8, 1, 8), (4, 3, 2)]:
        samples = [1] * c + [0] * (n - c)
        subsets = list(combinations(range(n), k))  # every way to draw k of the n samples
        direct = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
        assert ev.pass_at_k(n, c, k) == pytest.approx(direct, abs=1e-12), (n, c, k)
        assert ev.pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)
    assert ev.pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass@1 is the share of correct samples
    assert ev.pass_at_k(200, 50, 100) == pytest.approx(1 - comb(150, 100) / comb(200, 100), abs=1e-12)  # no overflow


def test_pass_at_k_stats_average_prompts_with_a_bootstrap_ci():
    correct = np.array([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 1]])  # (prompts, samples)
    prompt_counts, run_counts, all_runs = ev.bootstrap_plan(4, [1], 500, seed=0)
    stats = ev.pass_at_k_stats(correct[None], [1, 2, 4], prompt_counts, run_counts, all_runs)  # one run
    assert stats["pass@1"]["value"] == pytest.approx((0.25 + 1 + 0 + 0.5) / 4)
    assert stats["pass@2"]["value"] == pytest.approx((0.5 + 1 + 0 + (1 - 1 / 6)) / 4)
    assert stats["pass@4"]["value"] == pytest.approx(3 / 4)
    for s in stats.values():
        assert s["ci_low"] <= s["value"] <= s["ci_high"] and s["ci_low"] < s["ci_high"]


def test_cache_key_follows_the_weights_content(tmp_path):
    """Weights swapped in place with the same size and mtime must not reuse stale generations."""
    folder = tmp_path / "pi"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    weights = folder / "model.safetensors"
    weights.write_bytes(b"a" * 64)
    stat = os.stat(weights)
    before = policies.weights_fingerprint(str(folder))
    weights.write_bytes(b"b" * 64)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime
    policies.weights_fingerprint.cache_clear()  # computed once per policy and run: a new run computes it again
    assert policies.weights_fingerprint(str(folder)) != before


def cached_policy(tmp_path, prompts, responses):
    """A policy folder and a cache file of its responses to `prompts` -> (path, args)."""
    from rlhf import checkpoints

    folder = tmp_path / "pi"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    args = ev.Args(cache_dir=str(tmp_path / "cache"), do_sample=True)
    policies.weights_fingerprint.cache_clear()
    file = policies.cache_file(str(folder), prompts, args)
    checkpoints.write_json(file, {"key": policies.policy_key(str(folder), args), "prompts": prompts, "responses": responses,
                                  "truncated": [False] * len(prompts), "completion_ids": [[i] for i in range(len(prompts))]})
    return str(folder), args


def test_fewer_samples_per_prompt_from_the_cache_are_distinct_samples(tmp_path):
    """--num_samples 4 after --num_samples 8: each prompt's first 4 cached samples, not one sample 4 times."""
    prompts = ["p"] * 8 + ["q"] * 8
    path, args = cached_policy(tmp_path, prompts, [f"{p}{i}" for p in "pq" for i in range(8)])
    file, responses, truncated, ids = policies.cached_generations(path, ["p"] * 4 + ["q"] * 4, args)
    assert responses == ["p0", "p1", "p2", "p3", "q0", "q1", "q2", "q3"] and ids == [[0], [1], [2], [3], [8], [9], [10], [11]]
    assert policies.cached_generations(path, ["p"] * 9, args) is None  # more samples than cached: generated again


def test_a_larger_prompt_set_generates_only_what_the_cache_lacks(tmp_path, tiny_qwen, capsys):
    """eval on 3 prompts after a run on 2 of them (--num_prompts 0 after 300): the 2 come from the
    cache, only the third is generated, and it is what generating it alone gives; the new file then
    answers all 3. --num_samples 3 after 2 samples of a prompt: the 2 cached, a third generated."""
    prompts = [f"POST: alice bought the bike {i} . TL;DR:" for i in range(3)]
    args = ev.Args(model="", dataset="embedded", cache_dir=str(tmp_path / "cache"), max_completion_length=6)
    first = policies.generate_responses(tiny_qwen, "pi", prompts[:2], args)
    alone = policies.generate_responses(tiny_qwen, "pi", prompts[2:], ev.Args(
        model="", dataset="embedded", cache_dir=str(tmp_path / "alone"), max_completion_length=6))
    capsys.readouterr()
    both = policies.generate_responses(tiny_qwen, "pi", prompts, args)
    assert "2 of 3 responses from the cache" in capsys.readouterr().out
    assert [list(column) for column in both] == [a + b for a, b in zip(first, alone)]
    file, rows = policies.cached_rows(tiny_qwen, prompts, args)
    assert all(r is not None for r in rows) and policies.cached_generations(tiny_qwen, prompts, args)[1] == both[0]
    path, args = cached_policy(tmp_path, ["p", "p", "q"], ["p0", "p1", "q0"])
    file, rows = policies.cached_rows(path, ["q", "p", "p", "p"], args)
    assert [r and r[0] for r in rows] == ["q0", "p0", "p1", None] and policies.cached_generations(path, ["p"] * 3, args) is None


@pytest.mark.parametrize("damage", [b'{"prompts": ["p"], "respon', b"\xff\xfe", b'["not", "a", "cache"]',
                                    b'{"prompts": ["p"], "responses": [], "truncated": [false], "completion_ids": [[1]]}'])
def test_an_unreadable_cache_file_is_named_set_aside_and_generated_again(tmp_path, capsys, damage):
    path, args = cached_policy(tmp_path, ["p"], ["r"])
    file = policies.cache_file(path, ["p"], args)
    with open(file, "wb") as f:
        f.write(damage)
    assert policies.cached_generations(path, ["p"], args) is None
    out = capsys.readouterr().out
    assert f"the generation cache file {file} cannot be read" in out and out.count("\n") == 1
    assert not os.path.exists(file) and open(file + ".unreadable", "rb").read() == damage


def test_group_stats_per_level_with_both_cis():
    """Per-group means (e.g. accuracy per difficulty level): each group's mean of its own prompts;
    with one run the two-level CI is the prompt-only one, with runs that differ it is wider."""
    rng = np.random.default_rng(0)
    groups = [1] * 60 + [2] * 40
    one = rng.integers(0, 2, size=(1, 100)).astype(float)
    stats = ev.group_stats(one, groups, 500, 0)
    assert stats["1"]["n"] == 60 and stats["2"]["n"] == 40
    assert stats["2"]["score"] == pytest.approx(one[0, 60:].mean())
    assert (stats["1"]["seed_ci_low"], stats["1"]["seed_ci_high"]) == (stats["1"]["ci_low"], stats["1"]["ci_high"])
    runs = np.stack([(rng.random(100) < p).astype(float) for p in (0.2, 0.5, 0.8)])  # a strong seed effect
    stats = ev.group_stats(runs, groups, 500, 0)
    for g in ("1", "2"):
        s = stats[g]
        assert s["seed_ci_high"] - s["seed_ci_low"] > 1.5 * (s["ci_high"] - s["ci_low"])
        assert s["seed_ci_low"] <= s["score"] <= s["seed_ci_high"]


def test_elo_under_complete_separation_is_reported_unbounded():
    """20 wins of 20: Bradley-Terry's Elo is +inf; the report says '>= x (unbounded)' with a note,
    not a finite score with a zero-width interval ("1645 (1645, 1645)")."""
    from rlhf.evaluation import reports

    wins = ev.win_matrix({(0, 1): 0.0}, 20, 2)  # policy 1 won all 20 games
    assert ev.unbounded_elo(wins).tolist() == [0, 1]
    three = ev.win_matrix({(0, 1): 12.0, (0, 2): 0.0, (1, 2): 0.5}, 20, 3)  # 2 lost only half a game: a tie links
    assert ev.unbounded_elo(three).tolist() == [0, 0, 0]
    three = ev.win_matrix({(0, 1): 12.0, (0, 2): 20.0, (1, 2): 20.0}, 20, 3)  # 2 lost every game
    assert ev.unbounded_elo(three).tolist() == [0, 0, -1]
    elo = ev.bradley_terry_elo(wins)
    settings = {"judge": "gold", "reward_fn": "gold", "verifier": False, "judge_name": "gold", "num_bootstrap": 10,
                "seed": 0, "num_prompts": 20, "dataset": "d", "do_sample": False, "max_completion_length": 8,
                "num_samples": 0, "group_by": "", "tie_margin": 0.0}
    score = {"score": 0.5, "score_ci_low": 0.4, "score_ci_high": 0.6, "score_seed_ci_low": 0.4, "score_seed_ci_high": 0.6}
    results = {"settings": settings,
               "pairwise": [{"policy_a": "b", "policy_b": "a", "wins": 20, "ties": 0, "losses": 0, "win_rate": 1.0,
                             "ci_low": 1.0, "ci_high": 1.0, "seed_ci_low": 1.0, "seed_ci_high": 1.0}],
               "elo": {name: {"elo": float(elo[i]), "ci_low": float(elo[i]), "ci_high": float(elo[i]),
                              "seed_ci_low": float(elo[i]), "seed_ci_high": float(elo[i]), "unbounded": u}
                       for i, (name, u) in enumerate(zip("ab", ev.unbounded_elo(wins).tolist()))},
               "policies": {name: {"runs": [name], "mean_length": 3.0, **score} for name in "ab"}}
    text = reports.markdown_report(results, ["a", "b"], None)
    assert f">= {elo[1]:.0f} (unbounded)" in text and "complete separation" in text
    assert f"{elo[1]:.0f} ({elo[1]:.0f}, {elo[1]:.0f})" not in text


# ---------------------------------------------------------------- each reward function, the cache's subsets
def test_nan_mean_cis_leaves_out_none_and_equals_mean_cis_without_it():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(2, 30))
    counts, run_counts, ones = ev.bootstrap_plan(30, [2], 300, seed=1)
    assert ev.nan_mean_cis(values, counts, run_counts, ones) == pytest.approx(ev.mean_cis(values, counts, run_counts, ones))
    holes = values.copy()
    holes[:, ::3] = np.nan  # a function that returned None on every third prompt
    mean, lo, hi, seed_lo, seed_hi = ev.nan_mean_cis(holes, counts, run_counts, ones)
    assert mean == pytest.approx(np.nanmean(holes)) and lo < mean < hi and seed_lo <= mean <= seed_hi
    # a function that applied to no completion: every number is NaN (reports show it as such), five of them
    nothing = ev.nan_mean_cis(np.full((2, 30), np.nan), counts, run_counts, ones)
    assert len(nothing) == 5 and all(isinstance(x, float) and np.isnan(x) for x in nothing)


def test_each_reward_function_beside_the_weighted_sum_and_a_cached_subset(tiny_folders, monkeypatch, capsys):
    """Two --reward_fn: each gets its own score (None left out), CI and win rate beside the weighted
    sum, in results.json, results.md and reward_win_rates.png; then --num_prompts 10 serves the first
    10 from the 24-prompt cache instead of generating again."""
    root = tiny_folders
    (root / "fns.py").write_text(
        "def length(completions, **kw):\n    return [float(len(c.split())) for c in completions]\n"
        "def chars(completions, **kw):  # None (not applicable) on the first prompt\n"
        "    return [None if i == 0 else float(len(c)) for i, c in enumerate(completions)]\n")
    flags = ["--reward_fn", f"{root / 'fns.py'}:length,{root / 'fns.py'}:chars", "--reward_weights", "1,2",
             "--num_bootstrap", "200", "--max_completion_length", "12", "--eval_batch_size", "8", "--do_sample",
             "--cache_dir", root / "cache_fns"]
    out = root / "fns"
    run_eval([root / "pi0", root / "pi1", "--output_dir", out, "--num_prompts", "24", *flags], monkeypatch, capsys)
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["reward_fns"] == ["length", "chars"]
    gens = read_jsonl(out / "generations.jsonl")
    for name in ("pi0", "pi1"):
        texts = [g["responses"][name] for g in gens]
        length = np.array([len(t.split()) for t in texts], float)
        chars = np.array([np.nan if i == 0 else float(len(t)) for i, t in enumerate(texts)])
        p = results["policies"][name]
        assert p["rewards"]["length"]["score"] == pytest.approx(length.mean())
        assert p["rewards"]["chars"]["score"] == pytest.approx(np.nanmean(chars))  # None left out
        assert p["score"] == pytest.approx(np.mean(length + 2 * np.nan_to_num(chars)))  # the weighted sum, as before
        r = p["rewards"]["length"]
        assert r["score_ci_low"] <= r["score"] <= r["score_ci_high"]
    (pair,) = [r for r in results["pairwise"] if (r["policy_a"], r["policy_b"]) == ("pi1", "pi0")]
    a = np.array([len(g["responses"]["pi1"].split()) for g in gens])
    b = np.array([len(g["responses"]["pi0"].split()) for g in gens])
    assert pair["rewards"]["length"]["win_rate"] == pytest.approx(np.mean((np.sign(a - b) + 1) / 2))
    report = (out / "results.md").read_text()
    assert "chars: win rate vs pi0 (95% CI)" in report and "| length (95% CI) |" in report
    assert (out / "reward_win_rates.png").stat().st_size > 1000

    stdout = run_eval([root / "pi0", root / "pi1", "--output_dir", root / "fns10", "--num_prompts", "10", *flags],
                      monkeypatch, capsys)
    assert stdout.count("responses from the cache") == 2 and "generated" not in stdout
    assert read_jsonl(root / "fns10" / "generations.jsonl") == gens[:10]


# ---------------------------------------------------------------- judges you configure
JUDGE_FILE = "Prompt: {prompt}\nFirst <<{a}>>\nSecond <<{b}>>\nJSON braces stay: {\"x\": 1}. Answer A or B:"


def test_judge_template_fills_once_and_is_checked(tmp_path, monkeypatch, capsys):
    from conftest import main_error

    assert judges.fill_template(JUDGE_FILE, "p", " {b} ", "two") == ("Prompt: p\nFirst <<{b}>>\nSecond <<two>>\n"
                                                                 "JSON braces stay: {\"x\": 1}. Answer A or B:")
    tok = world.build_tokenizer()  # no chat template: the question as the file writes it
    assert judges.judge_input(tok, [{"role": "user", "content": "hi"}], "x", "y", JUDGE_FILE).startswith("Prompt: user: hi\nFirst <<x>>")
    (tmp_path / "bad.txt").write_text("Which is better, {a} or the other?")
    message = main_error(ev, ["a", "b", "--judge", "llm:x", "--judge_template", str(tmp_path / "bad.txt")], monkeypatch, capsys)
    assert "--judge_template" in message and "lacks {prompt}, {b}" in message
    (tmp_path / "latin1.txt").write_bytes("Réponse {prompt} {a} {b}".encode("latin-1"))
    message = main_error(ev, ["a", "b", "--judge", "llm:x", "--judge_template", str(tmp_path / "latin1.txt")], monkeypatch, capsys)
    assert message.strip() == f"error: --judge_template {tmp_path / 'latin1.txt'} is not UTF-8 text (byte 1 is b'\\xe9'); save it as UTF-8."


def test_pairwise_reward_model_judge_is_position_debiased(tiny_folders, tmp_path, monkeypatch, capsys):
    """--judge pairwise:PATH: a one-logit sequence classifier shown both responses; a bias towards
    whichever comes first cancels (a vs a: exactly 0.5; P(a, b) + P(b, a) = 1), and eval.main uses it."""
    from transformers import AutoModelForSequenceClassification

    root = tiny_folders
    path = tmp_path / "pairrm"
    AutoModelForSequenceClassification.from_pretrained(root / "pi0", num_labels=1).save_pretrained(path)
    world.build_tokenizer().save_pretrained(path)
    model, tok = ev.common.load_reward_model(str(path), ev.Args(dtype="float32"))
    model.score.bias = torch.nn.Parameter(torch.tensor([3.0]))  # favours the first, whatever it is
    prompts, a, b = ["POST: alice bought the bike . TL;DR:"] * 2, [" alice bought bike .", " bob lost phone ."], [" bob sold car .", " a"]
    first = lambda p, f, s: judges.pairwise_first_better(model, tok, p, f, s)  # noqa: E731
    assert (first(prompts, a, b) > 0.8).all() and (first(prompts, b, a) > 0.8).all()
    np.testing.assert_allclose(judges.position_debiased(first, prompts, a, a), 0.5, atol=1e-7)
    np.testing.assert_allclose(judges.position_debiased(first, prompts, a, b) + judges.position_debiased(first, prompts, b, a), 1.0,
                               atol=1e-7)
    out = root / "pairwise"
    run_eval([root / "pi0", root / "pi1", "--output_dir", out, "--judge", f"pairwise:{path}", "--num_prompts", "8",
              "--num_bootstrap", "50", "--max_completion_length", "12", "--eval_batch_size", "8", "--do_sample",
              "--cache_dir", root / "cache"], monkeypatch, capsys)
    judgments = read_jsonl(out / "judgments.jsonl")
    assert len(judgments) == 3 * 8 and all(0 <= j["prob_a"] <= 1 for j in judgments)  # pi1 vs pi0, each vs the references
    assert all((j["winner"] == "tie") == (abs(j["prob_a"] - 0.5) <= 0.05) for j in judgments)


@pytest.fixture
def judge_server():
    """An OpenAI-compatible /chat/completions on 127.0.0.1 that prefers the longer of <<a>> and <<b>>
    with a position bias (the second must be 6 characters longer to win), under /ok; /slow never
    answers in time; /broken answers 500.
    Yields (base URL, the requests it received)."""
    import http.server
    import re
    import threading
    import time

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers.get("Authorization"), body))
            if self.path.startswith("/slow"):
                time.sleep(1.0)
            if self.path.startswith("/broken") or self.path.startswith("/slow"):
                self.send_response(500)
                self.end_headers()
                return
            a, b = re.findall(r"<<(.*?)>>", body["messages"][0]["content"], re.S)
            answer = "A" if len(a) + 5 >= len(b) else "B"  # longer wins, by more than 5 characters when shown second
            reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def test_http_judge_against_a_local_server(tiny_folders, judge_server, tmp_path, monkeypatch, capsys):
    """--judge http:MODEL with --judge_template: the longer response wins, lengths within the
    server's position bias tie (asked in both orders, it says "A" both times), the key comes from
    --judge_api_key_env; a server
    that answers 500 or too late stops the run in one sentence after 1 + --judge_max_retries tries,
    within the time those take."""
    import time

    from conftest import main_error

    url, seen = judge_server
    root = tiny_folders
    (tmp_path / "judge.txt").write_text(JUDGE_FILE)
    monkeypatch.setenv("MY_JUDGE_KEY", "sekret")
    flags = [root / "pi0", root / "pi1", "--judge", "http:judge-7b", "--judge_template", tmp_path / "judge.txt",
             "--judge_api_key_env", "MY_JUDGE_KEY", "--num_prompts", "8", "--num_bootstrap", "50", "--max_completion_length",
             "12", "--eval_batch_size", "8", "--do_sample", "--cache_dir", root / "cache"]
    out = tmp_path / "http"
    run_eval([*flags, "--output_dir", out, "--judge_base_url", f"{url}/ok/v1"], monkeypatch, capsys)
    gens = {g["prompt_id"]: g["responses"] for g in read_jsonl(out / "generations.jsonl")}
    judgments = read_jsonl(out / "judgments.jsonl")
    assert len(judgments) == 3 * 8  # pi1 vs pi0, each vs the references
    for j in judgments:
        la, lb = (len(gens[j["prompt_id"]][j[p]].strip()) for p in ("policy_a", "policy_b"))
        assert j["winner"] == ("a" if la > lb + 5 else "b" if lb > la + 5 else "tie")  # the bias cancels: a tie
    assert {(path, key, body["model"]) for path, key, body in seen} == {("/ok/v1/chat/completions", "Bearer sekret", "judge-7b")}

    for where, retries in (("broken", "2"), ("slow", "1")):
        seen.clear()
        start = time.time()
        message = main_error(ev, [*[str(f) for f in flags], "--output_dir", str(tmp_path / where), "--judge_base_url",
                                  f"{url}/{where}/v1", "--judge_timeout", "0.3", "--judge_max_retries", retries,
                                  "--num_prompts", "1"], monkeypatch, capsys)  # one question at a time
        assert f"--judge http:judge-7b: {url}/{where}/v1/chat/completions gave no answer in {1 + int(retries)} tries" in message
        assert "check --judge_base_url" in message and time.time() - start < 20
        assert len(seen) == 1 + int(retries)


def test_eval_warns_when_it_scores_a_policys_training_prompts(tmp_path, capsys):
    """A run whose args.json names the evaluated file as its training data: eval.py says its score
    measures what it saw in training; a file no run trained on is only noted as evaluated whole;
    the embedded world's test split against its train split is neither."""
    from types import SimpleNamespace

    import eval as eval_script

    data_file = tmp_path / "prompts.jsonl"
    data_file.write_text('{"prompt": "x"}\n')
    run = tmp_path / "run"
    run.mkdir()
    (run / "args.json").write_text(json.dumps({"dataset": str(data_file), "dataset_split": "train"}))
    args = SimpleNamespace(dataset=str(data_file), dataset_split="test")
    eval_script.warn_if_training_prompts(args, [("grpo", [str(run)])], "file")
    assert "was trained on" in capsys.readouterr().out
    other = tmp_path / "held_out.jsonl"
    other.write_text('{"prompt": "y"}\n')
    eval_script.warn_if_training_prompts(SimpleNamespace(dataset=str(other), dataset_split="test"), [("grpo", [str(run)])], "file")
    printed = capsys.readouterr().out
    assert "was trained on" not in printed and "every row of" in printed
    (run / "args.json").write_text(json.dumps({"dataset": "embedded", "dataset_split": "train"}))
    eval_script.warn_if_training_prompts(SimpleNamespace(dataset="embedded", dataset_split="test"), [("grpo", [str(run)])],
                                         "test split")
    assert capsys.readouterr().out == ""
