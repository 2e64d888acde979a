"""eval.py: compare policies by judged win rates with paired bootstrap CIs and Bradley-Terry Elo.

Every policy answers the same held-out prompts with the same sampling settings and seed; a judge
decides, prompt by prompt, which of two responses is better; the statistics say how sure we can
be. A point-estimate win rate on 200 prompts moves by +-0.07 from the prompts alone, so every
number here comes with a 95% confidence interval.

A policy is a folder (one training run) or a *method*: NAME=PATTERN[,PATTERN...], the runs of
one recipe over training seeds (`'grpo=runs/seed*/grpo'`; sweep.py trains them and prints the
command). A method's numbers average over its runs (win rates: over every pair of runs of the
two methods, on every prompt), and each gets two CIs side by side: the prompt-only one (the
runs fixed: is *this* run better than *that* run?) and the two-level one (each method's runs
resampled, then the prompts: is the *method* better, or was it a lucky seed? see `mean_cis`).
With one run per method the two are equal and every number is what a prompt-only eval gives.

- pairwise win rate of policy a over policy b (ties count half), for every pair of policies and
  for every policy against the dataset's references when it has them; its CI is a *paired*
  bootstrap: resample prompts with replacement, the same indices for both policies (and for every
  pair), so the per-prompt pairing that makes the comparison sharp is kept; percentile
  intervals (Efron & Tibshirani 1993, Ch. 13);
- Bradley-Terry Elo of every policy (Bradley & Terry 1952): P(i beats j) = p_i / (p_i + p_j),
  fitted by maximum likelihood on the pairwise win matrix with Hunter's (2004) MM iteration,
  reported on FastChat's Chatbot Arena scale: Elo_i = 1000 + 400 log10(p_i / p_first), so the
  first policy is the anchor at 1000 and 400 points are 10:1 odds; CIs from the same bootstrap;
- per policy: mean judge score +- CI (judges that give scores) and mean length in words, because
  length is the usual confound of judged win rates;
- with a *verifier* as the judge (a reward function whose every score is 0 or 1, such as the
  arithmetic world's `arith_strict`): the mean score is the accuracy (pass@1 of greedy
  decoding), the word count is left out, and with --num_samples n each policy also samples n
  completions per prompt at --temperature for pass@k, the chance that at least one of k
  samples is right, by the unbiased estimator of Chen et al. 2021 (Codex, Eq. 1):
      pass@k = mean over prompts of 1 - C(n - c, k) / C(n, k),  c = correct samples of n,
  with a bootstrap CI over prompts like every other number; --group_by COLUMN adds the
  accuracy per value of a dataset column (e.g. `level`, `carry_trap` on the arithmetic world).

Judges (--judge):
- `gold`: a reward function, higher wins: by default the embedded world's gold judge (which
  needs the `post` column, as in the embedded test split), or --reward_fn arith_strict /
  arith_lenient (the arithmetic world's verifiers) or file.py:fn, called as TRL calls reward
  functions (common.call_reward_fns), greedy and pass@k alike; several (comma-separated) are
  summed with --reward_weights, as in grpo.py, and each is also reported on its own beside the
  sum (its mean over the completions it scores, its CI and its win rates: reward_win_rates.png).
  Reports name the judge after the function(s);
- `rm:PATH`: a reward model saved by reward.py, higher wins;
- `llm:MODEL`: a local causal LM asked which of two responses is better. It is asked in both
  orders and P("A") vs P("B") is read from its next-token logits; averaging the two orders
  cancels position bias (Zheng et al. 2023, MT-Bench): a judge that always says "A" gives 0.5.
  A comparison whose averaged P(a better) is within --tie_margin (0.05) of 0.5 is a tie: a judge
  with no preference (a random one says 0.50004) must not hand out wins. Outside the margin the
  more likely side wins the whole game (not a fractional P(a) win), as with score judges;
- `pairwise:PATH`: a sequence classifier with one logit (AutoModelForSequenceClassification,
  num_labels 1) shown the prompt and both responses in one input, as pairwise reward models
  such as PairRM are used: P(the first is better) = sigmoid(logit); asked in both orders and
  tied within --tie_margin, as the LLM judge;
- `http:MODEL`: an OpenAI-compatible server (a vLLM server, an API) at --judge_base_url, the key
  from the environment variable --judge_api_key_env: POST /chat/completions with the question,
  P(A) from the answer token's top log-probs where the server gives them (finite), else from the
  answer, exactly A (1) or B (0): any other answer stops the run in one sentence naming it; asked
  in both orders, ties as above. Every request has --judge_timeout seconds in all (a server that
  sends one byte a second is cut off), a reply of at most 1 MB, no redirect followed (the key
  would go with it), and is tried 1 + --judge_max_retries times; then the run stops in one
  sentence (the generations stay cached).
The question the llm, pairwise and http judges (rlhf/evaluation/judges.py) read is its JUDGE_TEMPLATE, or --judge_template FILE
with {prompt}, {a} and {b} where the prompt and the two responses go.

Departures and choices:
- identical responses are a tie, whatever the judge (no judge call is made for them);
- a pair of methods is judged on every pair of their runs: R_a x R_b comparisons per prompt
  (free for score judges, R_a x R_b times the calls for --judge llm);
- Bradley-Terry gets one virtual drawn game per pair of policies (a weak prior), so a policy
  that wins or loses every game still gets a finite Elo; it shrinks Elo gaps a little (200
  prompts at a 70% win rate: by under 1 point, far inside the CI). Under complete separation
  (a policy won, or lost, every game against the other side) the true Elo is unbounded:
  results.json marks it (`unbounded`: +1 / -1) and results.md prints `>= x` / `<= x`, x the
  prior's value, with no interval (`unbounded_elo`);
- the embedded world's test split is always the world of seed 0 (as in common.gold_eval), so
  --seed changes the sampling and the bootstrap, never the prompts;
- generations are cached in --cache_dir (default <output_dir>/cache), keyed by the policy (path
  and a SHA-256 of its weight files' content), the rendered prompts and the generation settings,
  so a re-run with another judge does not generate again, nor one on fewer of the same prompts
  (--num_prompts 10 after 30 reuses those 10 responses; on more, only the new prompts are
  generated: --num_prompts 0 after 300 of 523; --num_samples 4 after 8 takes each
  prompt's first 4 samples); a cache file that cannot be read is named, moved aside to
  FILE.unreadable and generated again (policies.py: the methods, their runs' names, and the cache).

Run:
    python eval.py runs/sft runs/ppo runs/dpo runs/grpo                   # gold judge -> runs/eval
    python eval.py sft=runs/sft 'grpo=runs/seed*/grpo' 'mine=runs/seed*/my_grpo'   # methods over seeds
    python eval.py runs/sft runs/dpo --judge rm:runs/reward --output_dir runs/eval_rm
    python eval.py runs/sft runs/dpo --judge llm:Qwen/Qwen2.5-7B-Instruct --dataset prompts.jsonl
    python eval.py runs/sft runs/dpo --judge http:Qwen/Qwen2.5-7B-Instruct --judge_base_url http://localhost:8000/v1 \
        --judge_template my_judge.txt --dataset prompts.jsonl       # a `vllm serve` judge, your question
    python eval.py sft=runs/sft_arith 'grpo=runs/grpo_arith/grpo/seed*' --dataset embedded:arith \
        --reward_fn arith_strict --num_samples 16 --group_by carry_trap --output_dir runs/eval_arith   # pass@k
"""

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from rlhf import checkpoints
import common
from rlhf import data
from rlhf.evaluation import judges
from rlhf.evaluation import policies
from rlhf.evaluation import reports
from rlhf import sampling
from rlhf import vllm_rollouts
from worlds import world
from common import ModelArgs, VllmArgs
from rlhf.evaluation.policies import REFERENCE

