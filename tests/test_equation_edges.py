"""What the generated mutants (tests/mutants_generated.py) showed no test pinned down in the
equation functions: the clip metrics against TRL's definitions, the normalisers' guards at a
single token, a NaN reward's advantage, the importance weight at exactly the cap, nanstd's shape,
and the defaults a direct caller gets."""

import math
from types import SimpleNamespace

import torch

import grpo


def _args(**kw):
    base = dict(epsilon=0.2, epsilon_high=0.28, dual_clip_c=3.0, beta=0.0, loss_type="grpo",
                max_completion_length=5, importance_sampling_level="token")
    return SimpleNamespace(**{**base, **kw})


def _clip_batch():
    """Ratios far inside and outside every clip, advantages of both signs, 0, and in (0, 1)."""
    g = torch.Generator().manual_seed(0)
    N, C = 12, 5
    old = -torch.rand(N, C, generator=g) * 2
    logprobs = old + torch.randn(N, C, generator=g) * 1.5  # ratios from ~0.01 to ~100
    adv = torch.tensor([-2.0, -0.5, 0.0, 0.3, 0.7, 1.5, -1.0, 0.5, 2.0, -0.2, 0.0, 0.9])
    mask = (torch.arange(C)[None] < torch.randint(1, C + 1, (N,), generator=g)[:, None]).float()
    return logprobs, old, adv, mask


def test_clip_metrics_match_trls_definitions():
    """clip_ratio/low_mean: ratio < 1 - eps where A < 0; high_mean: ratio > 1 + eps_high where
    A > 0; clip_ratio: either; dual_mean: ratio > c where A < 0 (never with c = 0 or cispo); cispo:
    only the cap 1 + eps_high binds, whatever the sign of A. Token means over the mask."""
    logprobs, old, adv, mask = _clip_batch()
    ratio = torch.exp(logprobs - old)
    A = adv[:, None].expand_as(ratio)

    def mean(x):
        return float((x.float() * mask).sum() / mask.sum())

    for a in (_args(), _args(dual_clip_c=0.0), _args(loss_type="cispo", epsilon_high=1.5), _args(loss_type="dapo")):
        _, m = grpo.grpo_loss(logprobs, old, None, adv, mask, a)
        if a.loss_type == "cispo":
            low, high = torch.zeros_like(ratio, dtype=torch.bool), ratio > 1 + a.epsilon_high
        else:
            low, high = (ratio < 1 - a.epsilon) & (A < 0), (ratio > 1 + a.epsilon_high) & (A > 0)
        dual = (ratio > a.dual_clip_c) & (A < 0) if a.dual_clip_c and a.loss_type != "cispo" else torch.zeros_like(low)
        assert 0 < mean(low | high) < 1 and (a.loss_type == "cispo" or 0 < mean(low) < mean(low | high))
        assert math.isclose(m["clip_ratio"], mean(low | high), abs_tol=1e-7)
        assert math.isclose(m["clip_ratio/low_mean"], mean(low), abs_tol=1e-7)
        assert math.isclose(m["clip_ratio/high_mean"], mean(high), abs_tol=1e-7)
        assert math.isclose(m["clip_ratio/dual_mean"], mean(dual), abs_tol=1e-7)
        assert (mean(dual) > 0) == (a.dual_clip_c > 0 and a.loss_type != "cispo")


def test_a_single_token_is_divided_by_one():
    """The normalisers' clamp(min=1) only guards against 0 tokens: a batch of one real token
    is divided by 1 (dapo's and bnpo's loss, the metrics, batch_normalisers)."""
    logprobs, old = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -2.0]])  # ratio e on the real token
    mask, adv = torch.tensor([[1.0, 0.0]]), torch.tensor([1.0])
    for loss_type in ("dapo", "bnpo"):
        loss, m = grpo.grpo_loss(logprobs, old, None, adv, mask, _args(loss_type=loss_type, dual_clip_c=0.0))
        assert math.isclose(float(loss), -(1 + 0.28), rel_tol=1e-6)  # the clipped surrogate of that token
        assert m["clip_ratio"] == 1.0 and m["clip_ratio/high_mean"] == 1.0
    assert grpo.batch_normalisers([mask.long()]) == (1, torch.tensor(1.0))


