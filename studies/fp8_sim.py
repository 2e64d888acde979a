"""studies/fp8_sim.py: run any of the scripts with FP8 (e4m3) matmuls *simulated* in every
nn.Linear (issue #28, claim 4's open question on FP8 training; docs/studies.md). A study tool, not a
flag of the scripts: the run goes through the real script's main(), so it writes the same
metrics.jsonl, summary.json and saved model as without the simulation.

    python studies/fp8_sim.py SCRIPT.py [the script's own arguments...]
    python studies/fp8_sim.py sft.py --seed 1 --output_dir runs/fp8/sft/seed1
    python sweep.py studies/fp8_sim.py --seeds 0,1,2 --output_dir runs/fp8 -- sft.py --max_steps 50

(sweep.py passes everything after `--` first when the sweep has no axes, so SCRIPT.py comes first;
a sweep with axes would put their flags before it, which this wrapper refuses: loop over settings.)

What is simulated: the class-level forward of torch.nn.Linear is replaced, for the whole process,
by `F.linear(q(x), q(W), b)`, where q quantises a tensor to float8 e4m3fn with one per-tensor
scale (current scaling: amax / 448 of this very tensor, 1 where amax == 0), computed in the
tensor's own dtype, and dequantises it back (quantise-dequantise); the bias is untouched. The
gradient is straight-through (x + (q(x) - x).detach()): the backward multiplies the incoming
gradient, in full precision, with the quantised operands saved by the forward. Every Linear of the
process is covered: the policy's attention and MLP projections, the LoRA adapters' A and B, a
reward model's score head, a value head, and the LM head -- the tiny Qwen2 (scratch.py) ties it
to the embedding, so the output projection reads that shared weight quantised while the embedding
lookup (nn.Embedding, no matmul) reads it unquantised. Frozen models (reference, reward model)
and generation (rollouts, the scripts' own gold evaluation in summary.json) run under the
simulation too: FP8 inference everywhere in the process, as one switch over the hardware would
give; the saved weights are the full-precision master weights, so eval.py, a separate process,
scores them without it. Not simulated: real FP8 kernels (no speed or memory is saved here: the
matmul runs in fp32 or bf16 on dequantised values, about what an FP8 GEMM's higher-precision
accumulator gives, not bit for bit); FP8 gradients (e5m2 in the usual hybrid recipe) or FP8
optimizer states; delayed scaling (an amax history) and per-block scaling (DeepSeek-V3's 1x128
tiles); the attention score and value matmuls, norms, softmax and residual adds, which stay in
the model's dtype (as in Transformer Engine); layers that override Linear.forward
(bitsandbytes' 4- and 8-bit layers under --load_in_4bit/8bit) are left as they are. The scale is
per call: sampling.py's chunked log-prob head (chunks of 2**26 / vocab tokens) gets one per chunk,
and padding positions count in the amax, as they would in a real FP8 GEMM.
"""

import contextlib
import importlib.util
import os
import sys

import torch
import torch.nn.functional as F

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def fake_fp8(x):
    """x quantised to float8 e4m3fn with one per-tensor scale (amax / 448) and dequantised, in x's
    dtype; straight-through: d out / d x = 1."""
    amax = x.detach().abs().amax()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))  # an all-zero tensor stays zero
    # clamp: the scale's rounding (bf16) can put amax a hair above 448, and older torch casts gave NaN there, not 448
    q = (x.detach() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale
    return x + (q - x).detach()  # forward: q exactly (Sterbenz: q is within 2x of x); backward: identity


def fp8_linear_forward(self, input):
    """nn.Linear.forward with the input activation and the weight fake-quantised; bias as it is."""
    return F.linear(fake_fp8(input), fake_fp8(self.weight), self.bias)


@contextlib.contextmanager
def fp8_linears():
    """Every nn.Linear of the process runs fp8_linear_forward inside the block (restored after)."""
    original = torch.nn.Linear.forward
    torch.nn.Linear.forward = fp8_linear_forward
    try:
        yield
    finally:
        torch.nn.Linear.forward = original


def load_script(path):
    """A script (sft.py, grpo.py, a fork) imported from its path as a module named after its file,
    with its folder first on sys.path so that its own imports (common, data, ...) resolve."""
    if not path.endswith(".py") or not os.path.isfile(path):
        sys.exit(f"fp8_sim: error: {path!r} is not a script; usage: python studies/fp8_sim.py SCRIPT.py [its arguments...]")
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = os.path.splitext(os.path.basename(path))[0]
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == os.path.abspath(path):
        return loaded  # imported already (a test in this process): the same module, not a second copy
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and HfArgumentParser resolve Args' annotations through it
    spec.loader.exec_module(module)  # its `if __name__ == "__main__"` stays off: we call main() below
    if not callable(getattr(module, "main", None)):
        sys.exit(f"fp8_sim: error: {path} has no main() to call.")
    return module


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0].startswith("-"):
        sys.exit("fp8_sim: error: usage: python studies/fp8_sim.py SCRIPT.py [its arguments...] (the script comes "
                 f"first; got {' '.join(argv) or 'nothing'}). With sweep.py: no axes, and SCRIPT.py first after '--'.")
    module = load_script(argv[0])
    sys.argv = argv  # the script parses its own flags, and names its runs after sys.argv[0] (basics.script_name)
    print(f"fp8_sim: FP8 simulation on: every nn.Linear fake-quantises its input and weight to float8 e4m3 "
          f"(per-tensor amax/{E4M3_MAX:g} scale, straight-through gradients) for {argv[0]}", flush=True)
    with fp8_linears():
        module.main()


if __name__ == "__main__":
    main()