CI_LEVEL = 0.95
BT_PRIOR_GAMES = 1.0  # virtual drawn games per pair of policies (see the module docstring)


@dataclass
class Args(VllmArgs, ModelArgs):
    # model and data
    policies: list[str] = field(default_factory=list, metadata={"help": "Policies to compare (also accepted as bare arguments: python eval.py runs/sft runs/dpo): a folder or Hub id, or NAME=PATTERN[,PATTERN...], a method whose runs (training seeds) are the folders matching the glob patterns (quote them: 'grpo=runs/seed*/grpo'). The first is the Elo anchor."})
    model: str = field(default="", metadata={"help": argparse.SUPPRESS})  # not a flag here: the policies are arguments
    output_dir: str = field(default="", metadata={"help": "Where results.json, results.md, judgments.jsonl, generations.jsonl, the plots and (without --cache_dir) the generation cache go (default: runs/eval)."})
    seed: int = field(default=0, metadata={"help": "Seed of the sampling (the same for every policy; with --do_sample or --num_samples) and of the bootstrap resamples; the prompts do not depend on it (an embedded world's test split is always seed 0's)."})
    dataset_split: str = field(default="test", metadata={"help": "Split of --dataset to evaluate on (Hub datasets and folders)."})
    prompt_column: str = field(default="prompt", metadata={"help": "Column of --dataset holding the prompts (text or {role, content} messages)."})
    reference_column: str = field(default="reference", metadata={"help": "Column of reference responses, compared against when present ('' to ignore)."})
    num_prompts: int = field(default=0, metadata={"help": "Evaluate on the first this-many prompts (0: all)."})
    cache_dir: str = field(default="", metadata={"help": "Where generations are cached (a re-run with another judge reuses them); empty: <output_dir>/cache."})
    # generation
    max_completion_length: int = field(default=48, metadata={"help": "Tokens generated per response (48, as in common.gold_eval)."})
    do_sample: bool = field(default=False, metadata={"help": "Sample instead of greedy decoding (seeded with --seed, the same for every policy)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (with --do_sample)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold (with --do_sample)."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling (with --do_sample; 0: off)."})
    # judge and statistics
    judge: str = field(default="gold", metadata={"help": "gold (--reward_fn, default the embedded gold judge) | rm:PATH (reward model from reward.py) | llm:MODEL (local causal LM, asked in both orders) | pairwise:PATH (a sequence classifier with one logit, shown both responses: P(first better) = sigmoid(logit), asked in both orders) | http:MODEL (an OpenAI-compatible server at --judge_base_url, e.g. vLLM's, asked in both orders)."})
    judge_template: str = field(default="", metadata={"help": "A text file with the question the llm, pairwise and http judges are asked, holding {prompt}, {a} and {b} (the two responses); with --judge llm the answer letter, A or B, must come next. Default: rlhf/evaluation/judges.py's JUDGE_TEMPLATE."})
    judge_base_url: str = field(default="", metadata={"help": "With --judge http:MODEL: the server's OpenAI-compatible base URL, e.g. http://localhost:8000/v1 (vllm serve MODEL); POST <url>/chat/completions (a query string, such as Azure's ?api-version=, stays at the end)."})
    judge_api_key_env: str = field(default="OPENAI_API_KEY", metadata={"help": "With --judge http: the environment variable holding the API key, sent as a Bearer token (unset: no key sent)."})
    judge_timeout: float = field(default=60.0, metadata={"help": "With --judge http: seconds one request may take in all (connection, reply) before it is tried again."})
    judge_max_retries: int = field(default=3, metadata={"help": "With --judge http: tries after a failed one (timeout, refused connection, 5xx) before the run stops."})
    reward_fn: str = field(default="gold", metadata={"help": "With --judge gold: comma-separated reward functions: 'gold' (the embedded world's judge), arith_strict | arith_lenient (the arithmetic world's verifiers), reasoning_gym_strict, humaneval, file.py:function or a module's function (trl.rewards:accuracy_reward), called by keyword as TRL calls them (docs/usage.md)."})
    reward_weights: str = field(default="", metadata={"help": "Comma-separated weights, one per --reward_fn (default: all 1); the judge's score is the weighted sum over the functions that do not return None, as in grpo.py."})
    num_samples: int = field(default=0, metadata={"help": "n: completions sampled per prompt at --temperature for pass@k, with a verifier as the judge (0: off)."})
    pass_k: str = field(default="", metadata={"help": "Comma-separated k for pass@k, each at most --num_samples (default: 1, 2, 4, ... up to --num_samples)."})
    group_by: str = field(default="", metadata={"help": "A dataset column: also report the score per value of it (e.g. level, carry_trap on embedded:arith)."})
    num_bootstrap: int = field(default=1000, metadata={"help": "Bootstrap resamples (of the prompts, and of each method's runs) for every confidence interval."})
    tie_margin: float = field(default=0.05, metadata={"help": "With --judge llm, pairwise or http: a comparison whose position-swapped P(a is better) is within this of 0.5 is a tie (the judge has no preference)."})


# ============================================================================ statistics
def outcomes_from_scores(score_a, score_b):
    """Per-prompt result of a against b: 1 win, 0.5 tie, 0 loss (higher score wins): (n,)."""
    return (np.sign(np.asarray(score_a, float) - np.asarray(score_b, float)) + 1) / 2


def outcomes_from_probs(prob_a, tie_margin):
    """Per-prompt result of a against b from a judge's P(a is better) (n,): a tie when the
    probability is within tie_margin of 0.5 (the judge has no preference), else 1 or 0."""
    prob_a = np.asarray(prob_a, float)
    return np.where(np.abs(prob_a - 0.5) <= tie_margin, 0.5, (prob_a > 0.5).astype(float))


def function_outcomes(fn_scores, fn_names, runs, pairs):
    """Each reward function's outcomes on its own column of `fn_scores` ({run: (n, K)}), judged as
    the weighted sum is (higher wins), with a tie where it returned None (NaN) for either response:
    {function: {(a, b): (R_a, R_b, n)}} over the method pairs and their runs."""
    return {f: {(a, b): np.array([[np.nan_to_num(outcomes_from_scores(fn_scores[ra][:, j], fn_scores[rb][:, j]), nan=0.5)
                                   for rb in runs[b]] for ra in runs[a]]) for a, b in pairs}
            for j, f in enumerate(fn_names)}


def bootstrap_indices(n, num_bootstrap, seed):
    """Prompt indices of each bootstrap resample, shared by every statistic: (B, n)."""
    return np.random.default_rng(seed).integers(0, n, size=(num_bootstrap, n))


def resample_counts(idx, n):
    """How often each of n units is drawn in each resample, from the drawn indices (B, m): (B, n)."""
    counts = np.zeros((idx.shape[0], n))
    np.add.at(counts, (np.arange(idx.shape[0])[:, None], idx), 1)
    return counts


def bootstrap_plan(n, num_runs, num_bootstrap, seed):
    """The resamples behind every CI: prompt counts (B, n), shared by all policies (paired), and
    per method the run counts of the two-level bootstrap (B, R_m) and of the prompt-only one (all
    ones: every run kept once). The prompts are drawn as bootstrap_indices(n, B, seed), so one run
    per method gives exactly the numbers of a prompt-only bootstrap; the runs come from a second
    stream, one method after the other."""
    prompt_counts = resample_counts(bootstrap_indices(n, num_bootstrap, seed), n)
    rng = np.random.default_rng([seed, 1])
    run_counts = [resample_counts(rng.integers(0, r, size=(num_bootstrap, r)), r) for r in num_runs]
    all_runs = [np.ones((num_bootstrap, r)) for r in num_runs]
    return prompt_counts, run_counts, all_runs


def resampled_totals(values, prompt_counts, run_counts):
    """Bootstrap replicates of sum_i v_i over the prompts, averaged over runs: (B,).

    values: (R_1, .., R_k, n), one row of per-prompt values per run (k = 1: one method's scores)
    or per pair of runs (k = 2: outcomes of method a's runs against method b's). prompt_counts
    (B, n) and run_counts [(B, R_j)] say how often each prompt and each run is drawn in each
    resample; the prompts are the same for every run (paired). Replicate b is
        T*_b = sum_{r_1..r_k} (c_b,r_1 / R_1) .. (c_b,r_k / R_k) sum_i w_b,i v_{r_1..r_k, i},
    the total over the resampled prompts, averaged over the resampled runs; its mean is T*_b / n.
    """
    totals = np.moveaxis(values @ prompt_counts.T, -1, 0)  # (B, R_1, .., R_k): each run on the resampled prompts
    for counts in run_counts:  # average over the resampled runs of each level, first axis first
        totals = np.einsum("br...,br->b...", totals, counts) / counts.shape[1]
    return totals  # (B,)


def percentile_ci(samples, level=CI_LEVEL):
    """Percentile bootstrap interval over the first axis."""
    lo, hi = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2], axis=0)
    return lo, hi