def test_group_advantages_defaults_and_a_nan_reward():
    """By default each group's own std (DeepSeekMath); a NaN reward (no function applied) is left
    out of its group's mean and std and gets advantage exactly 0."""
    rewards = torch.tensor([1.0, 2.0, 4.0, 0.0, 0.0, 3.0])
    grouped = rewards.view(-1, 3)
    expected = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + grpo.ADV_EPS)).reshape(-1)
    torch.testing.assert_close(grpo.group_advantages(rewards, 3), expected, rtol=0, atol=1e-6)
    with_nan = torch.tensor([1.0, float("nan"), 3.0, 0.0, 0.0, 3.0])
    adv = grpo.group_advantages(with_nan, 3)
    assert adv[1] == 0.0 and adv[0] == -adv[2] and math.isclose(float(adv[2]), 1 / (math.sqrt(2) + grpo.ADV_EPS), rel_tol=1e-6)


def test_nanstd_is_torch_std_and_keeps_its_shape_only_when_asked():
    x = torch.tensor([[1.0, 2.0, 4.0], [0.0, 0.0, 3.0]])
    assert grpo.nanstd(x).shape == () and torch.isclose(grpo.nanstd(x), x.std())
    assert grpo.nanstd(x, 1).shape == (2,) and grpo.nanstd(x, 1, keepdim=True).shape == (2, 1)


def test_importance_weight_at_exactly_the_cap_is_kept():
    """*_mask zeroes a weight above the cap, not one equal to it."""
    lp = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    for mode in ("token_mask", "sequence_mask"):
        w = grpo.importance_sampling_weights(lp, lp, mask, mode, cap=1.0)  # rho exactly 1 == the cap
        assert (w == 1.0).all(), mode


# ---------------------------------------------------------------- ppo.py
def _ppo_batch(seed=1, B=6, C=5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, C, generator=g) * 2
    logprobs = old + torch.randn(B, C, generator=g) * 0.8
    adv = torch.randn(B, C, generator=g)
    mask = (torch.arange(C)[None] < torch.randint(1, C + 1, (B,), generator=g)[:, None]).float()
    values, old_values, returns = (torch.randn(B, C, generator=g) for _ in range(3))
    return logprobs, old, adv, mask, values, old_values, returns


def test_ppo_losses_divide_by_the_minibatch_tokens_and_report_their_metrics():
    """policy_loss / value_loss with num_tokens: the sum over this micro-batch's tokens divided by
    the minibatch's count (not this micro-batch's); their metrics are this micro-batch's token
    means of the transcribed terms (TRL's pg_loss, clipfrac, approx_kl, vf_loss, vf_clipfrac)."""
    import ppo

    logprobs, old, adv, mask, values, old_values, returns = _ppo_batch()
    n = float(mask.sum())

    def mean(x, count=n):
        return float((x * mask).sum() / count)

    ratio = torch.exp(logprobs - old)
    surrogate = torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    objective = torch.where(adv < 0, torch.max(surrogate, 2.0 * adv), surrogate)
    loss, stats = ppo.policy_loss(logprobs, old, adv, mask, 0.2, 2.0, num_tokens=torch.tensor(3 * n))
    assert math.isclose(float(loss), -mean(objective, 3 * n), rel_tol=1e-5)
    assert math.isclose(stats["pg_loss"], -mean(objective), rel_tol=1e-5)
    assert math.isclose(stats["approx_kl"], 0.5 * mean((logprobs - old) ** 2), rel_tol=1e-5)
    assert math.isclose(stats["clipfrac"], mean((ratio * adv > surrogate).float()), rel_tol=1e-6)
    clipped = old_values + (values - old_values).clamp(-0.3, 0.3)
    losses = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    loss, stats = ppo.value_loss(values, old_values, returns, mask, 0.3, num_tokens=torch.tensor(3 * n))
    assert math.isclose(float(loss), 0.5 * mean(losses, 3 * n), rel_tol=1e-5)
    assert math.isclose(stats["vf_loss"], 0.5 * mean(losses), rel_tol=1e-5)
    frac = mean(((clipped - returns) ** 2 > (values - returns) ** 2).float())
    assert 0 < frac < 1 and math.isclose(stats["vf_clipfrac"], frac, rel_tol=1e-6)
    assert math.isclose(float(ppo.masked_mean(values, mask, torch.tensor(7.0))), mean(values, 7.0), rel_tol=1e-6)


