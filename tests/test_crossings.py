"""Every option that changes how a loss is computed, crossed with every other one that changes
it too, against a direct transcription of the formula (grpo.py's module docstring and
`grpo_loss`, ppo.py's `policy_loss`, dpo.py's `dpo_loss`) written token by token in Python
floats. The batches are built so that every clip binds somewhere: ratios from about 0.2 to 5
per token and per completion, advantages of both signs, a --epsilon that is not the default (so
--epsilon_high 0, which means --epsilon, is told apart from any constant). A flag whose effect
only shows in combination with another (a normaliser with a masked row, a sequence ratio with a
tool reply's hole, an importance weight with the dual clip) is met in the matrix."""

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import dpo
import grpo
import ppo

N, C = 8, 6
EPSILON, EPSILON_HIGH, DUAL_C, BETA, MAX_LEN = 0.15, 0.35, 2.5, 0.07, 9


def grpo_batch(mask_kind):
    """log-probs of pi, pi_old and pi_ref (N, C), advantages (N,) of both signs, and a mask:
    right-padded ("plain"), with two rows zeroed (--mask_truncated_completions), or with holes
    in the middle (--tools: the tools' replies are read, never trained on)."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(N, C, generator=g, dtype=torch.float64) * 2 - 0.1
    # a per-row offset moves whole completions (GSPO's sequence ratio) past the clips, the per-token
    # noise moves single tokens; together they span ~0.2 to ~5
    offset = torch.tensor([0.5, 0.9, -0.3, -1.2, 0.25, 1.2, -0.6, 0.1], dtype=torch.float64)
    logprobs = old + offset[:, None] + 0.5 * torch.randn(N, C, generator=g, dtype=torch.float64)
    ref = old + 0.4 * torch.randn(N, C, generator=g, dtype=torch.float64)
    advantages = torch.tensor([1.3, -0.8, 0.6, -1.7, 2.1, -0.4, 0.9, -1.1], dtype=torch.float64)
    lengths = torch.tensor([6, 3, 5, 1, 4, 6, 2, 5])
    mask = (torch.arange(C)[None] < lengths[:, None]).double()
    if mask_kind == "truncated":  # rows without EOS contribute nothing, but still sit in the batch
        mask[[2, 5]] = 0
    elif mask_kind == "tools":  # a tool reply in the middle of rows 0, 4 and 5
        mask[0, 2:4] = 0
        mask[4, 1] = 0
        mask[5, 3:5] = 0
    return logprobs, old, ref, advantages, mask


def f64(x):
    return torch.tensor(x, dtype=torch.float64)


def is_weights_of(kind):
    g = torch.Generator().manual_seed(5)
    if kind == "token":  # (N, C), as importance_sampling_weights' token_* modes
        return torch.rand(N, C, generator=g, dtype=torch.float64) * 2
    if kind == "sequence":  # (N, 1), as its sequence_* modes
        return torch.rand(N, 1, generator=g, dtype=torch.float64) * 2
    return None


def transcribed_grpo_loss(lp, old, ref, adv, mask, a, num_sequences, num_tokens, w):
    """The docstring's objective, one token at a time (Python floats for the clips, torch scalars
    where the gradient must flow). CISPO's weight is a constant: its gradient is w A d log pi."""
    eh = a.epsilon_high if a.epsilon_high != 0 else a.epsilon  # --epsilon_high 0: the same as --epsilon
    rows = []
    for i in range(N):
        own = [t for t in range(C) if mask[i, t] == 1]
        A = float(adv[i])
        if a.importance_sampling_level == "sequence":  # s_i = exp(mean over own tokens of log pi - log pi_old)
            seq = torch.exp(sum(lp[i, t] - old[i, t] for t in own) / max(len(own), 1)) if own else f64(1.0)
        terms = []
        for t in own:
            r = seq if a.importance_sampling_level == "sequence" else torch.exp(lp[i, t] - old[i, t])
            if a.loss_type == "cispo":
                weight = min(r.item(), 1 + eh)  # the IS weight, clipped above only, no gradient
                l_t = -weight * A * lp[i, t]
            else:
                clipped = min(max(r, f64(1 - a.epsilon)), f64(1 + eh))
                s = torch.minimum(r * A, clipped * A)
                if a.dual_clip_c and A < 0:
                    s = torch.maximum(s, f64(a.dual_clip_c * A))
                l_t = -s
            if w is not None:
                l_t = l_t * (w[i, t] if w.shape[1] == C else w[i, 0])
            d = ref[i, t] - lp[i, t]
            l_t = l_t + a.beta * (torch.exp(d) - d - 1)  # k3
            terms.append(l_t)
        rows.append(terms)
    total = sum(sum(terms) for terms in rows if terms)
    tokens = sum(len(terms) for terms in rows)
    if a.loss_type == "grpo":
        return sum(sum(terms) / len(terms) for terms in rows if terms) / num_sequences
    if a.loss_type == "dr_grpo":
        return total / (num_sequences * a.max_completion_length)
    if a.loss_type == "bnpo":  # this micro-batch's token mean, weighted by its share of the sequences
        return total / max(tokens, 1) * (N / num_sequences)
    return total / num_tokens  # dapo, cispo


LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "bnpo", "cispo"]
MATRIX = [
    pytest.param(*combo, id="-".join(map(str, combo)))
    for combo in itertools.product(LOSS_TYPES, ["token", "sequence"], [DUAL_C, 0.0], [EPSILON_HIGH, 0.0],
                                   [None, "token", "sequence"], ["plain", "truncated", "tools"])
    if not (combo[0] == "cispo" and combo[2] == 0.0)  # cispo has no dual clip: both values are one case
]


@pytest.mark.parametrize("loss_type,level,dual_clip_c,epsilon_high,weights,mask_kind", MATRIX)
def test_grpo_loss_matrix(loss_type, level, dual_clip_c, epsilon_high, weights, mask_kind):
    """grpo_loss's value and gradient against the transcription, for one micro-batch of a
    two-micro-batch optimizer step (the normalisers count both), on every combination."""
    lp, old, ref, adv, mask = grpo_batch(mask_kind)
    other = torch.ones(3, C, dtype=torch.float64)  # the optimizer step's other micro-batch: 3 rows, 18 tokens
    other[0, 4:] = 0
    num_sequences, num_tokens = grpo.batch_normalisers([mask, other])
    assert num_sequences == N + 3 and float(num_tokens) == float(mask.sum() + other.sum())
    a = SimpleNamespace(loss_type=loss_type, importance_sampling_level=level, dual_clip_c=dual_clip_c,
                        epsilon=EPSILON, epsilon_high=epsilon_high, beta=BETA, max_completion_length=MAX_LEN)
    w = is_weights_of(weights)
    mine = lp.clone().requires_grad_()
    loss, _ = grpo.grpo_loss(mine, old, ref, adv, mask, a, num_sequences, num_tokens, w)
    loss.backward()
    theirs = lp.clone().requires_grad_()
    expected = transcribed_grpo_loss(theirs, old, ref, adv, mask, a, num_sequences, float(num_tokens), w)
    expected.backward()
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-9, abs_tol=1e-12)
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_every_option_of_the_matrix_binds_on_its_batch(loss_type, level):
    """The matrix proves something only where each option changes the loss on its batch: for
    every loss type and ratio level, flipping any one option (the dual clip, --epsilon_high 0
    against 0.35, importance weights, each mask) changes the loss or its gradient. --epsilon_high 0
    is --epsilon here (0.15, not the default 0.2): the upper clip binds at 1.15 < ratio < 1.35."""
    def run(**kw):
        o = {"dual_clip_c": DUAL_C, "epsilon_high": EPSILON_HIGH, "weights": None, "mask_kind": "plain", **kw}
        lp, old, ref, adv, mask = grpo_batch(o["mask_kind"])
        a = SimpleNamespace(loss_type=loss_type, importance_sampling_level=level, dual_clip_c=o["dual_clip_c"],
                            epsilon=o.get("epsilon", EPSILON), epsilon_high=o["epsilon_high"], beta=BETA,
                            max_completion_length=MAX_LEN)
        x = lp.clone().requires_grad_()
        loss, _ = grpo.grpo_loss(x, old, ref, adv, mask, a, 11, float(mask.sum()) + 5, is_weights_of(o["weights"]))
        loss.backward()
        return torch.cat([loss.detach().reshape(1), x.grad.reshape(-1)])

    base = run()
    flips = {"epsilon_high 0": run(epsilon_high=0.0), "weights token": run(weights="token"),
             "weights sequence": run(weights="sequence"), "truncated": run(mask_kind="truncated"),
             "tools": run(mask_kind="tools")}
    if loss_type != "cispo":
        flips["no dual clip"] = run(dual_clip_c=0.0)
    for name, value in flips.items():
        assert not torch.allclose(base, value, rtol=0, atol=1e-9), f"{name} changes nothing for {loss_type}/{level}"
    # --epsilon_high 0 is --epsilon itself, not the default 0.2 nor 0: equal to an explicit 0.15
    assert torch.allclose(run(epsilon_high=0.0), run(epsilon_high=EPSILON), rtol=0, atol=1e-12)
    assert not torch.allclose(run(epsilon_high=0.0), run(epsilon_high=0.2), rtol=0, atol=1e-9)