def mean_cis(values, prompt_counts, run_counts, all_runs):
    """Mean of values (R_1, .., R_k, n) over runs and prompts, with its prompt-only CI (runs
    fixed) and its two-level CI (runs, then prompts, resampled): (mean, lo, hi, seed_lo, seed_hi).

    Two-level bootstrap (Davison & Hinkley 1997, Sec. 3.8, hierarchical data; Owen 2007, "The
    pigeonhole bootstrap", for crossed factors such as runs x prompts): draw each method's runs
    with replacement, independently of the prompts, draw the prompts with replacement (the same
    for every run), recompute the mean; the percentile interval of the replicates is the CI.
    For a win rate of method a (runs r = 1..R_a) over b (runs s = 1..R_b) on n prompts:
        theta    = 1/(R_a R_b n) sum_{r,s,i} o_rsi
        theta*_b = sum_{r,s} (c_br / R_a) (d_bs / R_b) sum_i (w_bi / n) o_rsi
    with run counts c_b ~ Multinomial(R_a, 1/R_a), d_b ~ Multinomial(R_b, 1/R_b) and prompt counts
    w_b ~ Multinomial(n, 1/n) shared by every run; the prompt-only CI sets c = d = 1.
    The two-level CI answers "would another set of training seeds and prompts give the same
    number?", the prompt-only one "would other prompts, for these very runs?". Resampling both
    factors overstates the run x prompt interaction's share (Owen 2007), so with many runs the
    interval is slightly conservative; with few (R = 3) it is too narrow, as every bootstrap of
    R clusters is (variance shrunk by (R - 1) / R, few distinct resamples): see
    tests/test_eval.py::test_two_level_bootstrap_coverage for the measured coverage.
    """
    n = values.shape[-1]
    mean = float(values.mean())
    lo, hi = percentile_ci(resampled_totals(values, prompt_counts, all_runs) / n)
    seed_lo, seed_hi = percentile_ci(resampled_totals(values, prompt_counts, run_counts) / n)
    return mean, float(lo), float(hi), float(seed_lo), float(seed_hi)


