"""studies/fp8_sim.py: the e4m3 quantise-dequantise, its straight-through gradient, and a tiny
sft.py run through the wrapper, in process."""

import json
import math
import os
import sys

import torch

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "studies"))
import fp8_sim  # noqa: E402


def test_fake_fp8_is_exact_on_e4m3_values_and_within_half_an_ulp_elsewhere():
    # every finite e4m3 value (the 256 bit patterns less the two NaNs), 448 included, times a power of two
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[codes.isfinite()]
    assert values.abs().max() == 448
    for dtype in (torch.float32, torch.bfloat16):
        x = (values * 2.0**-7).to(dtype)  # amax / 448 = 2^-7: every value is on the grid after scaling
        assert torch.equal(fp8_sim.fake_fp8(x), x)
    assert torch.equal(fp8_sim.fake_fp8(torch.zeros(5)), torch.zeros(5))  # amax 0: no division by zero
    torch.manual_seed(0)
    x = torch.randn(10_000) * 3
    q = fp8_sim.fake_fp8(x)
    scale = x.abs().max() / 448
    normal = x.abs() >= scale * 2.0**-6  # e4m3's smallest normal; below it the step is absolute
    rel = ((q - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0**-4 * (1 + 1e-6) and rel.max() > 2.0**-5  # 3 mantissa bits: half an ulp
    assert ((q - x).abs()[~normal] <= scale * 2.0**-10 * (1 + 1e-6)).all()  # half the subnormal step 2^-9
    assert not torch.equal(q, x)


def test_gradient_is_straight_through_and_linear_uses_the_quantised_operands():
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    upstream = torch.randn(4, 8)
    (fp8_sim.fake_fp8(x) * upstream).sum().backward()
    assert torch.equal(x.grad, upstream)  # d q(x) / d x = 1

    layer = torch.nn.Linear(8, 3)
    x.grad = None
    with fp8_sim.fp8_linears():
        out = layer(x)
    assert torch.nn.Linear.forward is not fp8_sim.fp8_linear_forward  # restored after the block
    qx, qw = fp8_sim.fake_fp8(x.detach()), fp8_sim.fake_fp8(layer.weight.detach())
    assert torch.equal(out, torch.nn.functional.linear(qx, qw, layer.bias))
    g = torch.randn(4, 3)
    out.backward(g)
    # the backward GEMMs read the quantised operands, the gradient itself unquantised
    assert torch.allclose(x.grad, g @ qw, atol=1e-6) and torch.allclose(layer.weight.grad, g.T @ qx, atol=1e-6)
    assert torch.equal(layer.bias.grad, g.sum(0))


def test_sft_through_the_wrapper_trains_close_to_the_plain_run(tmp_path, sft_data, monkeypatch, capsys):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.chdir(ROOT)
    flags = ["--dataset", sft_data, "--hidden_size", "64", "--num_layers", "1", "--max_steps", "4", "--batch_size", "4",
             "--optim", "adamw"]
    losses = {}
    for name in ("plain", "fp8"):
        out = str(tmp_path / name)
        if name == "fp8":
            fp8_sim.main(["sft.py", *flags, "--output_dir", out])
        else:
            monkeypatch.setattr(sys, "argv", ["sft.py", *flags, "--output_dir", out])
            fp8_sim.load_script("sft.py").main()
        losses[name] = [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]
        assert os.path.exists(os.path.join(out, "summary.json")) and os.path.exists(os.path.join(out, "model.safetensors"))
    assert "fp8_sim: FP8 simulation on" in capsys.readouterr().out
    assert torch.nn.Linear.forward is not fp8_sim.fp8_linear_forward
    plain, fp8 = losses["plain"], losses["fp8"]
    assert len(fp8) == len(plain) == 4 and all(math.isfinite(v) for v in fp8)
    assert fp8 != plain  # the simulation changed the run ...
    assert all(abs(a - b) < 0.01 * a for a, b in zip(plain, fp8)), (plain, fp8)  # ... by a little