# ---------------------------------------------------------------- ppo.py: the clipped surrogate
def ppo_batch(mask_kind):
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(N, C, generator=g, dtype=torch.float64) * 2
    logprobs = old + 0.8 * torch.randn(N, C, generator=g, dtype=torch.float64)  # ratios ~0.2 to ~5
    advantages = torch.randn(N, C, generator=g, dtype=torch.float64)
    mask = (torch.arange(C)[None] < torch.tensor([6, 3, 5, 1, 4, 6, 2, 5])[:, None]).double()
    if mask_kind == "truncated":
        mask[[2, 5]] = 0
    return logprobs, old, advantages, mask


@pytest.mark.parametrize("cliprange", [0.1, 0.3])
@pytest.mark.parametrize("dual_clip_c", [0.0, 1.5, 3.0])
@pytest.mark.parametrize("num_tokens", [None, 40])
@pytest.mark.parametrize("mask_kind", ["plain", "truncated"])
def test_ppo_policy_loss_matrix(cliprange, dual_clip_c, num_tokens, mask_kind):
    """policy_loss (Schulman et al. 2017, Eq. 7; Ye et al. 2020, Eq. 5) token by token, with and
    without the dual clip, over this micro-batch's tokens or a minibatch's count."""
    lp, old, adv, mask = ppo_batch(mask_kind)
    mine = lp.clone().requires_grad_()
    loss, stats = ppo.policy_loss(mine, old, adv, mask, cliprange, dual_clip_c, num_tokens)
    loss.backward()
    theirs = lp.clone().requires_grad_()
    terms, clipped, dual = [], 0, 0
    for i, t in itertools.product(range(N), range(C)):
        if mask[i, t] != 1:
            continue
        r, A = torch.exp(theirs[i, t] - old[i, t]), float(adv[i, t])
        s = torch.minimum(r * A, min(max(r, f64(1 - cliprange)), f64(1 + cliprange)) * A)
        clipped += (r * A).item() > s.item()
        if dual_clip_c and A < 0:
            dual += s.item() < dual_clip_c * A
            s = torch.maximum(s, f64(dual_clip_c * A))
        terms.append(-s)
    expected = sum(terms) / (num_tokens or len(terms))
    expected.backward()
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-9)
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-9, atol=1e-12)
    assert math.isclose(float(stats["clipfrac"]), clipped / len(terms), abs_tol=1e-12)
    assert math.isclose(float(stats["dual_clip_frac"]), dual / len(terms), abs_tol=1e-12)
    assert 0 < clipped < len(terms) and (dual > 0) == (dual_clip_c > 0)  # both clips bind on this batch


# ---------------------------------------------------------------- dpo.py: loss types x label smoothing
@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "ipo"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_matrix(loss_type, label_smoothing, beta):
    """dpo_loss per pair against Rafailov et al. 2023 Eq. 7 (with cDPO's smoothing), Chowdhury et
    al. 2024 Eq. 9 and Azar et al. 2023 Eq. 17, on margins of both signs; the implicit rewards are
    beta * (log pi - log pi_ref) of each response."""
    g = torch.Generator().manual_seed(11)
    pc, pr, rc, rr = (-torch.rand(6, generator=g, dtype=torch.float64) * 20 for _ in range(4))
    mine = [x.clone().requires_grad_() for x in (pc, pr)]
    losses, chosen_rewards, rejected_rewards = dpo.dpo_loss(mine[0], mine[1], rc, rr, beta, loss_type, label_smoothing)
    losses.sum().backward()
    theirs = [x.clone().requires_grad_() for x in (pc, pr)]
    expected = []
    for i in range(6):
        h = (theirs[0][i] - rc[i]) - (theirs[1][i] - rr[i])
        eps = label_smoothing
        if loss_type == "sigmoid":
            expected.append(-(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h))
        elif loss_type == "robust":
            expected.append(((eps - 1) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps))
        else:
            expected.append((h - 1 / (2 * beta)) ** 2)
    expected = torch.stack(expected)
    expected.sum().backward()
    torch.testing.assert_close(losses, expected, rtol=1e-9, atol=1e-12)
    for m, t in zip(mine, theirs):
        torch.testing.assert_close(m.grad, t.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(chosen_rewards, beta * (pc - rc), rtol=0, atol=1e-12)
    torch.testing.assert_close(rejected_rewards, beta * (pr - rr), rtol=0, atol=1e-12)
    margins = (pc - rc) - (pr - rr)
    assert (margins > 0).any() and (margins < 0).any()
