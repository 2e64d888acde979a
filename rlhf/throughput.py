"""How close a run comes to the machine's limit: each training step's time, the sampler's share
of it (the rollout), tokens per second of each, and the model FLOPs utilisation (MFU) of the
update, counted from the trained models' shape against the device's peak (docs/benchmarks.md,
"Throughput and MFU", states the count). The scripts pass nothing but their trained models:

    watch([policy, critic])    # MetricsLogger(args, start_step, trained): count their trained forwards
    start_step()               # tracking.progress, as each step begins
    add_rollout(seconds, n)    # rollouts.sample: the sampler's time and the tokens it sampled
    step_metrics()             # MetricsLogger.update, as each step ends: step_time, ..., mfu
    run_summary()              # checkpoints.finish_run: the same over the run, for summary.json
"""

import json
import math
import os
import platform
import time

import torch

# Dense (no sparsity) peak TFLOP/s per GPU: (bf16/fp16 tensor cores, tf32 tensor cores, fp32), the
# first name that is a word of torch.cuda.get_device_name() wins (so "H100 PCIe" before "H100").
GPU_PEAK_TFLOPS = {
    "H100 PCIe": (756, 378, 51),  # NVIDIA H100 Tensor Core GPU datasheet, PCIe column (1,513 / 756 with sparsity)
    "H100": (989.4, 494.7, 67),  # the same datasheet, SXM column (1,979 / 989 with sparsity)
    "H200": (989.4, 494.7, 67),  # NVIDIA H200 Tensor Core GPU datasheet, SXM column (1,979 / 989 with sparsity)
    "A100": (312, 156, 19.5),  # NVIDIA A100 Tensor Core GPU datasheet (624 / 312 with sparsity)
    "RTX 4090": (165.2, 82.6, 82.6),  # NVIDIA Ada Lovelace GPU architecture whitepaper, appendix A (FP32 accumulate)
    "L4": (121, 60, 30.3),  # NVIDIA L4 Tensor Core GPU datasheet (242 / 120 with sparsity)
    # GB10 (DGX Spark): NVIDIA gives only "1 PFLOP FP4 with sparsity"; halved for dense, then for
    # FP8 and again for BF16, as on every Blackwell part. No published TF32 / FP32 number.
    "GB10": (125, None, None),
}
MATMUL_SIZE = 512  # the CPU's peak: the best of a few (512 x 512) @ (512 x 512) matmuls in the run's dtype

# what a step's clock gives: the same run twice differs in these, and in nothing else it logs
TIMED = ("step_time", "rollout_time", "tokens_per_second", "rollout_tokens_per_second", "mfu")
RUN_KEYS = TIMED + ("flops_per_step", "peak_flops", "peak_flops_source")  # what run_summary adds to summary.json

_WATCHED = []  # (shape, counts_tokens) of each trained model, set by watch()
_HOOKS = []  # their forward hooks
_PEAK = {}  # {"flops": peak FLOP/s or None, "source": what it is}
_STEP = {}  # the step under way: its start, the rollout's seconds and tokens, the trained tokens and FLOPs
_RUN = []  # every finished step's (seconds, rollout seconds, rollout tokens, trained tokens, FLOPs)


