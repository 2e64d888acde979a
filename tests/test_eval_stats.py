"""eval.py's statistics against closed forms, with exact checks where the answer is exact: the
Elo of two players, a tie at exactly the margin, the two bootstrap levels (which interval holds
which, and that their random streams are independent), and main() reporting exactly what these
functions give on its own judgments."""

import json
import math

import numpy as np
import pytest
from conftest import run_main

import eval as ev
from worlds import world


# ---------------------------------------------------------------- Bradley-Terry Elo of two players
@pytest.mark.parametrize("wins, losses", [(7, 3), (30, 10), (1, 9), (5.5, 4.5)])
def test_two_player_elo_is_the_closed_form(wins, losses):
    """Two players, i won w games and lost l against the anchor: the maximum-likelihood p_i / p_0
    is w / l, so Elo_i = 1000 + 400 log10(w / l) without a prior; eval's prior adds one virtual
    drawn game (half a win each way): 1000 + 400 log10((w + 1/2) / (l + 1/2))."""
    matrix = np.array([[0.0, losses], [wins, 0.0]])  # [i, j]: games i won against j (player 1 is i)
    no_prior = ev.bradley_terry_elo(matrix, prior_games=0.0)
    assert no_prior[0] == 1000.0 and abs(no_prior[1] - (1000 + 400 * math.log10(wins / losses))) < 1e-6
    default = ev.bradley_terry_elo(matrix)  # the prior eval.main uses
    assert abs(default[1] - (1000 + 400 * math.log10((wins + 0.5) / (losses + 0.5)))) < 1e-6
    # and the same through win_matrix, from i's total score against the anchor over w + l games
    assert abs(ev.bradley_terry_elo(ev.win_matrix({(1, 0): wins}, wins + losses, 2))[1] - default[1]) < 1e-9


def test_expected_wins_inverts_the_two_player_elo():
    elo = ev.bradley_terry_elo(np.array([[0.0, 3.0], [7.0, 0.0]]), prior_games=0.0)
    assert abs(ev.expected_wins(elo[1], elo[0]) - 0.7) < 1e-9


# ---------------------------------------------------------------- ties
def test_a_judge_with_no_preference_is_a_tie_at_exactly_the_margin():
    """P(a better) = 0.5 with --tie_margin 0 is a tie, not a loss; at exactly the margin (values
    exact in binary) a tie, just beyond it a win or a loss. Equal scores tie."""
    assert ev.outcomes_from_probs([0.5], 0.0).tolist() == [0.5]
    assert ev.outcomes_from_probs([0.625, 0.375, 0.5], 0.125).tolist() == [0.5, 0.5, 0.5]
    assert ev.outcomes_from_probs([0.625 + 1e-9, 0.375 - 1e-9], 0.125).tolist() == [1.0, 0.0]
    assert ev.outcomes_from_scores([1.0, 2.0, 3.0], [1.0, 1.0, 4.0]).tolist() == [0.5, 1.0, 0.0]


# ---------------------------------------------------------------- the two bootstrap levels
def _runs(offsets, n=60, seed=0):
    """(R, n) 0/1 scores: one set of prompts, each run's success rate shifted by its offset."""
    base = np.random.default_rng(seed).uniform(0.2, 0.8, n)
    draws = np.random.default_rng(seed + 1).uniform(size=n)
    return np.array([(draws < np.clip(base + o, 0, 1)).astype(float) for o in offsets])


def test_seeds_and_prompts_interval_contains_the_prompts_only_one_and_equals_it_for_identical_runs():
    values = _runs([0.0, 0.0, 0.0])  # three runs that agree on every prompt
    counts, run_counts, ones = ev.bootstrap_plan(values.shape[1], [3], 2000, seed=0)
    mean, lo, hi, seed_lo, seed_hi = ev.mean_cis(values, counts, run_counts, ones)
    assert (seed_lo, seed_hi) == (lo, hi)  # resampling identical runs changes nothing
    values = _runs([-0.3, 0.0, 0.3])  # three runs far apart
    mean, lo, hi, seed_lo, seed_hi = ev.mean_cis(values, counts, run_counts, ones)
    assert mean == values.mean() and lo <= mean <= hi
    assert seed_lo < lo and hi < seed_hi  # the run level adds its spread on both sides
    # one run per method: the two-level interval is the prompt-only one, exactly
    counts1, run_counts1, ones1 = ev.bootstrap_plan(values.shape[1], [1], 2000, seed=0)
    one = ev.mean_cis(values[:1], counts1, run_counts1, ones1)
    assert one[1:3] == one[3:5]


