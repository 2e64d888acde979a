"""torchrun plumbing: process group, ranks, sharding a batch, reductions, and data parallelism
(DDP arithmetic and FSDP2). Every function is a no-op or the identity in a single process, so
the scripts call them unconditionally. Nobody needs to read this to fork an algorithm file.
"""

import os
import sys

import torch
import torch.distributed as dist

from rlhf import basics


def init_distributed():
    """Join torchrun's process group when there is one (RANK, WORLD_SIZE, LOCAL_RANK in the
    environment): nccl with one GPU per rank on CUDA, gloo on the CPU. Ranks other than 0 print
    nothing (their stdout goes to /dev/null; errors still reach stderr). Single process: no-op."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # so "cuda" means this rank's GPU
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- lives as long as the process


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def is_dtensor(t):
    """Whether `t` is an FSDP2 shard (a DTensor). None exists outside a process group, and
    torch.distributed.tensor is imported only then: it is a slow import (--help)."""
    if not dist.is_initialized():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def is_main():
    """Rank 0, also before the process group exists (torchrun's RANK): the lines printed while the
    arguments are parsed appear once, not once per rank."""
    return (rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0


def barrier():
    if dist.is_initialized():
        dist.barrier()


def shard(items):
    """This rank's contiguous slice of a global batch (a list, or a tensor along dim 0), so that
    N ranks x batch b see exactly the examples of 1 rank x batch N*b."""
    n, w, r = len(items), world_size(), rank()
    if n % w:
        basics.fail(f"a global batch of {n} does not split over {w} ranks; make it a multiple of the number of processes.")
    return items[r * n // w:(r + 1) * n // w]


def all_reduce(value, op="mean"):
    """Mean (or sum) of a number or tensor over ranks; the value itself in a single process.
    A collective: every rank must call it."""
    t = torch.as_tensor(value, dtype=torch.float64 if not torch.is_tensor(value) else None).detach().clone()
    if world_size() > 1:
        t = t.to(basics.device())
        dist.all_reduce(t)
        t = t / world_size() if op == "mean" else t
    return t if torch.is_tensor(value) else float(t)


def all_gather(t):
    """Every rank's tensor (the same shape on each), concatenated along dim 0 in rank order: the
    global batch of a per-rank tensor. The tensor itself in a single process. A collective."""
    if world_size() == 1:
        return t
    parts = [torch.empty_like(t, device=basics.device()) for _ in range(world_size())]
    dist.all_gather(parts, t.to(basics.device()).contiguous())
    return torch.cat(parts)


def mean_over_ranks(metrics):
    """A metrics dict with its numbers averaged over ranks, key by key. Ranks may log different
    keys (dpo.py --online: a rank whose pairs all tied has no loss): the key sets are gathered
    first, and a rank without a key is absent from that key's mean, not a zero. Other values
    (text) are this rank's. A collective: every rank must call it."""
    numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    key_sets = [None] * world_size()
    dist.all_gather_object(key_sets, list(numbers))
    keys = list(dict.fromkeys(k for ks in key_sets for k in ks))  # rank 0's order first
    if not keys:
        return metrics
    sums = torch.tensor([[numbers.get(k, 0.0), float(k in numbers)] for k in keys], dtype=torch.float64,
                        device=basics.device())  # (K, 2): sum of values, number of ranks that logged it
    dist.all_reduce(sums)
    out = dict(metrics)
    for k, (total, count) in zip(keys, sums.tolist()):
        mean = total / count
        out[k] = int(mean) if isinstance(metrics.get(k), int) and mean == int(mean) else mean
    return out


def is_sharded_param(p):
    return is_dtensor(p)


def is_sharded(model):
    return any(is_sharded_param(p) for p in model.parameters())


def distribute(model, args):
    """Make a trainable model data-parallel under torchrun (no-op in a single process).

    Both modes first copy rank 0's weights to every rank (a randomly initialised head must be
    the same everywhere). `ddp`: weights stay replicated and `optimizer_step` averages the
    gradients with one all-reduce per bucket -- DDP's arithmetic, without its wrapper, because
    completion_logprobs calls the backbone and the head separately. `fsdp2`: every decoder layer
    is sharded with `fully_shard` (FSDP2: it gathers a layer for its forward and reduce-scatters
    its gradients); embeddings, final norm and head stay replicated (they may be tied) and are
    averaged like `ddp`. Call before make_optimizer, which must see the sharded parameters.
    """
    if world_size() == 1:
        return model
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    if args.parallel == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        layers = getattr(getattr(model, model.base_model_prefix), "layers", None) or getattr(getattr(model, model.base_model_prefix), "h", None)
        if layers is None:
            basics.fail(f"--parallel fsdp2: cannot find the decoder layers of {type(model).__name__}; use --parallel ddp.")
        for layer in layers:  # each layer is its own FSDP root: explicit resharding after every forward
            dtype = next(layer.parameters()).dtype
            if dtype == torch.float32:
                fully_shard(layer, reshard_after_forward=True)
            else:  # fp32 master shards, compute in bf16/fp16: exact small updates without stochastic rounding
                fully_shard(layer.float(), reshard_after_forward=True,
                            mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
    return model


def sync_gradients(params):
    """Average the gradients of replicated parameters over ranks (sharded FSDP2 parameters are
    already reduced). A parameter with a gradient on some ranks only counts as zero on the
    others; one with a gradient on no rank keeps none (the optimizer skips it, as in one process)."""
    params = [p for p in params if p.requires_grad and not is_dtensor(p)]
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=basics.device())
    dist.all_reduce(has_grad)
    params = [p for p, h in zip(params, has_grad.tolist()) if h > 0]
    buckets, numel = [[]], 0  # a few large messages; one fp32 bucket of basics.SR_BUCKET_NUMEL at most
    for p in params:
        if numel + p.numel() > basics.SR_BUCKET_NUMEL and buckets[-1]:
            buckets.append([])
            numel = 0
        buckets[-1].append(p)
        numel += p.numel()
    for bucket in filter(None, buckets):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        flat /= world_size()
        for p, g in zip(bucket, flat.split([g.numel() for g in grads])):
            p.grad = g.view_as(p).to(p.dtype)


def grad_norm_(params, max_grad_norm):
    """clip_grad_norm_ for a mix of replicated parameters and FSDP2 shards (DTensors): the
    shards' squared norms are summed over ranks. Returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g.to_local().float().pow(2).sum() for g in grads if is_dtensor(g)]
    sq = torch.stack(sharded).sum() if sharded else torch.zeros((), device=grads[0].device)
    dist.all_reduce(sq)
    sq = sq + sum(g.float().pow(2).sum() for g in grads if not is_dtensor(g))
    norm = sq.sqrt()
    if max_grad_norm > 0:
        scale = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            (g.to_local() if is_dtensor(g) else g).mul_(scale)
    return norm



def full_state_dict(model):
    """The model's weights with FSDP2 shards gathered into plain tensors (a collective), in the
    dtype of the replicated weights (bf16 layers keep fp32 master shards while training)."""
    dtype = next(p.dtype for p in model.parameters() if not is_sharded_param(p))
    return {k: v.full_tensor().to("cpu", dtype) if is_sharded_param(v) else v for k, v in model.state_dict().items()}