def test_explained_variance_is_one_minus_the_residual_share():
    import ppo

    _, _, _, mask, values, _, returns = _ppo_batch(seed=2)
    real = mask.bool()
    r, v = returns[real].double(), values[real].double()
    expected = 1 - (r - v).var(unbiased=False) / r.var(unbiased=False)
    assert math.isclose(float(ppo.explained_variance(values, returns, mask)), float(expected), rel_tol=1e-5)
    assert float(ppo.explained_variance(returns, returns, mask)) == 1.0


def test_the_score_adds_to_the_last_tokens_kl_penalty():
    """r_t = -kl_coef * kl_t everywhere, plus the score on the last real token (not instead of it)."""
    import ppo

    logprobs, ref = torch.tensor([[-1.0, -2.0, -1.5, 0.0]]), torch.tensor([[-1.5, -1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    rewards, kl, _ = ppo.per_token_rewards(torch.tensor([2.0]), logprobs, ref, mask, 0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 0.05 + 2.0, 0.0]]))


def test_one_token_and_a_constant_are_whitened_to_zero():
    """The counts' clamp(min=1) only guards against 0 tokens; a constant (variance 0) whitens to 0, not NaN."""
    import ppo

    one = torch.tensor([[1.0, 0.0]])
    x = torch.tensor([[3.0, 5.0]])
    assert float((ppo.masked_whiten(x, one) * one).sum()) == 0.0 and float(ppo.masked_mean(x, one)) == 3.0
    assert float(ppo.minibatch_tokens([one])) == 1.0
    constant = torch.full((2, 3), 4.0)
    assert (ppo.masked_whiten(constant, torch.ones(2, 3)) == 0).all()


# ---------------------------------------------------------------- dpo.py
def test_one_token_completions_are_divided_by_one(monkeypatch):
    """RPO's per-token NLL and IPO's per-token mean log-probs divide by the token count; a
    one-token completion is divided by 1 (the clamp only guards against 0)."""
    import dpo
    from rlhf import sampling

    assert float(dpo.chosen_nll(torch.tensor([-3.0]), torch.tensor([[1, 0, 0]]), "sigmoid")) == 3.0
    per_token = torch.tensor([[-3.0, 0.0], [-1.0, -1.0]])  # rows: chosen (1 token), rejected (2 tokens)
    monkeypatch.setattr(sampling, "completion_logprobs", lambda model, p, pm, ids, mask, *a, **k: per_token * mask)
    batch = {"prompt_ids": torch.zeros(1, 2, dtype=torch.long), "prompt_mask": torch.ones(1, 2, dtype=torch.long),
             "completion_ids": torch.zeros(2, 2, dtype=torch.long), "completion_mask": torch.tensor([[1, 0], [1, 1]])}
    chosen, rejected = dpo.pair_logps(None, batch, "ipo")
    assert (float(chosen), float(rejected)) == (-3.0, -1.0)


def test_sft_loss_of_one_token_is_its_nll():
    import sft

    assert float(sft.sft_loss(torch.tensor([[-2.0, -5.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor(1.0))) == 2.0