def test_win_rate_stats_reports_each_interval_under_its_name():
    """win_rate_stats: ci_* are the prompt-only interval (runs fixed), seed_ci_* the two-level one."""
    a, b = _runs([-0.3, 0.0, 0.3]), _runs([0.0, 0.0], seed=5)
    outcomes = np.array([[ev.outcomes_from_scores(x, y) for y in b] for x in a])  # (3, 2, n)
    counts, run_counts, ones = ev.bootstrap_plan(outcomes.shape[-1], [3, 2], 2000, seed=1)
    stats = ev.win_rate_stats(outcomes, counts, run_counts, ones)
    _, lo, hi, seed_lo, seed_hi = ev.mean_cis(outcomes, counts, run_counts, ones)
    assert (stats["ci_low"], stats["ci_high"], stats["seed_ci_low"], stats["seed_ci_high"]) == (lo, hi, seed_lo, seed_hi)
    assert seed_hi - seed_lo > hi - lo


def test_the_two_levels_draw_from_independent_streams():
    """The runs' resamples come from a stream of their own: with as many runs as prompts, a
    shared stream would draw the very same indices for both levels (correlation 1)."""
    n, B = 8, 4000
    counts, (run_counts,), _ = ev.bootstrap_plan(n, [n], B, seed=3)
    corr = np.corrcoef(counts.ravel(), run_counts.ravel())[0, 1]
    assert abs(corr) < 0.05, corr
    again, (run_again,), _ = ev.bootstrap_plan(n, [n], B, seed=3)
    assert (again == counts).all() and (run_again == run_counts).all()  # deterministic in --seed
    other, (run_other,), _ = ev.bootstrap_plan(n, [n], B, seed=4)
    assert (other != counts).any() and (run_other != run_counts).any()


def test_num_bootstrap_sets_the_number_of_resamples():
    """--num_bootstrap: the resamples behind every interval (each draws n prompts, R runs)."""
    counts, (run_counts,), (ones,) = ev.bootstrap_plan(12, [3], num_bootstrap=37, seed=0)
    assert counts.shape == (37, 12) and run_counts.shape == ones.shape == (37, 3)
    assert (counts.sum(1) == 12).all() and (run_counts.sum(1) == 3).all() and (ones == 1).all()
    values = _runs([0.0, 0.1, 0.2])
    few = ev.group_stats(values, ["x"] * values.shape[1], num_bootstrap=20, seed=0)["x"]
    many = ev.group_stats(values, ["x"] * values.shape[1], num_bootstrap=2000, seed=0)["x"]
    assert few["score"] == many["score"] and (few["ci_low"], few["ci_high"]) != (many["ci_low"], many["ci_high"])


def test_group_by_reports_each_value_of_the_column():
    """--group_by: per value of the column, the mean over its prompts (and runs) with its own CIs."""
    values = _runs([0.0, 0.2], n=40)
    groups = ["easy" if i % 4 else "hard" for i in range(40)]
    out = ev.group_stats(values, groups, 500, 0)
    assert set(out) == {"easy", "hard"}
    for g, row in out.items():
        cols = [i for i, x in enumerate(groups) if x == g]
        assert row["n"] == len(cols) and row["score"] == values[:, cols].mean()
        assert row["ci_low"] <= row["score"] <= row["ci_high"] and row["seed_ci_low"] <= row["score"] <= row["seed_ci_high"]