def nan_mean_cis(values, prompt_counts, run_counts, all_runs):
    """mean_cis of values (R_1, .., R_k, n) with NaN (a reward function that returned None) left
    out: each replicate is the ratio of the resampled totals of the values and of the rows that
    have one, which is mean_cis itself when no value is NaN; a replicate that drew no value is
    left out of the interval."""
    has = ~np.isnan(values)
    if not has.any():
        return (float("nan"),) * 5
    v = np.where(has, values, 0.0)

    def replicates(counts):
        with np.errstate(invalid="ignore", divide="ignore"):
            boot = resampled_totals(v, prompt_counts, counts) / resampled_totals(has.astype(float), prompt_counts, counts)
        return boot[np.isfinite(boot)]

    lo, hi = percentile_ci(replicates(all_runs))
    seed_lo, seed_hi = percentile_ci(replicates(run_counts))
    return float(v.sum() / has.sum()), float(lo), float(hi), float(seed_lo), float(seed_hi)


def pass_at_k(n, c, k):
    """Unbiased pass@k of one prompt from n samples with c correct (Chen et al. 2021, Eq. 1):
    1 - C(n - c, k) / C(n, k), as a running product (no huge binomials)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_k_stats(correct, ks, prompt_counts, run_counts, all_runs):
    """pass@k for each k, averaged over a method's runs and prompts, with both CIs (mean_cis), from
    the verifier's 0/1 score of every sample: correct (R, prompts, num_samples)."""
    correct = np.asarray(correct)  # (R, prompts, num_samples) of 0 / 1
    n = correct.shape[-1]
    out = {}
    for k in ks:
        per_prompt = np.array([[pass_at_k(n, int(c), k) for c in run.sum(-1)] for run in correct])  # (R, prompts)
        value, lo, hi, seed_lo, seed_hi = mean_cis(per_prompt, prompt_counts, run_counts, all_runs)
        out[f"pass@{k}"] = {"value": value, "ci_low": lo, "ci_high": hi, "seed_ci_low": seed_lo, "seed_ci_high": seed_hi}
    return out


def is_binary(values):
    return bool(np.isin(np.asarray(values, float), (0.0, 1.0)).all())


def group_stats(values, groups, num_bootstrap, seed):
    """Mean of per-prompt values (R, n) within each value of a dataset column, each with its own
    bootstrap CIs over that group's prompts: prompt-only (runs fixed) and two-level (runs, then
    prompts; the same as the prompt-only one with one run)."""
    values, out = np.asarray(values, float), {}
    for g in sorted(set(groups), key=str):
        sub = values[:, [i for i, x in enumerate(groups) if x == g]]  # (R, n_g)
        counts, run_counts, ones = bootstrap_plan(sub.shape[1], [sub.shape[0]], num_bootstrap, seed)
        value, lo, hi, seed_lo, seed_hi = mean_cis(sub, counts, run_counts, ones)
        out[str(g)] = {"score": value, "ci_low": lo, "ci_high": hi, "seed_ci_low": seed_lo, "seed_ci_high": seed_hi,
                       "n": sub.shape[1]}
    return out


def win_rate_stats(outcomes, prompt_counts, run_counts=None, all_runs=None):
    """Win rate of method a over method b with both CIs and significance flags.

    outcomes: (R_a, R_b, n), each of a's runs against each of b's on every prompt (or (n,) for
    one run each); run_counts / all_runs: the two-level and the prompt-only run counts of a and
    b (default: one run each). The win rate is the mean over run pairs and prompts; `significant`
    uses the two-level CI (equal to the prompt-only one with one run per method)."""
    outcomes = np.asarray(outcomes, float)
    if outcomes.ndim == 1:
        outcomes = outcomes[None, None]
    ones = [np.ones((prompt_counts.shape[0], r)) for r in outcomes.shape[:2]]
    win_rate, lo, hi, seed_lo, seed_hi = mean_cis(outcomes, prompt_counts, run_counts or ones, all_runs or ones)
    return {"win_rate": win_rate, "ci_low": lo, "ci_high": hi, "seed_ci_low": seed_lo, "seed_ci_high": seed_hi,
            "significant": bool(seed_lo > 0.5 or seed_hi < 0.5), "prompt_significant": bool(lo > 0.5 or hi < 0.5),
            "n": outcomes.shape[-1], "runs_a": outcomes.shape[0], "runs_b": outcomes.shape[1],
            "wins": int((outcomes == 1).sum()), "ties": int((outcomes == 0.5).sum()), "losses": int((outcomes == 0).sum())}


def win_matrix(totals, games, k):
    """wins[..., i, j]: games i won against j, ties counting half to each: (..., k, k).

    totals: {(i, j): i's total score against j (...)}, one entry per pair; games: games per pair."""
    first = next(iter(totals.values()))
    wins = np.zeros(np.shape(first) + (k, k))
    for (i, j), t in totals.items():
        wins[..., i, j] += t
        wins[..., j, i] += games - t
    return wins


def bradley_terry_elo(wins, prior_games=BT_PRIOR_GAMES, max_iter=100_000, tol=1e-10):
    """Bradley-Terry maximum likelihood on a win matrix (..., k, k), as Elo (..., k) anchored
    at 1000 on player 0 (FastChat's scale: 400 log10 odds).

    Model: P(i beats j) = p_i / (p_i + p_j) (Bradley & Terry 1952). MM update (Hunter 2004):
    p_i <- W_i / sum_j n_ij / (p_i + p_j), with W_i the wins of i and n_ij the
    games between i and j; each step raises the likelihood, and a tie is half a win to each
    side. `prior_games` virtual draws per pair keep every p_i finite and positive.
    """
    k = wins.shape[-1]
    wins = wins + prior_games / 2 * (1 - np.eye(k))  # virtual draws: half a win each way
    games = wins + np.swapaxes(wins, -1, -2)  # n_ij, (..., k, k), zero diagonal
    total_wins = wins.sum(-1)  # W_i, (..., k)
    p = np.ones(wins.shape[:-1])
    for _ in range(max_iter):
        new = total_wins / (games / (p[..., :, None] + p[..., None, :])).sum(-1)
        new = new / np.exp(np.log(new).mean(-1, keepdims=True))  # fix the scale: geometric mean 1
        done = np.abs(np.log(new) - np.log(p)).max() < tol
        p = new
        if done:
            break
    return 1000 + 400 * np.log10(p / p[..., :1])