# ============================================================================ the FLOP count
def model_shape(model):
    """(trainable, frozen, layers, attention width) of a transformers model (or a peft model's base):
    the elements of the weights a forward multiplies activations by -- every parameter of two or
    more dimensions except the input embedding, a lookup (the output head is one of them, tied to
    the input embedding or not) -- split by requires_grad, and the attention's layers and width
    (heads x head dimension)."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    trainable = frozen = 0
    for p in model.parameters():  # tied weights come once
        if p.dim() < 2 or (p is embedding and (head is None or head.weight is not embedding)):
            continue
        n = math.prod(p.quant_state.shape) if getattr(p, "quant_state", None) is not None else p.numel()  # 4-bit: unpacked
        trainable, frozen = (trainable + n, frozen) if p.requires_grad else (trainable, frozen + n)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return trainable, frozen, config.num_hidden_layers, config.num_attention_heads * head_dim


def train_flops(shape, tokens, attended):
    """FLOPs of one forward and backward pass over `tokens` tokens whose attention reads `attended`
    (query, key) pairs: 2 per weight per token forward, 2 more backward for the activations'
    gradient and 2 for the weight's (frozen weights: none), and 4 per pair and attention width for
    the scores and their weighted sum, three times for forward and backward (Chowdhery et al.
    2022, PaLM, appendix B: 6N + 12 L d T per token when every token reads T)."""
    trainable, frozen, layers, width = shape
    return (6 * trainable + 4 * frozen) * tokens + 12 * layers * width * attended


def forward_tokens(input_ids, attention_mask=None, position_ids=None):
    """(tokens, attended pairs) of one forward: its real tokens, and for each the real tokens of
    its row, the cached prompt's included (a causal kernel computes half; the count is PaLM's).
    Packed rows (no mask, positions restarting at 0) attend within each example; a block mask
    (prompt_rows: a prompt and its completions in one row) counts twice the pairs it allows."""
    B, T = input_ids.shape
    if attention_mask is not None and attention_mask.dim() == 4:  # sampling.prompt_rows' block mask (B, 1, T, T)
        sees = attention_mask[:, 0]
        real = sees.diagonal(dim1=1, dim2=2)  # (B, T): a real token sees itself, a pad does not
        return real.sum(), 2 * (sees.sum(-1) * real).sum()  # twice the pairs a causal mask allows: PaLM's count
    if attention_mask is not None:
        real = attention_mask[:, -T:].sum(1)  # (B,) this call's real tokens; the mask may also cover a cache
        return real.sum(), (real * attention_mask.sum(1)).sum()
    if position_ids is not None:  # example e of row b: the tokens from one position 0 to the next
        example = (position_ids == 0).cumsum(1) + (T + 1) * torch.arange(B, device=position_ids.device)[:, None]
        return B * T, (torch.bincount(example.flatten()) ** 2).sum()
    return B * T, B * T * T


def watch(models):
    """Count the trained forwards of `models` (a model, a list, or None; the first one's tokens are
    the update's tokens): a hook on each transformer body notes every forward run with gradients
    on. Forwards without gradients (the rollout, a frozen reference, evaluation) are not counted.
    A new run in the same process starts its counts afresh."""
    models = [m for m in (models if isinstance(models, (list, tuple)) else [models]) if m is not None]
    for hook in _HOOKS:
        hook.remove()
    _HOOKS.clear(), _WATCHED.clear(), _RUN.clear(), _STEP.clear(), _PEAK.clear()
    bodies = set()
    for model in models:
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        body = getattr(inner, inner.base_model_prefix)
        if id(body) in bodies:  # two adapters on one base: its forwards are counted once, by their shape
            continue
        bodies.add(id(body))
        _WATCHED.append((model_shape(model), not _WATCHED))
        _HOOKS.append(body.register_forward_pre_hook(_count(len(_WATCHED) - 1), with_kwargs=True))
    if models:
        p = next(models[0].parameters())
        _PEAK.update(peak_flops(p.device, p.dtype))


def _count(index):
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not torch.is_grad_enabled() or ids is None or not _STEP:
            return
        shape, counts_tokens = _WATCHED[index]
        tokens, attended = forward_tokens(ids, kwargs.get("attention_mask"), kwargs.get("position_ids"))
        _STEP["flops"] += train_flops(shape, tokens, attended)  # tensors: no wait for the device here
        if counts_tokens:
            _STEP["tokens"] += tokens
    return hook


# ============================================================================ the device's peak
def peak_flops(device, dtype):
    """{"flops": the device's peak FLOP/s for `dtype` (None where unknown), "source": what it is}:
    on a GPU its datasheet's dense number (GPU_PEAK_TFLOPS); on the CPU a short matmul measurement,
    cached under the user's cache folder by CPU model, thread count and dtype."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        card = next((c for c in GPU_PEAK_TFLOPS if f" {c} " in f" {name.replace('-', ' ')} "), None)
        column = 0 if dtype in (torch.bfloat16, torch.float16) else 1 if torch.backends.cuda.matmul.allow_tf32 else 2
        what = ("bf16/fp16", "tf32", "fp32")[column]
        tflops = GPU_PEAK_TFLOPS[card][column] if card else None
        if tflops is None:
            print(f"throughput: no dense {what} peak known for {name} (rlhf/throughput.py GPU_PEAK_TFLOPS): mfu is not reported")
            return {"flops": None, "source": f"{name}: unknown"}
        return {"flops": tflops * 1e12, "source": f"{name}: datasheet dense {what} {tflops} TFLOP/s"}
    if device.type != "cpu":
        return {"flops": None, "source": f"{device.type}: unknown"}
    key = f"{cpu_model()}|{torch.get_num_threads()} threads|{str(dtype).replace('torch.', '')}"
    path = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rlhf", "cpu_peak_flops.json")
    try:
        with open(path) as f:
            cache = json.load(f)
    except (OSError, ValueError):  # absent, or torn by a concurrent writer: measured again
        cache = {}
    if key not in cache:
        cache[key] = measure_matmul_flops(dtype)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(f"{path}.{os.getpid()}", "w") as f:
                json.dump(cache, f, indent=1)
            os.replace(f"{path}.{os.getpid()}", path)
        except OSError:  # a read-only home: measured at every start instead (a fraction of a second)
            pass
    return {"flops": cache[key], "source": f"{key}: measured {MATMUL_SIZE}x{MATMUL_SIZE} matmul"}


def cpu_model():
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def measure_matmul_flops(dtype, n=MATMUL_SIZE, seconds=0.2):
    """The best FLOP/s of (n x n) @ (n x n) matmuls in `dtype` on the CPU over about `seconds`:
    the best, not the mean, so that other processes' load counts as little as it can."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b  # warm-up: the kernel's first call allocates and picks its path
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


# ============================================================================ a step, a run
def start_step():
    """A training step begins: its clock starts, and its counts with it."""
    _sync()
    _STEP.update(start=time.perf_counter(), rollout_seconds=0.0, rollout_tokens=0, tokens=0, flops=0)


def add_rollout(seconds, tokens):
    """The sampler took `seconds` to sample `tokens` tokens (the policy's own, not the prompts' or a tool's)."""
    if _STEP:
        _STEP["rollout_seconds"] += seconds
        _STEP["rollout_tokens"] += int(tokens)


def step_metrics():
    """The step that ends now, for metrics.jsonl: `step_time` (seconds from its start to here:
    rollout, scoring and update; logging, evaluation and saving come after), `rollout_time` and
    `rollout_tokens_per_second` (the sampler, where the step sampled), `tokens_per_second` (the
    tokens the policy trained on over the rest of the step) and `mfu` (the trained models' FLOPs
    over the rest of the step, against the device's peak). {} outside a step."""
    if not _STEP:
        return {}
    _sync()
    step = _STEP.copy()
    _STEP.clear()
    row = (time.perf_counter() - step["start"], step["rollout_seconds"], step["rollout_tokens"],
           float(step["tokens"]), float(step["flops"]))
    _RUN.append(row)
    return rates([row])


def rates(rows):
    """The metrics of a list of steps' (seconds, rollout seconds, rollout tokens, tokens, FLOPs):
    totals over totals, so a long step weighs as much as it took."""
    seconds, rollout_seconds, rollout_tokens, tokens, flops = (sum(c) for c in zip(*rows))
    update_seconds = max(seconds - rollout_seconds, 1e-9)
    out = {"step_time": seconds / len(rows), "tokens_per_second": tokens / update_seconds}
    if rollout_tokens:
        out.update(rollout_time=rollout_seconds / len(rows), rollout_tokens_per_second=rollout_tokens / max(rollout_seconds, 1e-9))
    if _PEAK.get("flops"):
        out["mfu"] = flops / update_seconds / _PEAK["flops"]
    return out


def run_summary():
    """The run's steps after its first (which warms up; the only one if there is one), for
    summary.json: the step metrics over them, the peak they are measured against, and the update's
    FLOPs per step. {} when no step ran in this process."""
    if not _RUN:
        return {}
    rows = _RUN[1:] or _RUN
    return {**rates(rows), "flops_per_step": sum(r[4] for r in rows) / len(rows),
            "peak_flops": _PEAK.get("flops"), "peak_flops_source": _PEAK.get("source")}


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the time of kernels queued so far belongs to the step that queued them
