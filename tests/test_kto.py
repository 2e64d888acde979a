"""kto.py: the KTO loss against a direct transcription of its equations, the step-0 invariant,
the fixed blocks, unpairing preference pairs, and the script end to end on unpaired rows."""

import json
import math
import os

import pytest
import torch
from conftest import run_script

import kto


def _metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _transcribed(logps, ref, kl, ref_kl, labels, beta, wd, wu):
    """KTO (Ethayarajh et al. 2024, Eq. 7) with TRL's reference point, row by row in plain Python."""
    z0 = max(0.0, sum(float(a - b) for a, b in zip(kl, ref_kl)) / len(kl))
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    out = []
    for lp, rf, label in zip(logps.tolist(), ref.tolist(), labels.tolist()):
        r = lp - rf
        out.append(wd * (1 - sig(beta * (r - z0))) if label else wu * (1 - sig(beta * (z0 - r))))
    return out, z0


@pytest.mark.parametrize("beta, wd, wu, kl_shift", [(0.1, 1.0, 1.0, 0.5), (0.5, 1.33, 0.7, 0.5), (0.2, 1.0, 1.0, -3.0)])
def test_kto_loss_matches_the_equations(beta, wd, wu, kl_shift):
    """Desirable and undesirable rows, unequal weights, and a negative KL estimate (floored at 0)."""
    g = torch.Generator().manual_seed(0)
    logps, ref = -torch.rand(8, generator=g) * 30, -torch.rand(8, generator=g) * 30
    ref_kl = -torch.rand(8, generator=g) * 30
    kl = ref_kl + kl_shift + torch.randn(8, generator=g)
    labels = torch.tensor([True, False, True, True, False, False, True, False])
    losses, rewards, z0 = kto.kto_loss(logps, ref, kl, ref_kl, labels, beta, wd, wu)
    expected, z0_expected = _transcribed(logps, ref, kl, ref_kl, labels, beta, wd, wu)
    torch.testing.assert_close(losses, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert float(z0) == pytest.approx(z0_expected, abs=1e-5)
    assert (z0_expected == 0) == (kl_shift < 0)  # the floor is exercised by the last case
    torch.testing.assert_close(rewards, beta * (logps - ref))


def test_kto_gradient_flows_through_the_rows_not_the_reference_point():
    """z0 is detached: the mismatched pairs' log-probs get no gradient; a desirable row's
    log-prob is pushed up, an undesirable one's down."""
    logps = torch.tensor([-5.0, -5.0], requires_grad=True)
    kl = torch.tensor([-3.0, -4.0], requires_grad=True)  # z0 = 1.5 > 0: not at the floor
    losses, _, _ = kto.kto_loss(logps, torch.tensor([-5.0, -5.0]), kl, torch.tensor([-5.0, -5.0]),
                                torch.tensor([True, False]), 0.1)
    losses.sum().backward()
    assert kl.grad is None or not kl.grad.any()
    assert logps.grad[0] < 0 < logps.grad[1]


def test_blocks_are_fixed_full_and_cover_every_row():
    blocks = kto.kl_blocks(10, 4, seed=3)
    assert blocks.shape == (3, 4) and set(blocks.flatten().tolist()) == set(range(10))
    assert torch.equal(blocks, kto.kl_blocks(10, 4, seed=3))  # the same blocks every call: precomputable pairs


def _write_unpaired(path):
    rows = [{"prompt": f"POST: bob sold the car {i} . TL;DR:", "completion": " bob sold a car" if i % 2 else " the sky",
             "label": bool(i % 2)} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_kto_end_to_end_precompute_on_and_off(tmp_path, tiny_qwen):
    """Unpaired rows (TRL's prompt/completion/label): step 1 has the loss of policy == reference
    (every row 1 - sigmoid(0) = 0.5, kl 0); precomputed and live reference log-probs train alike;
    the policy moves (margins), one model is held with the precompute and two without."""
    data = tmp_path / "unpaired.jsonl"
    _write_unpaired(data)
    runs = {}
    for flag in ("--precompute_ref_logps", "--no_precompute_ref_logps"):
        out = str(tmp_path / flag.strip("-"))
        run_script("kto.py", "--model", tiny_qwen, "--dataset", str(data), "--output_dir", out, "--max_steps", "3",
                   "--batch_size", "4", "--learning_rate", "1e-2", "--warmup_steps", "0", "--optim", "adamw", flag,
                   "--max_completion_length", "6")
        runs[flag] = (_metrics(out), json.load(open(os.path.join(out, "summary.json"))))
    (on, on_summary), (off, off_summary) = runs.values()
    assert [r["step"] for r in on] == [1, 2, 3]
    for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert key in on[0], key
    assert on[0]["loss"] == pytest.approx(0.5, abs=1e-6) and on[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert [r["loss"] for r in on] == pytest.approx([r["loss"] for r in off], abs=1e-4)
    assert on[-1]["rewards/margins"] > 1e-3  # desirable rows rose above the undesirable ones
    assert on_summary["models_alive"] == 1 and off_summary["models_alive"] == 2


def test_preference_pairs_unpair_as_trl_does():
    """The embedded world's preference pairs (and any prompt/chosen/rejected data) become two
    rows each, as TRL's unpair_preference_dataset: (prompt, chosen, True), (prompt, rejected, False)."""
    from datasets import Dataset

    pairs = Dataset.from_list([{"prompt": f"p{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(3)])
    rows = kto.unpaired_rows(pairs, "pairs.jsonl")
    assert rows == [(f"p{i}", f"{w} {i}", label) for i in range(3) for w, label in (("good", True), ("bad", False))]
    unpaired = Dataset.from_list([{"prompt": "p", "completion": "c", "label": False}])
    assert kto.unpaired_rows(unpaired, "u.jsonl") == [("p", "c", False)]


def test_bad_input_stops_with_a_clear_message(tmp_path, tiny_qwen, monkeypatch, capsys):
    from conftest import main_error

    message = main_error(kto, ["--batch_size", "1", "--output_dir", str(tmp_path / "o")], monkeypatch, capsys)
    assert "--batch_size 1" in message and "at least 2 rows" in message
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "completion": "c", "label": 1}) + "\n")
    message = main_error(kto, ["--model", tiny_qwen, "--dataset", str(bad), "--output_dir", str(tmp_path / "o2")],
                         monkeypatch, capsys)
    assert "row 0" in message and "'label' must be true or false" in message