def unbounded_elo(wins):
    """Which Elo is unbounded (complete separation): Bradley-Terry's maximum likelihood gives
    policy i a finite Elo relative to the anchor (policy 0) only if each beat the other through a
    chain of wins (ties count half, so a tie links both ways). Returns (k,): +1 where i's Elo is
    +inf (it and the policies it reaches never lost to the anchor's side), -1 where it is -inf,
    0 where finite. `wins`: the point win matrix (k, k) without the prior's virtual draws."""
    k = wins.shape[0]
    reach = (wins > 0) | np.eye(k, dtype=bool)  # i won something against j
    for m in range(k):  # transitive closure (Warshall)
        reach = reach | (reach[:, m:m + 1] & reach[m:m + 1, :])
    return np.where(reach[0] & reach[:, 0], 0, np.where(reach[:, 0], 1, -1))


def expected_wins(elo_a, elo_b):
    """P(a beats b) on the Elo scale: 1 / (1 + 10^((Elo_b - Elo_a) / 400))."""
    return 1 / (1 + 10 ** ((elo_b - elo_a) / 400))


# ============================================================================ pass@k and the judges
def pass_ks(args):
    """--pass_k as a list of ints, each in 1..--num_samples (default 1, 2, 4, ... up to it)."""
    if not args.pass_k:
        return sorted({2 ** i for i in range(args.num_samples.bit_length()) if 2 ** i <= args.num_samples} | {args.num_samples})
    try:
        ks = sorted({int(k) for k in args.pass_k.split(",")})
    except ValueError:
        common.fail(f"--pass_k {args.pass_k!r}: expected comma-separated integers, e.g. 1,4,16.")
    if ks[0] < 1 or ks[-1] > args.num_samples:
        common.fail(f"--pass_k {args.pass_k}: every k must be between 1 and --num_samples {args.num_samples}.")
    return ks


def warn_if_training_prompts(args, methods, split):
    """A score on the prompts a policy trained on measures memory, not skill: say so when a run's
    args.json names the evaluated dataset as its training data, or, for a file evaluated whole,
    that no held-out split was chosen."""
    evaluated = os.path.abspath(args.dataset) if os.path.exists(args.dataset) else args.dataset
    for name, paths in methods:
        for path in paths:
            try:
                with open(os.path.join(path, "args.json")) as f:
                    run_args = json.load(f)
            except (OSError, ValueError):
                continue  # a Hub model or a folder saved elsewhere: its training data is unknown
            trained = run_args.get("dataset", "")
            trained = os.path.abspath(trained) if os.path.exists(trained) else trained
            same_split = run_args.get("dataset_split", "train") == args.dataset_split
            if trained == evaluated and (os.path.isfile(args.dataset) or same_split):
                print(f"eval: warning: {name} ({path}) was trained on {data.dataset_name(args.dataset)}, the prompts "
                      "evaluated here: its score measures what it saw in training. Pass held-out prompts (--dataset).")
                return
    if split == "file":
        print(f"eval: note: every row of {args.dataset} is evaluated; if a policy trained on these prompts, pass a "
              "held-out file instead.")


def judge_name(kind, args):
    """The judge as reports name it: the reward functions by their own names, else the --judge spec."""
    if kind != "gold":
        return args.judge
    if args.reward_fn == "gold":
        return "gold"
    fns, _ = common.load_reward_fns(args.reward_fn, args.reward_weights)
    return ",".join(getattr(fn, "__name__", str(fn)) for fn in fns)


def parse_judge(spec):
    """--judge -> (kind, argument)."""
    kind, _, arg = spec.partition(":")
    if kind == "gold" and not arg:
        return kind, None
    if kind in ("rm", "llm", "pairwise", "http") and arg:
        return kind, arg
    common.fail(f"--judge {spec!r}: expected gold, rm:PATH (a reward model from reward.py), llm:MODEL (a causal LM), "
                "pairwise:PATH (a sequence classifier shown both responses) or http:MODEL (with --judge_base_url).")


def judge_scores(kind, arg, responses, raw_prompts, columns, args, completion_ids=None, group_size=1):
    """Score-based judges: {name: (n,) scores} for every policy and the references. Both get what
    they get in training (sampling.reward_completions): reward functions TRL's form of the text
    and TRL's keywords (their weighted sum over those that do not return None; a completion none
    applies to stops the run), a reward model reward.py's rendering of it through its own chat
    template. `completion_ids`: {name: token id lists}; rows in groups of `group_size` (pass@k).
    Returns (scores, per-function scores {name: (n, K)}, NaN where a function returned None; None
    for a reward model)."""
    completions = {name: sampling.reward_completions(raw_prompts, texts) for name, texts in responses.items()}
    if kind == "gold":
        fns, weights = common.load_reward_fns(args.reward_fn, args.reward_weights)
        ids = completion_ids or {}
        per_fn = {name: common.call_reward_fns(fns, raw_prompts, c, ids.get(name), columns, group_size)
                  for name, c in completions.items()}  # (n, K) each
        return ({name: common.weighted_rewards(s, weights).double().numpy() for name, s in per_fn.items()},
                {name: s.double().numpy() for name, s in per_fn.items()})
    model, tokenizer = common.load_reward_model(arg, args)
    return {name: sampling.score_texts(model, tokenizer, raw_prompts, c, args.eval_batch_size).double().numpy()
            for name, c in completions.items()}, None