# ---------------------------------------------------------------- main() reports what these give
def test_eval_main_reports_the_statistics_of_its_own_judgments(tmp_path, monkeypatch, capsys):
    """eval.main on two methods of two runs each: every pairwise number in results.json is
    win_rate_stats of the outcomes in judgments.jsonl under bootstrap_plan(n, runs, --num_bootstrap,
    --seed) (the prompt-only interval as ci_*, the two-level one as seed_ci_*), and the second
    method's Elo is the two-player closed form of its mean score against the anchor."""
    tok = world.build_tokenizer()
    paths = []
    for seed in range(4):
        path = tmp_path / f"pi{seed}"
        world.build_model(tok, hidden_size=32, num_layers=1, seed=seed).save_pretrained(path)
        tok.save_pretrained(path)
        paths.append(str(path))
    (tmp_path / "length.py").write_text("def length(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    out, n, B, seed = tmp_path / "out", 16, 300, 7
    run_main(ev, [f"a={paths[0]},{paths[1]}", f"b={paths[2]},{paths[3]}", "--reward_fn", f"{tmp_path}/length.py:length",
                  "--num_prompts", str(n), "--num_bootstrap", str(B), "--seed", str(seed), "--max_completion_length", "8",
                  "--do_sample", "--output_dir", str(out)], monkeypatch)
    results = json.loads((out / "results.json").read_text())
    judgments = [json.loads(line) for line in open(out / "judgments.jsonl")]
    value = {"a": 1.0, "tie": 0.5, "b": 0.0}
    runs = {"a": [f"a/pi0", "a/pi1"], "b": ["b/pi2", "b/pi3"]}
    outcomes = np.zeros((2, 2, n))
    for j in judgments:
        if (j["method_a"], j["method_b"]) == ("b", "a"):
            outcomes[runs["b"].index(j["policy_a"]), runs["a"].index(j["policy_b"]), j["prompt_id"]] = value[j["winner"]]
    counts, run_counts, ones = ev.bootstrap_plan(n, [2, 2], B, seed)
    expected = ev.win_rate_stats(outcomes, counts, [run_counts[1], run_counts[0]], [ones[1], ones[0]])
    (pair,) = [r for r in results["pairwise"] if (r["policy_a"], r["policy_b"]) == ("b", "a")]
    for key in ("win_rate", "ci_low", "ci_high", "seed_ci_low", "seed_ci_high", "wins", "ties", "losses"):
        assert pair[key] == expected[key], key
    assert pair["seed_ci_high"] - pair["seed_ci_low"] != pair["ci_high"] - pair["ci_low"]  # the runs differ
    # Elo: b scored W = mean over run pairs of its total against a in n games
    W = outcomes.sum(-1).mean()
    assert 0 < W < n
    elo_b = 1000 + 400 * math.log10((W + 0.5) / (n - W + 0.5))
    assert results["elo"]["a"]["elo"] == 1000.0 and abs(results["elo"]["b"]["elo"] - elo_b) < 1e-6


# ---------------------------------------------------------------- what the generated mutants showed unpinned
def test_every_prompt_and_every_run_can_be_drawn():
    """Each resample draws n of the n prompts with replacement: every prompt (the first too) is
    drawn once per resample on average; likewise every run."""
    counts, (run_counts,), _ = ev.bootstrap_plan(6, [3], 4000, seed=0)
    assert np.allclose(counts.mean(0), 1.0, atol=0.06) and np.allclose(run_counts.mean(0), 1.0, atol=0.06)
    assert (ev.resample_counts(ev.bootstrap_indices(6, 4000, 0), 6) == counts).all()


def test_batched_elo_is_the_elo_of_each_resample():
    """bradley_terry_elo on a stack of win matrices (B, k, k), as the bootstrap calls it, gives
    each matrix's own Elo."""
    g = np.random.default_rng(0)
    wins = g.uniform(0, 10, size=(5, 3, 3)) * (1 - np.eye(3))
    batched = ev.bradley_terry_elo(wins)
    for b in range(5):
        assert np.allclose(batched[b], ev.bradley_terry_elo(wins[b]), atol=1e-6)


def test_pass_at_k_stats_and_win_rate_stats_report_every_field():
    """pass@k over (runs, prompts, samples) with three different sizes, with both intervals under
    their names; win_rate_stats' prompt-only significance and run counts."""
    correct = np.random.default_rng(1).integers(0, 2, size=(2, 5, 4))  # 2 runs, 5 prompts, 4 samples
    counts, run_counts, ones = ev.bootstrap_plan(5, [2], 300, seed=0)
    stats = ev.pass_at_k_stats(correct, [1, 2], counts, run_counts, ones)
    for k in (1, 2):
        per_prompt = np.array([[ev.pass_at_k(4, int(c), k) for c in run.sum(-1)] for run in correct])
        expected = ev.mean_cis(per_prompt, counts, run_counts, ones)
        got = stats[f"pass@{k}"]
        assert (got["value"], got["ci_low"], got["ci_high"], got["seed_ci_low"], got["seed_ci_high"]) == expected
    outcomes = np.ones((3, 2, 20))  # a wins every game: significant on both levels
    counts, run_counts, ones = ev.bootstrap_plan(20, [3, 2], 200, seed=0)
    s = ev.win_rate_stats(outcomes, counts, run_counts, ones)
    assert s["prompt_significant"] and s["significant"] and (s["runs_a"], s["runs_b"], s["n"]) == (3, 2, 20)
    s = ev.win_rate_stats(np.full((3, 2, 20), 0.5), counts, run_counts, ones)
    assert not s["prompt_significant"] and not s["significant"] and s["ties"] == 120


def test_percentile_interval_and_unbounded_sides():
    """The 95% interval cuts 2.5% from each side; a policy that never won against the anchor's
    side has Elo -inf (-1), one that never lost +inf (+1)."""
    lo, hi = ev.percentile_ci(np.arange(1001) / 1000)
    assert math.isclose(lo, 0.025) and math.isclose(hi, 0.975)
    assert ev.unbounded_elo(np.array([[0.0, 5.0], [0.0, 0.0]])).tolist() == [0, -1]
    assert ev.unbounded_elo(np.array([[0.0, 0.0], [5.0, 0.0]])).tolist() == [0, 1]


def test_each_reward_functions_outcomes_read_its_own_column_and_tie_on_none():
    """function_outcomes: for every method pair and every pair of their runs, function j's outcome
    on a prompt is 1, 0.5 or 0 as its own column's scores compare (higher wins), and 0.5 where
    either response got None (NaN); the other column never enters."""
    nan = float("nan")
    fn_scores = {  # run -> (n prompts, K = 2 functions)
        "a0": np.array([[1.0, 5.0], [2.0, nan], [0.0, 1.0]]),
        "a1": np.array([[0.0, 0.0], [3.0, 2.0], [1.0, nan]]),
        "b0": np.array([[0.5, 1.0], [2.0, 1.0], [2.0, 0.0]]),
    }
    runs = {"a": ["a0", "a1"], "b": ["b0"]}
    got = ev.function_outcomes(fn_scores, ["first", "second"], runs, [("a", "b")])
    assert set(got) == {"first", "second"} and set(got["first"]) == {("a", "b")}

    def direct(x, y):
        return 0.5 if math.isnan(x) or math.isnan(y) else (1.0 if x > y else 0.0 if x < y else 0.5)

    for j, f in enumerate(["first", "second"]):
        out = got[f]["a", "b"]
        assert out.shape == (2, 1, 3)
        for r, ra in enumerate(runs["a"]):
            for i in range(3):
                assert out[r, 0, i] == direct(fn_scores[ra][i, j], fn_scores["b0"][i, j]), (f, ra, i)
    # the second function's outcomes differ from the first's: the columns are not mixed up
    assert got["first"]["a", "b"].tolist() == [[[1.0, 0.5, 0.0]], [[0.0, 1.0, 0.0]]]
    assert got["second"]["a", "b"].tolist() == [[[1.0, 0.5, 1.0]], [[0.0, 1.0, 0.5]]]
    assert ev.function_outcomes(fn_scores, [], runs, [("a", "b")]) == {}