def reward_fn_names(args):
    """The --reward_fn functions' names, as the reports' columns name them (numbered where two are equal)."""
    fns, _ = common.load_reward_fns(args.reward_fn, args.reward_weights)
    names = [getattr(fn, "__name__", str(fn)) for fn in fns]
    return [f"{n}_{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


# ============================================================================ main
def main():
    # policies come first as bare arguments; HfArgumentParser parses --flags only
    argv = sys.argv[1:]
    n_bare = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    sys.argv[1:] = (["--policies", *argv[:n_bare]] if n_bare else []) + argv[n_bare:]
    args = common.parse_args(Args)
    args.cache_dir = args.cache_dir or os.path.join(args.output_dir, "cache")
    if args.model:
        common.fail("eval.py takes the policies as arguments: python eval.py runs/sft runs/dpo [--flags].")
    if not args.policies:
        common.fail("no policies to compare: python eval.py runs/sft runs/ppo runs/dpo runs/grpo [--flags].")
    if args.num_bootstrap < 1 or args.num_prompts < 0 or args.num_samples < 0 or not 0 <= args.tie_margin < 0.5:
        common.fail("--num_bootstrap must be at least 1, --num_prompts and --num_samples at least 0, "
                    "and --tie_margin in [0, 0.5).")
    if args.use_vllm:  # the policies' responses (greedy, or --do_sample, --num_samples) from a vLLM engine
        vllm_rollouts.check_args(args)
    kind, judge_arg = parse_judge(args.judge)
    methods = policies.parse_methods(args.policies)
    ks = pass_ks(args) if args.num_samples else []
    if args.num_samples and kind != "gold":
        common.fail("--num_samples (pass@k) needs a verifier as the judge: --judge gold --reward_fn arith_strict (or file.py:fn returning 0 or 1).")
    if kind == "gold" and args.reward_fn != "gold":
        common.load_reward_fns(args.reward_fn, args.reward_weights)  # fail now, not after generating
    template = judges.load_judge_template(args.judge_template)  # fail now, not after generating
    if args.judge_template and kind not in ("llm", "pairwise", "http"):
        common.fail(f"--judge_template is the question of the llm, pairwise and http judges; --judge {args.judge} asks none.")
    if kind == "http" and not args.judge_base_url.startswith(("http://", "https://")):
        common.fail(f"--judge {args.judge} needs --judge_base_url, the server's OpenAI-compatible base URL "
                    "(e.g. http://localhost:8000/v1 for `vllm serve MODEL`).")
    if args.judge_timeout <= 0 or args.judge_max_retries < 0:
        common.fail("--judge_timeout must be positive and --judge_max_retries at least 0.")
    paths = [p for _, run_paths in methods for p in run_paths]
    for path in paths + ([judge_arg] if kind in ("rm", "llm", "pairwise") else []):  # fail now, not after generating
        common.check_model_source(path)
        if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
            common.fail(f"{path} holds no model (no config.json): run the script that writes it first "
                        "(sft.py, reward.py, ppo.py, dpo.py or grpo.py).")

    # ---- data: prompts, optional references, and the other columns for reward functions
    if args.dataset == common.EMBEDDED:
        ds = common.embedded_world()["test"]  # seed 0, as common.gold_eval
        split = "test split"
    elif args.dataset.startswith(common.ARITH):
        ds = common.arith_split(args.dataset, "test")  # seed 0, as the summarization world
        split = "test split"
    elif args.dataset == common.CODE:
        ds = common.code_split("test")  # seed 0, as the other worlds
        split = "test split"
    elif args.dataset == common.IFEVAL:
        ds = common.ifeval_split("test")  # the same for every seed
        split = "test split"
    elif data.is_task(args.dataset):
        ds = data.named_data(args.dataset, "test", "test", 0)  # the test split, the same for every seed
        split = "test split"
    else:
        ds = data.load_data(args.dataset, args.dataset_split)
        split = f"split {args.dataset_split}" if not os.path.isfile(args.dataset) else "file"
    data.require_columns(ds, [args.prompt_column], args.dataset, "Pass --prompt_column.")
    if args.num_prompts:
        ds = ds.select(range(min(args.num_prompts, len(ds))))
    data.check_text(ds, [args.prompt_column], args.dataset)
    raw_prompts = ds[args.prompt_column]
    columns = {c: list(ds[c]) for c in ds.column_names if c != args.prompt_column}  # lists, not `datasets` Columns
    has_reference = bool(args.reference_column) and args.reference_column in ds.column_names
    if args.reference_column not in ("", "reference") and not has_reference:
        data.require_columns(ds, [args.reference_column], args.dataset, "Pass --reference_column '' to compare without references.")
    if has_reference:
        data.check_text(ds, [args.reference_column], args.dataset)
    if kind == "gold" and args.reward_fn == "gold" and "post" not in columns:
        common.fail(f"--judge gold with the embedded gold judge needs a 'post' column, which {data.dataset_name(args.dataset)} "
                    "lacks; pass --reward_fn file.py:fn (or arith_strict on embedded:arith), --judge rm:PATH or --judge llm:MODEL.")
    if args.group_by:
        data.require_columns(ds, [args.group_by], args.dataset, "Pass a column of the dataset to --group_by.")
    if len(methods) < 2 and not has_reference:
        common.fail("nothing to compare: pass two or more policies, or a dataset with a --reference_column.")
    n = len(raw_prompts)
    num_runs = sum(len(paths) for _, paths in methods)
    print(f"eval: {len(methods)} methods ({num_runs} runs) on {n} prompts of {data.dataset_name(args.dataset)} ({split}), "
          f"judge {judge_name(kind, args)}")
    warn_if_training_prompts(args, methods, split)

    # ---- generate: the same prompts, settings and seed for every run of every method
    names = [name for name, _ in methods]
    runs = dict(zip(names, policies.run_names(methods)))  # method -> its runs' names
    responses, truncated, completion_ids = {}, {}, {}
    for (name, paths) in methods:
        for path, run in zip(paths, runs[name]):
            responses[run], truncated[run], completion_ids[run] = policies.generate_responses(path, run, raw_prompts, args)
    if has_reference:
        # the reference's text as the dataset writes it, as a policy's response is its decoded text;
        # its completion_ids for reward functions: that text in the first policy's tokenizer
        responses[REFERENCE] = [r if isinstance(r, str) else r[-1]["content"] for r in ds[args.reference_column]]
        runs[REFERENCE] = [REFERENCE]
        first_tokenizer = common.load_tokenizer(methods[0][1][0], args.trust_remote_code)
        completion_ids[REFERENCE] = [first_tokenizer(t, add_special_tokens=False)["input_ids"] for t in responses[REFERENCE]]

    # ---- pairs: every pair of methods (the later one as a), then each method vs the references;
    # within a pair of methods, every run of a meets every run of b on every prompt
    pairs = [(names[j], names[i]) for i in range(len(names)) for j in range(i + 1, len(names))]
    pairs += [(name, REFERENCE) for name in names] if has_reference else []
    run_pairs = [(ra, rb) for a, b in pairs for ra in runs[a] for rb in runs[b]]

    # ---- judge: per-prompt outcome of run a against run b (1 win, 0.5 tie, 0 loss)
    scores, fn_scores, outcomes, extra = None, None, {}, {}
    if kind in ("gold", "rm"):
        scores, fn_scores = judge_scores(kind, judge_arg, responses, raw_prompts, columns, args, completion_ids)
        for a, b in run_pairs:
            outcomes[a, b] = outcomes_from_scores(scores[a], scores[b])
            extra[a, b] = [{"score_a": float(x), "score_b": float(y)} for x, y in zip(scores[a], scores[b])]
    else:  # pairwise judges: P(the first shown is better), asked in both orders (judges.position_debiased)
        model = None
        if kind == "http":
            first_better = lambda p, f, s: judges.http_first_better(judge_arg, args, template, p, f, s)  # noqa: E731
        elif kind == "pairwise":
            model, tokenizer = common.load_reward_model(judge_arg, args)  # one logit, as reward.py's models
            first_better = lambda p, f, s: judges.pairwise_first_better(model, tokenizer, p, f, s, args.eval_batch_size, template)  # noqa: E731
        else:
            tokenizer = common.load_tokenizer(judge_arg, args.trust_remote_code)
            model = common.freeze(common.load_model(judge_arg, args))
            first_better = lambda p, f, s: judges.prob_first_better(model, tokenizer, p, f, s, args.eval_batch_size, template)  # noqa: E731
        for a, b in run_pairs:
            prob = np.full(n, 0.5)
            todo = [i for i in range(n) if responses[a][i] != responses[b][i]]  # identical: a tie, no call
            if todo:
                try:
                    prob[todo] = judges.position_debiased(first_better, [raw_prompts[i] for i in todo],
                                                   [responses[a][i] for i in todo], [responses[b][i] for i in todo])
                except judges.JudgeUnreachable as e:
                    common.fail(f"--judge {args.judge}: {e}; check --judge_base_url and --judge_api_key_env and that the "
                                "server runs (the generations are cached: a rerun only judges).")
                except judges.JudgeBadAnswer as e:
                    common.fail(f"--judge {args.judge}: {e}; use a judge model and --judge_template that answer with the "
                                "one letter A or B (the generations are cached: a rerun only judges).")
            outcomes[a, b] = outcomes_from_probs(prob, args.tie_margin)  # no preference within the margin: a tie
            extra[a, b] = [{"prob_a": float(p)} for p in prob]
        del model
    for a, b in run_pairs:  # identical responses tie, whatever the judge
        same = np.array([x == y for x, y in zip(responses[a], responses[b])])
        outcomes[a, b] = np.where(same, 0.5, outcomes[a, b])
    # a method pair's outcomes: (R_a, R_b, n)
    method_outcomes = {(a, b): np.array([[outcomes[ra, rb] for rb in runs[b]] for ra in runs[a]]) for a, b in pairs}
    # several reward functions: each one's outcomes too, judged as the weighted sum is (higher wins; a
    # function that returned None for either response: a tie), reported beside the sum
    fn_names = reward_fn_names(args) if fn_scores and next(iter(fn_scores.values())).shape[1] > 1 else []
    fn_outcomes = function_outcomes(fn_scores, fn_names, runs, pairs)  # {function: {(a, b): (R_a, R_b, n)}}
    # a reward function whose every score is 0 or 1 is a verifier: its mean score is an accuracy
    verifier = kind == "gold" and args.reward_fn != "gold" and all(is_binary(v) for v in scores.values())

    # ---- pass@k: n sampled completions per prompt and run, each checked by the verifier
    correct = {}
    if args.num_samples:
        if not verifier:
            common.fail(f"--num_samples (pass@k) needs a verifier: --reward_fn {args.reward_fn} gave scores other than 0 "
                        "and 1; pass a reward function that returns 1 for a correct completion and 0 otherwise.")
        repeat = [i for i in range(n) for _ in range(args.num_samples)]  # prompt i's samples are rows i*n_s..
        sample_prompts = [raw_prompts[i] for i in repeat]
        sample_columns = {c: [v[i] for i in repeat] for c, v in columns.items()}
        for name, paths in methods:
            for path, run in zip(paths, runs[name]):
                texts, _, ids = policies.generate_responses(path, run, sample_prompts, dataclasses.replace(args, do_sample=True))
                # scored as the greedy responses are: TRL's form (an assistant message after a conversation)
                sample_scores = judge_scores(kind, None, {run: texts}, sample_prompts, sample_columns, args, {run: ids},
                                             args.num_samples)[0][run]
                if not is_binary(sample_scores):
                    common.fail(f"--reward_fn {args.reward_fn} gave a sampled completion a score other than 0 or 1; "
                                "pass@k needs a verifier.")
                correct[run] = sample_scores.reshape(n, args.num_samples)  # (prompts, n_s)

    # ---- statistics: one set of resamples for every number; prompts paired across all runs
    order = names + ([REFERENCE] if has_reference else [])
    prompt_counts, run_counts, all_runs = bootstrap_plan(n, [len(runs[m]) for m in order], args.num_bootstrap, args.seed)
    level = {m: (run_counts[i], all_runs[i]) for i, m in enumerate(order)}  # method -> (two-level, prompt-only) run counts
    pairwise = [{"policy_a": a, "policy_b": b, **win_rate_stats(method_outcomes[a, b], prompt_counts,
                                                                [level[a][0], level[b][0]], [level[a][1], level[b][1]])}
                for a, b in pairs]
    for row, (a, b) in zip(pairwise, pairs):  # each reward function's win rate, on the same resamples
        if fn_names:
            row["rewards"] = {f: win_rate_stats(fn_outcomes[f][a, b], prompt_counts, [level[a][0], level[b][0]],
                                                [level[a][1], level[b][1]]) for f in fn_names}
    k = len(names)
    if k > 1:
        # Bradley-Terry on the methods' win matrix: n games per pair, each the mean over run pairs
        method_pairs = [(a, b) for a, b in pairs if b != REFERENCE]
        point = {(names.index(a), names.index(b)): method_outcomes[a, b].sum(-1).mean() for a, b in method_pairs}
        elo = bradley_terry_elo(win_matrix(point, n, k))  # (k,)
        unbounded = unbounded_elo(win_matrix(point, n, k))  # (k,): +1 / -1 where one side won every game
        boot_elo = []
        for which in (1, 0):  # prompt-only, then two-level
            totals = {(names.index(a), names.index(b)): resampled_totals(method_outcomes[a, b], prompt_counts,
                                                                           [level[a][which], level[b][which]])
                      for a, b in method_pairs}
            boot_elo.append(bradley_terry_elo(win_matrix(totals, n, k)))  # (B, k)
        (elo_lo, elo_hi), (elo_seed_lo, elo_seed_hi) = percentile_ci(boot_elo[0]), percentile_ci(boot_elo[1])
    else:
        elo = elo_lo = elo_hi = elo_seed_lo = elo_seed_hi = np.full(1, 1000.0)
        unbounded = np.zeros(1, dtype=int)

    def describe(name):
        """A method's numbers, averaged over its runs."""
        row = {}
        if scores is not None:
            values = np.array([scores[r] for r in runs[name]])  # (R, n)
            (row["score"], row["score_ci_low"], row["score_ci_high"], row["score_seed_ci_low"],
             row["score_seed_ci_high"]) = mean_cis(values, prompt_counts, [level[name][0]], [level[name][1]])
        if fn_names:  # each reward function's mean over the completions it applies to (not None)
            values = np.array([fn_scores[r] for r in runs[name]])  # (R, n, K)
            row["rewards"] = {f: dict(zip(("score", "score_ci_low", "score_ci_high", "score_seed_ci_low", "score_seed_ci_high"),
                                          nan_mean_cis(values[..., j], prompt_counts, [level[name][0]], [level[name][1]])))
                              for j, f in enumerate(fn_names)}
        if not verifier:  # a length confound of win rates; nothing to say about an exact check
            row["mean_length"] = float(np.mean([len(t.split()) for r in runs[name] for t in responses[r]]))  # words
        if all(r in correct for r in runs[name]):
            row["pass_at_k"] = pass_at_k_stats([correct[r] for r in runs[name]], ks, prompt_counts, [level[name][0]],
                                               [level[name][1]])
        if args.group_by and scores is not None:
            row["by_group"] = group_stats([scores[r] for r in runs[name]], ds[args.group_by], args.num_bootstrap, args.seed)
        if kind == "gold" and args.reward_fn == "gold":  # the embedded judge's terms: what went wrong, per summary
            counts = [world.gold_counts(post, responses[r][i]) for r in runs[name] for i, post in enumerate(columns["post"])]
            row["gold_counts"] = {k: float(np.mean([c[k] for c in counts])) for k in ("missed", "unsupported", "repeated", "excess")}
        return row

    results = {
        # the judge as what it is: the gold judge, the reward functions by name (reward_fn:...), or --judge's model
        "settings": {"judge": f"reward_fn:{judge_name(kind, args)}" if kind == "gold" and args.reward_fn != "gold" else args.judge,
                     "judge_name": judge_name(kind, args), "verifier": verifier,
                     "reward_fn": args.reward_fn, "reward_weights": args.reward_weights, "reward_fns": fn_names, "dataset": data.dataset_name(args.dataset),
                     "num_prompts": n, "num_bootstrap": args.num_bootstrap, "tie_margin": args.tie_margin,
                     "judge_template": args.judge_template, "judge_base_url": args.judge_base_url,
                     **policies.generation_settings(args), "num_samples": args.num_samples, "pass_k": ks, "group_by": args.group_by},
        "pairwise": pairwise,
        "elo": {name: {"elo": float(elo[i]), "ci_low": float(elo_lo[i]), "ci_high": float(elo_hi[i]),
                       "seed_ci_low": float(elo_seed_lo[i]), "seed_ci_high": float(elo_seed_hi[i]),
                       "unbounded": int(unbounded[i])}
                for i, name in enumerate(names)},
        "policies": {name: {"paths": paths, "runs": runs[name], **describe(name),
                            "truncated_frac": float(np.mean([truncated[r] for r in runs[name]]))}
                     for name, paths in methods},
        "runs": {run: {"method": name, "path": path, "mean_length": float(np.mean([len(t.split()) for t in responses[run]])),
                       **({"score": float(np.mean(scores[run]))} if scores is not None else {})}
                 for name, paths in methods for run, path in zip(runs[name], paths)},
    }
    if has_reference:
        results["reference"] = describe(REFERENCE)

    # ---- save: results.json, results.md, judgments.jsonl, generations.jsonl, plots
    out = args.output_dir
    os.makedirs(out, exist_ok=True)
    checkpoints.write_json(os.path.join(out, "results.json"), results)
    report = reports.markdown_report(results, names, REFERENCE if has_reference else None)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(report)
    method_of = {run: m for m in runs for run in runs[m]}
    with open(os.path.join(out, "judgments.jsonl"), "w") as f:
        for a, b in run_pairs:
            for i in range(n):
                winner = {1.0: "a", 0.5: "tie", 0.0: "b"}[float(outcomes[a, b][i])]
                f.write(json.dumps(common.finite_json({"prompt_id": i, "policy_a": a, "policy_b": b, "method_a": method_of[a],
                                                       "method_b": method_of[b], "winner": winner, **extra[a, b][i]})) + "\n")
    with open(os.path.join(out, "generations.jsonl"), "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt_id": i, "prompt": raw_prompts[i], "responses": {k_: v[i] for k_, v in responses.items()}}) + "\n")
    # the plots show the two-level CIs (the prompt-only ones when every method has one run: they are equal)
    ci = "seeds + prompts" if num_runs > len(methods) else "prompts"
    reports.plot_intervals(os.path.join(out, "win_rates.png"), [f"{r['policy_a']} vs {r['policy_b']}" for r in pairwise],
                   [r["win_rate"] for r in pairwise], [r["seed_ci_low"] for r in pairwise], [r["seed_ci_high"] for r in pairwise],
                   f"win rate of the first over the second (95% CI, {ci})", 0.5, f"Pairwise win rates, judge {results['settings']['judge_name']}",
                   xlim=(-0.03, 1.03))
    reports.plot_intervals(os.path.join(out, "elo.png"), names, elo, elo_seed_lo, elo_seed_hi,
                   f"Bradley-Terry Elo (95% CI, {ci}), {names[0]} = 1000", 1000, f"Elo, judge {results['settings']['judge_name']}")
    if fn_names:  # each reward function's win rates, pair by pair
        rows = [(f"{r['policy_a']} vs {r['policy_b']}: {f}", r["rewards"][f]) for r in pairwise for f in fn_names]
        reports.plot_intervals(os.path.join(out, "reward_win_rates.png"), [label for label, _ in rows],
                               [w["win_rate"] for _, w in rows], [w["seed_ci_low"] for _, w in rows],
                               [w["seed_ci_high"] for _, w in rows], f"win rate of the first over the second (95% CI, {ci})",
                               0.5, "Pairwise win rates per reward function", xlim=(-0.03, 1.03))
    print(f"eval: saved results.json, results.md, judgments.jsonl, generations.jsonl, win_rates.png, elo.png"
          f"{', reward_win_rates.png' if fn_names else ''} to {out}\n")
    print(report)


if __name__ == "__main__":
    main()
