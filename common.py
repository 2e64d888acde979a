"""Plumbing shared by every script: arguments, loading, the optimizer, data, log-probs,
generation, logging, checkpoints and memory accounting. No algorithm lives here: losses,
advantages, KL and clipping stay in sft.py / reward.py / ppo.py / dpo.py / grpo.py.
"""

import contextlib
import functools
import importlib.util
import inspect
import json
import logging
import os
import random
import resource
import shutil
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import DynamicCache

import world

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its CPU-kernel import notice is noise here

EMBEDDED = "embedded"  # --dataset value (and the default) that selects the embedded world


# ============================================================================ arguments
@dataclass
class TrainArgs:
    """The command-line contract shared by every training script (TRL's names where TRL has one)."""

    # model and data
    model: str = field(default="runs/sft", metadata={"help": "Hub id or local folder of the model to start from."})
    dataset: str = field(default=EMBEDDED, metadata={"help": "'embedded' (the synthetic TL;DR world), a Hub dataset name, or a local .jsonl/.json/.parquet file or folder."})
    dataset_split: str = field(default="train", metadata={"help": "Split of --dataset to train on (Hub datasets and folders)."})
    output_dir: str = field(default="", metadata={"help": "Where metrics.jsonl, checkpoints, summary.json and the final model go (default: runs/<script>)."})
    seed: int = field(default=0, metadata={"help": "Random seed for data order, initialisation and sampling."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom modelling code from the Hub (off: only transformers' own code runs)."})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | float16 | float32."})
    attn_implementation: str = field(default="auto", metadata={"help": "auto (flash_attention_2 if importable on CUDA, else sdpa) | sdpa | eager | flash_attention_2."})
    # optimisation
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps; more than one pass over the data cycles through it again."})
    learning_rate: float = field(default=1e-5, metadata={"help": "Peak learning rate."})
    lr_scheduler_type: str = field(default="constant_with_warmup", metadata={"help": "Any transformers scheduler name: constant_with_warmup, linear, cosine, ..."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up steps."})
    batch_size: int = field(default=8, metadata={"help": "Examples per micro-batch (TRL: per_device_train_batch_size)."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    optim: str = field(default="adamw_8bit", metadata={"help": "adamw_8bit (bitsandbytes) | adamw (torch)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0 disables)."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward: less memory, about a third more time."})
    # logging and saving
    logging_steps: int = field(default=1, metadata={"help": "Log metrics every this many steps."})
    save_steps: int = field(default=0, metadata={"help": "Save <output_dir>/checkpoint-<step>/ every this many steps (0: final save only)."})
    report_to: str = field(default="none", metadata={"help": "none | tensorboard | wandb (imported only when asked)."})
    eval_batch_size: int = field(default=64, metadata={"help": "Prompts per generation batch when scoring the test split."})
    estimate_memory: bool = field(default=False, metadata={"help": "Print the memory plan per component for these settings (reads only the model's config.json) and exit."})
    # resume and parallelism
    resume: bool = field(default=False, metadata={"help": "Continue from the newest <output_dir>/checkpoint-<step>/ (starts fresh, saying so, if there is none)."})
    resume_from_checkpoint: str = field(default="", metadata={"help": "Continue from this checkpoint folder."})
    parallel: str = field(default="ddp", metadata={"help": "Under torchrun: ddp (weights replicated, gradients averaged) | fsdp2 (decoder layers sharded with fully_shard)."})


def parse_args(cls, script):
    """Parse the command line into the script's Args dataclass; fill the output folder."""
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(cls).parse_args_into_dataclasses()
    args.output_dir = args.output_dir or os.path.join("runs", script)
    check_choice("--optim", args.optim, ["adamw_8bit", "adamw"])
    check_choice("--dtype", args.dtype, ["auto", "bfloat16", "float16", "float32"])
    check_choice("--report_to", args.report_to, ["none", "tensorboard", "wandb"])
    check_choice("--attn_implementation", args.attn_implementation, ["auto", "sdpa", "eager", "flash_attention_2"])
    check_choice("--parallel", args.parallel, ["ddp", "fsdp2"])
    if args.parallel == "fsdp2" and args.optim == "adamw_8bit":
        fail("--parallel fsdp2 needs --optim adamw: bitsandbytes' 8-bit AdamW cannot step FSDP2's sharded "
             "(DTensor) parameters. Or keep adamw_8bit with --parallel ddp.")
    if args.resume_from_checkpoint and not os.path.isfile(os.path.join(args.resume_from_checkpoint, "trainer_state.pt")):
        fail(f"--resume_from_checkpoint {args.resume_from_checkpoint}: no trainer_state.pt there; pass a "
             "<output_dir>/checkpoint-<step> folder written by --save_steps.")
    for name in ("max_steps", "batch_size", "gradient_accumulation_steps", "logging_steps"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be at least 1, got {getattr(args, name)}.")
    if args.estimate_memory:
        print_memory_plan(args, script)  # prints the plan and exits
    return args


def check_choice(flag, value, choices):
    if value not in choices:
        fail(f"{flag} {value!r} is not one of: {', '.join(choices)}.")


def fail(message):
    """Stop the run with a message a person can act on (no traceback for user errors)."""
    sys.exit(f"error: {message}")


def set_seed(seed):
    random.seed(seed)
    torch.manual_seed(seed)


# ============================================================================ models
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def torch_dtype(name):
    """bf16 on CUDA and fp32 on CPU unless told otherwise."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)


def attn_implementation(name):
    if name != "auto":
        return name
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_tokenizer(name, trust_remote_code=False):
    """AutoTokenizer from a Hub id or folder; a missing pad token falls back to EOS.

    Masks in this project come from lengths, never from token ids, so pad == EOS is safe.
    """
    from transformers import AutoTokenizer

    check_model_source(name)
    if _saved_as_generic_tokenizer(name):
        # transformers 5's AutoTokenizer would pick the model type's class (Qwen2Tokenizer for the
        # world's tiny Qwen2) and rebuild its pre-tokenizer and decoder, breaking a custom
        # tokenizer.json such as the world's word-level one; load it exactly as it was saved.
        from transformers import TokenizersBackend

        tokenizer = TokenizersBackend.from_pretrained(name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        fail(f"the tokenizer of {name} has no EOS token; set one with tokenizer.eos_token = ... and save it.")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _saved_as_generic_tokenizer(name):
    path = os.path.join(name, "tokenizer_config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")


def check_model_source(name):
    if name == "runs/sft" and not os.path.exists(os.path.join(name, "config.json")):
        fail("runs/sft holds no model yet: run `python sft.py` first, or pass --model.")
    looks_local = name.startswith((".", "/", "~", "runs/")) or name.count("/") > 1  # Hub ids are org/name
    if looks_local and not os.path.exists(name):
        fail(f"model folder {name} does not exist.")


def load_model(name, args, cls=None, **kwargs):
    """`cls.from_pretrained` (AutoModelForCausalLM by default) with our dtype/attention rules,
    safetensors only, no remote code unless asked, on the training device."""
    from transformers import AutoModelForCausalLM

    check_model_source(name)
    cls = cls or AutoModelForCausalLM
    model = cls.from_pretrained(
        name, dtype=torch_dtype(args.dtype), attn_implementation=attn_implementation(args.attn_implementation),
        trust_remote_code=args.trust_remote_code, use_safetensors=True, **kwargs,
    )
    if getattr(args, "gradient_checkpointing", False):
        enable_checkpointing(model)
    return model.to(device())


def enable_checkpointing(model):
    """Activation (gradient) checkpointing of every decoder layer, non-reentrant; transformers 5
    renamed `gradient_checkpointing_enable` to `activation_checkpointing_enable`."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def freeze(model):
    """A frozen copy in eval mode: no grads, dropout off."""
    model.eval()
    model.requires_grad_(False)
    return model


# ============================================================================ distributed (torchrun)
def init_distributed():
    """Join torchrun's process group when there is one (RANK, WORLD_SIZE, LOCAL_RANK in the
    environment): nccl with one GPU per rank on CUDA, gloo on the CPU. Ranks other than 0 print
    nothing (their stdout goes to /dev/null; errors still reach stderr). Single process: no-op."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # so "cuda" means this rank's GPU
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- lives as long as the process


def single_process(script):
    """Stop under torchrun for a script that runs in one process only: N copies would each train
    the whole run and write the same output folder."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        fail(f"{script} runs in one process (it is not wired for torchrun yet); launch it with `python {script}`.")


def rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def is_main():
    return rank() == 0


def barrier():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def shard(items):
    """This rank's contiguous slice of a global batch (a list, or a tensor along dim 0), so that
    N ranks x batch b see exactly the examples of 1 rank x batch N*b."""
    n, w, r = len(items), world_size(), rank()
    if n % w:
        fail(f"a global batch of {n} does not split over {w} ranks; make it a multiple of the number of processes.")
    return items[r * n // w:(r + 1) * n // w]


def all_reduce(value, op="mean"):
    """Mean (or sum) of a number or tensor over ranks; the value itself in a single process.
    A collective: every rank must call it."""
    import torch.distributed as dist

    t = torch.as_tensor(value, dtype=torch.float64 if not torch.is_tensor(value) else None).detach().clone()
    if world_size() > 1:
        t = t.to(device())
        dist.all_reduce(t)
        t = t / world_size() if op == "mean" else t
    return t if torch.is_tensor(value) else float(t)


def is_sharded_param(p):
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


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
    import torch.distributed as dist

    if world_size() == 1:
        return model
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    if args.parallel == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        layers = getattr(backbone(model), "layers", None) or getattr(backbone(model), "h", None)
        if layers is None:
            fail(f"--parallel fsdp2: cannot find the decoder layers of {type(model).__name__}; use --parallel ddp.")
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
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.requires_grad and not isinstance(p, DTensor)]
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=device())
    dist.all_reduce(has_grad)
    params = [p for p, h in zip(params, has_grad.tolist()) if h > 0]
    buckets, numel = [[]], 0  # a few large messages; one fp32 bucket of SR_BUCKET_NUMEL at most
    for p in params:
        if numel + p.numel() > SR_BUCKET_NUMEL and buckets[-1]:
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
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g.to_local().float().pow(2).sum() for g in grads if isinstance(g, DTensor)]
    sq = torch.stack(sharded).sum() if sharded else torch.zeros((), device=grads[0].device)
    dist.all_reduce(sq)
    sq = sq + sum(g.float().pow(2).sum() for g in grads if not isinstance(g, DTensor))
    norm = sq.sqrt()
    if max_grad_norm > 0:
        scale = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(scale)
    return norm


# ============================================================================ optimizer
def make_optimizer(model, args):
    """AdamW over the trainable parameters: bitsandbytes 8-bit (default) or torch's.

    bf16 weights: a step that is smaller than half a bf16 ulp (lr 1e-6 on a weight of 1 is 1e-6,
    the ulp is 8e-3) rounds to nothing with round-to-nearest. `optimizer_step` therefore runs the
    optimizer on fp32 copies, one bucket of parameters at a time, and writes the result back
    with *stochastic rounding*: unbiased, so small updates survive in expectation. It costs no
    persistent memory (no master weights): only an fp32 copy of one bucket (`SR_BUCKET_NUMEL`)
    of weights and grads during the step.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=args.weight_decay)
    if args.optim == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kw)
    return torch.optim.AdamW(params, **kw)


def make_scheduler(optimizer, args):
    from transformers import get_scheduler

    return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                         num_training_steps=args.max_steps)


SR_BUCKET_NUMEL = 2**26  # parameters per fp32 bucket in optimizer_step (256 MB of fp32 weights)


def stochastic_round_(target, source):
    """Copy fp32 `source` into bf16 `target`, rounding up with probability equal to the
    fraction of the bf16 ulp that round-down would lose (Gupta et al. 2015)."""
    bits = source.view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    target.copy_(((bits + noise) & -65536).view(torch.float32))  # dropping 16 low bits is exact


@torch.no_grad()
def optimizer_step(optimizer, max_grad_norm=0.0):
    """Clip gradients, step, zero gradients; low-precision weights get stochastic rounding.

    Returns the gradient norm before clipping. Under torchrun, gradients are first averaged
    over ranks (see `distribute`).
    """
    if world_size() > 1:  # under torchrun: average gradients over ranks first (see `distribute`)
        sync_gradients([p for g in optimizer.param_groups for p in g["params"]])
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if world_size() > 1 and any(is_sharded_param(p) for p in params):
        grad_norm = grad_norm_(params, max_grad_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    low = [p for p in params if p.dtype == torch.bfloat16]
    if not low:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm
    grads = {p: p.grad for p in low}
    for p in low:
        p.grad = None
    optimizer.step()  # full-precision parameters (and none of the bf16 ones) step here
    optimizer.zero_grad(set_to_none=True)
    bucket, numel = [], 0
    for i, p in enumerate(low):
        bucket.append(p)
        numel += p.numel()
        if numel < SR_BUCKET_NUMEL and i < len(low) - 1:
            continue
        half = [p.data for p in bucket]
        for p in bucket:  # the optimizer sees fp32 weights and grads for this bucket only
            p.data, p.grad = p.data.float(), grads.pop(p).float()
        optimizer.step()
        for p, h in zip(bucket, half):
            stochastic_round_(h, p.data)
            p.data, p.grad = h, None
        bucket, numel = [], 0
    return grad_norm


# ============================================================================ data
def load_data(spec, split="train"):
    """A `datasets.Dataset` from a Hub name, a local .jsonl/.json/.parquet file, or a folder.

    JSONL is checked line by line first, so a malformed row names its file and line.
    """
    from datasets import load_dataset

    if os.path.isfile(spec):
        ext = os.path.splitext(spec)[1].lower()
        if ext in (".jsonl", ".json"):
            if ext == ".jsonl":
                check_jsonl(spec)
            return load_dataset("json", data_files=spec, split="train")
        if ext == ".parquet":
            return load_dataset("parquet", data_files=spec, split="train")
        fail(f"{spec}: unsupported file type {ext!r}; use .jsonl, .json or .parquet.")
    if spec.endswith((".jsonl", ".json", ".parquet")) and not os.path.exists(spec):
        fail(f"dataset file {spec} does not exist.")
    return load_dataset(spec, split=split)


def training_data(args, world_split):
    """The script's --dataset: on the embedded world its `world_split` split (sft, prefs or rl),
    otherwise load_data(--dataset, --dataset_split)."""
    if args.dataset == EMBEDDED:
        return embedded_world(args.seed)[world_split]
    return load_data(args.dataset, args.dataset_split)


def check_jsonl(path):
    with open(path) as f:
        n = 0
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{path}, line {n}: not valid JSON ({e.msg} at column {e.colno}).")
            if not isinstance(row, dict):
                fail(f"{path}, line {n}: each line must be a JSON object, got {type(row).__name__}.")
    if n == 0:
        fail(f"{path} is empty.")


def dataset_name(spec):
    return "the embedded world" if spec == EMBEDDED else spec


def require_columns(ds, columns, spec, hint=""):
    """Stop with a message naming the missing column and the dataset."""
    for col in columns:
        if col not in ds.column_names:
            fail(f"{dataset_name(spec)} has no column {col!r} (columns: {', '.join(ds.column_names)}). {hint}".strip())
    if len(ds) == 0:
        fail(f"{dataset_name(spec)} is empty.")


def is_conversational(value):
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def check_text(ds, columns, spec):
    """Every value of these columns is a non-empty string or a list of {role, content} messages."""
    for col in columns:
        for i, v in enumerate(ds[col]):
            if not ((isinstance(v, str) and v.strip()) or (is_conversational(v) and v)):
                fail(f"{dataset_name(spec)}, row {i}, column {col!r}: expected non-empty text or a list of "
                     f"{{role, content}} messages, got {str(v)[:80]!r}.")


def render_prompt(tokenizer, prompt):
    """Prompt text: plain strings as they are; conversations through the chat template."""
    if isinstance(prompt, str):
        return prompt
    if not tokenizer.chat_template:
        fail("conversational data needs a tokenizer with a chat template; this one has none.")
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def render_completion(tokenizer, prompt, completion):
    """Completion text: plain strings as they are; assistant messages as the chat template
    writes them after the prompt (so the end-of-turn token is trained on)."""
    if isinstance(completion, str):
        return completion
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    head = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    if not full.startswith(head):
        fail("the chat template does not render the prompt as a prefix of prompt + completion; "
             "pass prompt/completion as plain strings instead.")
    return full[len(head):]


def sft_pairs(ds, spec):
    """(prompt, completion) pairs from TRL's SFT formats: prompt+completion, or messages
    (the last assistant turn is the completion, everything before it the prompt)."""
    if "messages" in ds.column_names:
        check_text(ds, ["messages"], spec)
        pairs = []
        for i, msgs in enumerate(ds["messages"]):
            if not is_conversational(msgs) or msgs[-1]["role"] != "assistant" or len(msgs) < 2:
                fail(f"{dataset_name(spec)}, row {i}, column 'messages': must end with an assistant turn after at least one other turn.")
            pairs.append((msgs[:-1], msgs[-1:]))
        return pairs
    if "text" in ds.column_names and "completion" not in ds.column_names:
        fail(f"{dataset_name(spec)} is in the language-modelling format (a 'text' column); this project trains on "
             "prompt+completion or messages, so split each row into 'prompt' and 'completion'.")
    require_columns(ds, ["prompt", "completion"], spec, "Expected prompt+completion or messages.")
    check_text(ds, ["prompt", "completion"], spec)
    return list(zip(ds["prompt"], ds["completion"]))


def preference_triples(ds, spec):
    """(prompt, chosen, rejected) from TRL's preference formats, standard or conversational;
    without a prompt column, the prompt is the shared conversation before the last turn."""
    require_columns(ds, ["chosen", "rejected"], spec, "Preference data needs prompt + chosen + rejected.")
    if "prompt" not in ds.column_names:
        triples = []
        for i, (c, r) in enumerate(zip(ds["chosen"], ds["rejected"])):
            if not (is_conversational(c) and is_conversational(r) and c[:-1] == r[:-1] and len(c) > 1):
                fail(f"{dataset_name(spec)}, row {i}: without a 'prompt' column, 'chosen' and 'rejected' must be "
                     "conversations that differ only in the last turn.")
            triples.append((c[:-1], c[-1:], r[-1:]))
        return triples
    check_text(ds, ["prompt", "chosen", "rejected"], spec)
    return list(zip(ds["prompt"], ds["chosen"], ds["rejected"]))


def batch_indices(n, batch_size, seed, step):
    """The example indices of micro-batch `step`: a fresh permutation every epoch, cycling
    forever. Stateless, so a resumed run sees exactly the data it would have seen."""
    out = []
    start = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.extend(perm[offset:offset + batch_size - len(out)].tolist())
    return out


def count_truncated(tokenizer, texts, max_length, completions=False):
    """How many texts encode_prompts (or encode_completions) will cut at max_length tokens."""
    if not max_length:
        return 0
    encode = encode_completions if completions else encode_prompts
    return sum(int((encode(tokenizer, texts[i:i + 1024])[1].sum(1) > max_length).sum())
               for i in range(0, len(texts), 1024))


# ============================================================================ tokenization
def encode_prompts(tokenizer, texts, max_length=None):
    """Left-padded prompt ids (B, P) and mask; too-long prompts keep their end."""
    seqs = [tokenizer(t, add_special_tokens=not _has_bos(tokenizer, t))["input_ids"] for t in texts]
    if max_length:
        seqs = [s[-max_length:] for s in seqs]
    return _pad(seqs, tokenizer.pad_token_id, left=True)


def encode_completions(tokenizer, texts, max_length=None):
    """Right-padded completion ids (B, C) and mask, each ending with EOS (kept when truncated
    would cut it: the mask, not the ids, says where a completion ends)."""
    eos = tokenizer.eos_token_id
    seqs = []
    for t in texts:
        ids = tokenizer(t, add_special_tokens=False)["input_ids"]
        if not ids or ids[-1] != eos:
            ids = ids + [eos]
        seqs.append(ids[:max_length] if max_length else ids)
    return _pad(seqs, tokenizer.pad_token_id, left=False)


def _has_bos(tokenizer, text):
    return tokenizer.bos_token is not None and text.startswith(tokenizer.bos_token)


def _pad(seqs, pad_id, left):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, sl] = torch.tensor(s, dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


# ============================================================================ log-probs
def position_ids(mask):
    """Positions that skip left padding: (B, T)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def backbone(model):
    """The transformer without its head (model.model for Llama/Qwen, model.transformer for GPT-2)."""
    return getattr(model, model.base_model_prefix)


def with_cache(module, cache):
    """Keyword arguments that make a forward read and extend a key/value cache: transformers
    renamed `past_key_values` to `cache` in 5.x, and this works with either."""
    return {_cache_keyword(type(module)): cache, "use_cache": True}


@functools.cache
def _cache_keyword(cls):
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def is_checkpointing(model):
    """Whether activation (gradient) checkpointing is on; transformers 5 renamed the attribute."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                        temperature=1.0, with_entropy=False, chunk_tokens=None):
    """Per-token log pi(y_t | x, y_<t) of the completion tokens: (B, C), 0 where masked.

    Shared prompts: when there are k > 1 times as many completions as prompts, completion row i
    continues prompt row i // k (the layout of `repeat_interleave(k)`: GRPO's groups, DPO's
    chosen/rejected pairs). Each prompt then goes through the model once and its key/value cache
    is repeated for its k completions -- the same numbers as k copies of the prompt, with k times
    less prompt compute. (Under gradient checkpointing with gradients on, HF layers refuse a
    cache, so the prompt is repeated instead.)

    Memory: the head is applied to completion positions only (not the prompt, not padding), in
    chunks of rows, each under activation checkpointing, so at most one chunk of fp32 logits
    `(chunk_tokens, vocab)` exists at a time, in forward and in backward; never `(B, T, V)`.
    With `with_entropy`, also returns the per-token entropy of the (tempered) distribution.
    """
    k = completion_ids.shape[0] // prompt_ids.shape[0]
    C = completion_ids.shape[1]
    body = backbone(model)
    if k > 1 and not (torch.is_grad_enabled() and is_checkpointing(model)):
        cache = DynamicCache(config=model.config)
        prompt_hidden = body(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids(prompt_mask),
                             **with_cache(body, cache)).last_hidden_state  # (B, P, H)
        cache.batch_repeat_interleave(k)  # (B*k, ...): differentiable, gradients reach the prompt once
        mask = torch.cat([prompt_mask.repeat_interleave(k, 0), completion_mask], 1)  # (B*k, P+C)
        hidden = body(input_ids=completion_ids, attention_mask=mask, position_ids=position_ids(mask)[:, -C:],
                      **with_cache(body, cache)).last_hidden_state  # (B*k, C, H)
        # the state before each completion token: the prompt's last, then the completion's own
        hidden = torch.cat([prompt_hidden[:, -1:].repeat_interleave(k, 0), hidden[:, :-1]], 1)  # (B*k, C, H)
        del cache, prompt_hidden
    else:
        if k > 1:
            prompt_ids, prompt_mask = prompt_ids.repeat_interleave(k, 0), prompt_mask.repeat_interleave(k, 0)
        ids = torch.cat([prompt_ids, completion_ids], 1)  # (B, P+C)
        mask = torch.cat([prompt_mask, completion_mask], 1)
        hidden = body(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                      use_cache=False).last_hidden_state  # (B, P+C, H)
        hidden = hidden[:, -C - 1:-1]  # (B, C, H): the state before each completion token
    keep = completion_mask.bool()
    h, labels = hidden[keep], completion_ids[keep]  # (N, H), (N,): real tokens only
    head = model.get_output_embeddings()
    chunk = chunk_tokens or max(1, 2**26 // head.weight.shape[0])  # <= 256 MB of fp32 logits
    lps, ents = [], []
    for i in range(0, h.shape[0], chunk):
        args = (head, h[i:i + chunk], labels[i:i + chunk], temperature, with_entropy)
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = torch.utils.checkpoint.checkpoint(_head_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _head_logprobs(*args)
        lps.append(lp)
        ents.append(ent)
    logprobs = torch.zeros(completion_ids.shape, dtype=torch.float32, device=h.device)
    logprobs = logprobs.masked_scatter(keep, torch.cat(lps)) if lps else logprobs
    if not with_entropy:
        return logprobs
    entropy = torch.zeros(completion_ids.shape, dtype=torch.float32, device=h.device)
    entropy = entropy.masked_scatter(keep, torch.cat(ents)) if ents else entropy
    return logprobs, entropy


def _head_logprobs(head, h, labels, temperature, with_entropy):
    logits = head(h).float() / temperature  # (n, V), fp32 for a stable log-softmax
    logz = torch.logsumexp(logits, -1)
    lp = logits.gather(-1, labels[:, None]).squeeze(-1) - logz
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = logz - (logits.softmax(-1) * logits).sum(-1)
    return lp, ent


# ============================================================================ generation
@torch.no_grad()
def generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature=1.0,
             top_p=1.0, top_k=0, do_sample=True, num_return_sequences=1):
    """Sample `num_return_sequences` (n) completions per prompt; stop at EOS.

    A plain decoding loop over the model's key/value cache -- HF `generate`'s sampling, without
    its processors: each prompt is prefilled once and its cache repeated for its n samples, so
    rows i*n..(i+1)*n-1 are prompt i's (the layout of `repeat_interleave(n)`). Sampling is
    multinomial at `temperature`, optionally restricted by `top_k` / `top_p`; `do_sample=False`
    is greedy. Returns completion ids (B*n, C) with everything after the first EOS set to pad,
    the mask (1 up to and including EOS), and `truncated` (B*n,): True where no EOS was produced.
    """
    was_training = model.training
    model.eval()
    n, eos, pad = num_return_sequences, tokenizer.eos_token_id, tokenizer.pad_token_id
    cache = DynamicCache(config=model.config)
    positions = position_ids(prompt_mask)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, logits_to_keep=1,
                **with_cache(model, cache))
    logits = out.logits[:, -1].float().repeat_interleave(n, 0)  # (B*n, V): next-token logits
    cache.batch_repeat_interleave(n)
    mask = prompt_mask.repeat_interleave(n, 0)
    next_position = positions[:, -1:].repeat_interleave(n, 0) + 1  # (B*n, 1)
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    sharded = is_sharded(model)  # FSDP2 layers gather weights collectively: ranks step together
    tokens = []
    for t in range(max_new_tokens):
        token = _next_token(logits, temperature, top_p, top_k, do_sample).masked_fill(done, pad)  # (B*n,)
        tokens.append(token)
        done |= token == eos
        finished = all_reduce(float((~done).sum()), "sum") == 0 if sharded else bool(done.all())
        if finished or t + 1 == max_new_tokens:
            break
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_position,
                       **with_cache(model, cache)).logits[:, -1].float()
        next_position = next_position + 1
    del cache
    model.train(was_training)
    completion = torch.stack(tokens, 1) if tokens else prompt_ids.new_full((logits.shape[0], 1), pad)  # (B*n, C)
    is_eos = completion == eos
    truncated = ~is_eos.any(1)
    first_eos = torch.where(truncated, completion.shape[1], is_eos.int().argmax(1))  # (B*n,)
    arange = torch.arange(completion.shape[1], device=completion.device)
    completion_mask = (arange[None] <= first_eos[:, None]).long()
    completion = completion.masked_fill(completion_mask == 0, pad)
    width = max(int(completion_mask.sum(1).max()), 1)
    return completion[:, :width], completion_mask[:, :width], truncated


def _next_token(logits, temperature, top_p, top_k, do_sample):
    """One token per row from next-token logits (B, V): greedy, or sampled at `temperature`
    from the top-k tokens and the smallest set whose probability reaches top_p."""
    if not do_sample:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # tokens after the nucleus is full (the first always stays)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1).squeeze(-1)


def decode_completions(tokenizer, completion_ids, completion_mask):
    """Completion texts without EOS or padding."""
    texts = []
    for ids, m in zip(completion_ids.tolist(), completion_mask.tolist()):
        ids = [t for t, k in zip(ids, m) if k and t != tokenizer.eos_token_id]
        texts.append(" " + tokenizer.decode(ids, skip_special_tokens=True).strip())
    return texts


@torch.no_grad()
def sample_texts(model, tokenizer, prompts, max_new_tokens, batch_size=64, **sampling):
    """Generate for a list of rendered prompt texts; returns (texts, truncated flags)."""
    texts, truncated = [], []
    for i in range(0, len(prompts), batch_size):
        ids, mask = encode_prompts(tokenizer, prompts[i:i + batch_size])
        c, cm, tr = generate(model, tokenizer, ids.to(model.device), mask.to(model.device), max_new_tokens, **sampling)
        texts += decode_completions(tokenizer, c, cm)
        truncated += tr.tolist()
    return texts, truncated


# ============================================================================ rewards
def load_reward_fn(spec):
    """`file.py:function` -> the function, called as fn(prompts, completions, **columns) -> floats
    (TRL's reward-function signature); `gold` -> the embedded world's gold judge."""
    if spec == "gold":
        return world.gold_reward
    path, _, name = spec.rpartition(":")
    if not path or not name:
        fail(f"--reward_fn {spec!r}: expected file.py:function (or 'gold').")
    if not os.path.isfile(path):
        fail(f"--reward_fn {spec!r}: file {path} does not exist.")
    module_spec = importlib.util.spec_from_file_location(f"reward_fn_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        fail(f"--reward_fn {spec!r}: {path} defines no function {name!r}.")
    return getattr(module, name)


def call_reward_fn(fn, prompts, completions, columns=None):
    """Call a reward function on a batch and check what it returns: one finite float per
    completion. If it raises, find the prompt that makes it raise and stop with both."""
    columns = columns or {}
    name = getattr(fn, "__name__", str(fn))
    try:
        rewards = fn(prompts, completions, **columns)
    except Exception as batch_error:  # noqa: BLE001 -- re-raised below with the culprit prompt
        for i in range(len(prompts)):
            try:
                fn(prompts[i:i + 1], completions[i:i + 1], **{k: v[i:i + 1] for k, v in columns.items()})
            except Exception as e:  # noqa: BLE001
                fail(f"reward function {name} raised {type(e).__name__}: {e}\n  on prompt {i}: {str(prompts[i])[:300]!r}"
                     f"\n  completion: {str(completions[i])[:300]!r}")
        fail(f"reward function {name} raised {type(batch_error).__name__}: {batch_error} on a batch of "
             f"{len(prompts)} prompts (each prompt alone works); first prompt: {str(prompts[0])[:300]!r}")
    rewards = list(rewards) if rewards is not None else []
    if len(rewards) != len(completions):
        fail(f"reward function {name} returned {len(rewards)} values for {len(completions)} completions.")
    out = []
    for i, r in enumerate(rewards):
        if r is None or not isinstance(r, (int, float)) or r != r or abs(r) == float("inf"):
            fail(f"reward function {name} returned {r!r} for prompt {i}: {str(prompts[i])[:300]!r}; "
                 "rewards must be finite numbers.")
        out.append(float(r))
    return torch.tensor(out)


def load_reward_model(path, args):
    """A reward model saved by reward.py (AutoModelForSequenceClassification, num_labels=1),
    frozen, with its own tokenizer (it may differ from the policy's)."""
    from transformers import AutoModelForSequenceClassification

    if not os.path.exists(os.path.join(path, "config.json")):
        fail(f"no reward model in {path}: run `python reward.py` first, or pass another path.")
    tokenizer = load_tokenizer(path, args.trust_remote_code)
    model = load_model(path, args, cls=AutoModelForSequenceClassification, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    return freeze(model), tokenizer


def sequence_scores(model, input_ids, attention_mask):
    """Scalar score per sequence, read at the last non-pad token: (B,).

    Works with left padding (prompt) + right padding (completion): the position is found from
    the mask, never from pad ids, so pad == EOS is safe. Differentiable.
    """
    hidden = backbone(model)(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids(attention_mask), use_cache=False).last_hidden_state
    last = attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(1)  # (B,) index of last real token
    h = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (B, H)
    return model.score(h).squeeze(-1).float()  # (B,)


@torch.no_grad()
def reward_model_scores(model, tokenizer, prompts, completions, batch_size=64, max_length=None):
    """Score rendered prompt texts + completion texts with a reward model: (N,) on the CPU."""
    scores = []
    for i in range(0, len(prompts), batch_size):
        p_ids, p_mask = encode_prompts(tokenizer, prompts[i:i + batch_size], max_length)
        c_ids, c_mask = encode_completions(tokenizer, completions[i:i + batch_size], max_length)
        ids = torch.cat([p_ids, c_ids], 1).to(model.device)
        mask = torch.cat([p_mask, c_mask], 1).to(model.device)
        scores.append(sequence_scores(model, ids, mask).cpu())
    return torch.cat(scores)


def score_texts(model, tokenizer, prompts, completions, batch_size=64, max_length=None):
    """Reward-model scores of dataset prompts (text or conversations) and their completions (text,
    or assistant messages), rendered through the reward model's own tokenizer and chat template,
    as reward.py rendered its training pairs: (N,) on the CPU."""
    rendered = [render_prompt(tokenizer, p) for p in prompts]
    answers = [render_completion(tokenizer, p, c) for p, c in zip(prompts, completions)]
    return reward_model_scores(model, tokenizer, rendered, answers, batch_size, max_length)


# ============================================================================ the embedded world
_WORLD_CACHE = {}


def embedded_world(seed=0):
    """The world's datasets (built once per process; deterministic in the seed)."""
    if seed not in _WORLD_CACHE:
        _WORLD_CACHE[seed] = world.build_world(seed)
    return _WORLD_CACHE[seed]


def gold_eval(model, tokenizer, args, max_new_tokens=48, n=None):
    """Mean gold score of greedy completions on the world's held-out test split."""
    test = embedded_world()["test"]
    if n:
        test = test.select(range(n))
    prompts = [render_prompt(tokenizer, p) for p in test["prompt"]]
    texts, truncated = sample_texts(model, tokenizer, prompts, max_new_tokens, args.eval_batch_size, do_sample=False)
    scores = [world.gold_score(p, t) for p, t in zip(test["post"], texts)]
    return {"gold_score": sum(scores) / len(scores), "test_truncated_frac": sum(truncated) / len(truncated),
            "test_mean_words": sum(len(t.split()) for t in texts) / len(texts), "samples": texts[:5]}


# ============================================================================ logging
class MetricsLogger:
    """metrics.jsonl (one JSON object per logged step, each with `step`), the console, and an
    optional tracker (tensorboard / wandb, imported only when --report_to asks for it)."""

    def __init__(self, args, start_step=0):
        os.makedirs(args.output_dir, exist_ok=True)
        self.path = os.path.join(args.output_dir, "metrics.jsonl")
        self.tracker = None
        if not is_main():  # under torchrun only rank 0 writes; the others only join the reduction in log()
            return
        kept = []
        if start_step and os.path.exists(self.path):  # resuming: keep the lines up to the checkpoint
            with open(self.path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= start_step]
        with open(self.path, "w") as f:
            f.writelines(kept)
        if args.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.tracker = SummaryWriter(args.output_dir)
        elif args.report_to == "wandb":
            import wandb

            self.tracker = wandb.init(config=vars(args), dir=args.output_dir)

    def log(self, step, metrics, pbar=None):
        """Under torchrun, numbers are averaged over ranks first: call it on every rank."""
        metrics = {k: (float(v) if torch.is_tensor(v) else v) for k, v in metrics.items()}
        if world_size() > 1:
            keys = [k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if keys:
                means = all_reduce(torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64))
                metrics.update({k: int(m) if isinstance(metrics[k], int) and m == int(m) else m
                                for k, m in zip(keys, means.tolist())})
            if not is_main():
                return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if pbar is not None:
            pbar.set_postfix({k: f"{v:.3g}" for k, v in list(metrics.items())[:4] if isinstance(v, float)}, refresh=False)
        if self.tracker is not None and hasattr(self.tracker, "add_scalar"):
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tracker.add_scalar(k, v, step)
        elif self.tracker is not None:
            self.tracker.log(metrics, step=step)

    def close(self):
        if self.tracker is not None:
            self.tracker.close() if hasattr(self.tracker, "add_scalar") else self.tracker.finish()


def progress(args, start=0, desc=None):
    return tqdm(range(start, args.max_steps), initial=start, total=args.max_steps, desc=desc,
                dynamic_ncols=True, disable=os.environ.get("TQDM_DISABLE") == "1" or not is_main())


def mean_metrics(rows):
    """Average a list of metric dicts (e.g. over minibatches) key by key."""
    return {k: sum(float(r[k]) for r in rows) / len(rows) for k in rows[0]}


# ============================================================================ checkpoints
def save_checkpoint(model, tokenizer, args, folder, state=None):
    """save_pretrained of model and tokenizer plus args.json (and `state`, e.g. optimizer and
    step, as trainer_state.pt), written to a temporary folder and renamed into place, so a crash
    never leaves half a checkpoint. Under torchrun: call on every rank; rank 0 writes."""
    state_dict = full_state_dict(model) if is_sharded(model) else None  # FSDP2: gather (collective)
    if is_main():
        _save_folder(model, tokenizer, args, folder, state, state_dict)
    barrier()


def _save_folder(model, tokenizer, args, folder, state, state_dict):
    tmp = folder.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    if os.environ.get("RLHF_TEST_CRASH_WHILE_SAVING") == os.path.basename(folder.rstrip("/")):
        os.kill(os.getpid(), 9)  # test hook (tests/test_resume.py): SIGKILL with this checkpoint half-written
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "args.json"), "w") as f:
        json.dump(vars(args), f, indent=2)
    if state is not None:
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    old = folder.rstrip("/") + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(folder):
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def save_final(model, tokenizer, args):
    """The final model in <output_dir>/ (where metrics.jsonl and checkpoints also live): saved
    to a temporary folder, then moved in file by file with config.json last, so a crash never
    leaves a loadable half-model."""
    out = args.output_dir
    tmp = os.path.join(out, "final.tmp")
    save_checkpoint(model, tokenizer, args, tmp)
    if not is_main():
        return
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out, "config.json"))
    names = sorted(os.listdir(tmp), key=lambda n: n == "config.json")
    for name in names:
        os.replace(os.path.join(tmp, name), os.path.join(out, name))
    os.rmdir(tmp)


def write_json(path, obj):
    """Write JSON atomically (temporary file, then rename); under torchrun, rank 0 only."""
    if not is_main():
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def full_state_dict(model):
    """The model's weights with FSDP2 shards gathered into plain tensors (a collective), in the
    dtype of the replicated weights (bf16 layers keep fp32 master shards while training)."""
    dtype = next(p.dtype for p in model.parameters() if not is_sharded_param(p))
    return {k: v.full_tensor().to("cpu", dtype) if is_sharded_param(v) else v for k, v in model.state_dict().items()}


def load_weights(model, folder):
    """Copy a checkpoint's safetensors weights into `model` in place (FSDP2 shards included).
    Tied weights (e.g. a head sharing the embedding) may be absent from the files."""
    from glob import glob

    from safetensors.torch import load_file
    from torch.distributed.tensor import distribute_tensor

    loaded = {}
    for path in sorted(glob(os.path.join(folder, "*.safetensors"))):
        loaded.update(load_file(path))
    if not loaded:
        fail(f"{folder} holds no *.safetensors weights; pass a checkpoint folder written by --save_steps.")
    params = model.state_dict()
    unexpected = sorted(set(loaded) - set(params))
    if unexpected:
        fail(f"{folder} does not match this model (unexpected weights {', '.join(unexpected[:3])}); "
             "resume with the same --model and sizes as the run that wrote it.")
    with torch.no_grad():
        for name, src in loaded.items():
            dst = params[name]
            if is_sharded_param(dst):
                src = distribute_tensor(src.to(dst.device, dst.dtype), dst.device_mesh, dst.placements)
            dst.copy_(src)


def rng_state():
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def training_state(step, optimizer, scheduler, **stateful):
    """Everything besides the weights that a resumed run needs, for save_checkpoint's `state`:
    the step (which is also the position in the data: batch_indices is stateless), the
    optimizer (8-bit states included; FSDP2 shards gathered), the scheduler, every rank's RNG
    states, and the state_dict() of any further `stateful` object (e.g. value_optimizer=...).
    A collective under torchrun: call it on every rank."""
    import torch.distributed as dist

    rngs = [rng_state()]
    if world_size() > 1:
        rngs = [None] * world_size()
        dist.all_gather_object(rngs, rng_state())
    optim = optimizer.state_dict()  # its per-parameter dicts are the live state: copy, never edit them
    optim["state"] = {i: {k: v.full_tensor().cpu() if is_sharded_param(v) else v for k, v in s.items()}
                      for i, s in optim["state"].items()}
    return {"step": step, "optimizer": optim, "scheduler": scheduler.state_dict(), "rng": rngs,
            **{name: obj.state_dict() for name, obj in stateful.items()}}


def last_checkpoint(output_dir):
    """The newest complete <output_dir>/checkpoint-<step> (renamed into place only when whole)."""
    import re

    steps = [int(m.group(1)) for n in (os.listdir(output_dir) if os.path.isdir(output_dir) else [])
             if (m := re.fullmatch(r"checkpoint-(\d+)", n)) and os.path.isfile(os.path.join(output_dir, n, "trainer_state.pt"))]
    return os.path.join(output_dir, f"checkpoint-{max(steps)}") if steps else None


def maybe_resume(args, model, optimizer, scheduler, **stateful):
    """With --resume (newest checkpoint in --output_dir) or --resume_from_checkpoint PATH: load
    the weights, optimizer, scheduler, RNG states (and each `stateful` object's state) saved by
    save_checkpoint(..., training_state(...)) and return the step to continue from; else 0.
    Call after distribute() and make_optimizer/make_scheduler."""
    from torch.distributed.tensor import distribute_tensor

    folder = args.resume_from_checkpoint or (last_checkpoint(args.output_dir) if args.resume else "")
    if not folder:
        if args.resume:
            print(f"resume: no checkpoint in {args.output_dir} yet; starting from step 0.")
        return 0
    state = torch.load(os.path.join(folder, "trainer_state.pt"), map_location="cpu", weights_only=True)
    load_weights(model, folder)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, s in state["optimizer"]["state"].items():  # FSDP2: re-shard full states like their parameter
        for k, v in s.items():
            if is_sharded_param(params[i]) and torch.is_tensor(v) and v.shape == params[i].shape:
                s[k] = distribute_tensor(v.to(params[i].device), params[i].device_mesh, params[i].placements)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    for name, obj in stateful.items():
        obj.load_state_dict(state[name])
    if len(state["rng"]) == world_size():
        set_rng_state(state["rng"][rank()])
    else:  # a different number of ranks: sampling cannot replay exactly, the data order still does
        print(f"resume: {folder} was written by {len(state['rng'])} ranks, this run has {world_size()}; "
              "random states are re-seeded, so sampling will differ from an uninterrupted run.")
        set_seed(args.seed + rank() + state["step"])
    print(f"resume: continuing from {folder} at step {state['step']}.")
    return state["step"]


def check_finite(name, value, step):
    """Stop the run if a loss or reward holds NaN or inf, naming the step. Call it before the
    backward pass: the weights never see the bad value, and checkpoints already written are kept."""
    t = torch.as_tensor(value).detach()
    if not torch.isfinite(t).all():
        what = "NaN" if torch.isnan(t).any() else "inf"
        fail(f"{name} is {what} at step {step}; stopped before updating the weights. The checkpoints saved so "
             "far are kept: rerun with --resume to continue from the last good one, with a lower --learning_rate "
             "or --max_grad_norm (or check the data / reward function of that step).")


# ============================================================================ memory
def tensor_bytes(tensors):
    """Sum of storage sizes of tensors (or of a module's parameters and buffers); of an FSDP2
    shard, this rank's part."""
    if isinstance(tensors, torch.nn.Module):
        tensors = list(tensors.parameters()) + list(tensors.buffers())
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = t.to_local() if is_sharded_param(t) else t
        key = t.untyped_storage().data_ptr()
        if key not in seen:  # tied weights are counted once
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def optimizer_state_bytes(optimizer):
    return tensor_bytes([v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)])


def peak_memory_bytes():
    """Peak allocated CUDA memory on a GPU; peak resident set size of the process on the CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def gb(n):
    return n / 1024**3


# ---------------------------------------------------------------------------- memory plan
# `--estimate_memory` (the plan, from the config alone) and `log_memory` (the measurement in a
# real run) print the same rows, so a plan can be checked line by line (tests/test_memory.py).
# GB here means 2**30 bytes.
def model_config(args, name=None):
    """The model's config only (no weights, no tokenizer): a folder holding config.json is enough."""
    from transformers import AutoConfig

    name = args.model if name is None else name
    if name == "":  # sft.py's from-scratch model
        return world.build_model(world.build_tokenizer(), args.hidden_size, args.num_layers).config
    check_model_source(name)
    return AutoConfig.from_pretrained(name, trust_remote_code=args.trust_remote_code)


def parameter_numels(config, head="lm"):
    """Element counts of a model's parameters (tied weights once) and buffers, from a model built
    on the meta device: exact for any architecture, no memory, well under a second for 1.5B."""
    import copy

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = copy.deepcopy(config)
    if head == "score":  # reward models and critics: the LM head becomes a (hidden -> 1) score head
        config.num_labels = 1
    cls = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
    with torch.device("meta"):
        model = cls.from_config(config)
    return [p.numel() for p in model.parameters()], sum(b.numel() for b in model.buffers())


def optimizer_state_plan(numels, optim, dtype):
    """Bytes of AdamW's two moments for parameters of these sizes.

    adamw_8bit (bitsandbytes): tensors of >= 4096 elements keep each moment in uint8 plus one
    fp32 absmax per block of 256, i.e. ~2.03 bytes/param; smaller tensors keep fp32 moments (8
    bytes/param); plus two shared 256-entry fp32 quantisation maps. adamw (torch): two moments
    like the weights, in fp32 also for bf16 weights (optimizer_step hands them over as fp32
    copies), plus a 4-byte step counter per tensor. No master weights in either case: bf16
    weights are updated with stochastic rounding (see make_optimizer).
    """
    if optim == "adamw_8bit":
        return sum(2 * n + 8 * -(-n // 256) if n >= 4096 else 8 * n for n in numels) + 2 * 256 * 4
    moment = 2 if dtype == torch.float16 else 4
    return sum(2 * moment * n + 4 for n in numels)


def sr_bucket_numel(numels):
    """The largest fp32 bucket optimizer_step builds for bf16 weights (same loop as there)."""
    largest, numel = 0, 0
    for i, n in enumerate(numels):
        numel += n
        if numel >= SR_BUCKET_NUMEL or i == len(numels) - 1:
            largest, numel = max(largest, numel), 0
    return largest


def activation_plan(config, tokens, nbytes, checkpointing):
    """Bytes autograd keeps for backward over `tokens` (sequences x length) of a Llama/Qwen-style
    decoder with flash/SDPA attention (no seq x seq scores kept).

    Per token and layer, counted from the tensors saved for backward (saved_tensors_hooks on a
    tiny Qwen2, exact there): nbytes * (8 h + 4 I + 2 kv) for the norm outputs, q/k/v/o inputs,
    attention output and the SwiGLU MLP, + 2 h * (4 - nbytes) because RMSNorm saves its input in
    fp32, + 4 * heads + 8 (attention log-sum-exp, norm statistics). h: hidden size, I:
    intermediate size, kv: key/value width. With gradient checkpointing only each layer's input
    (nbytes * h) is kept, and one layer's activations are rebuilt at a time in backward.
    """
    h, layers = config.hidden_size, config.num_hidden_layers
    inter = getattr(config, "intermediate_size", 4 * h)
    heads = config.num_attention_heads
    kv = _kv_width(config)
    per_layer = nbytes * (8 * h + 4 * inter + 2 * kv) + 2 * h * (4 - nbytes) + 4 * heads + 8
    final_norm = (4 + nbytes) * h
    if checkpointing:
        return tokens * (layers * nbytes * h + per_layer + final_norm)
    return tokens * (layers * per_layer + final_norm)


def _kv_width(config):
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (getattr(config, "num_key_value_heads", None) or heads) * head_dim


def logits_plan(config, rows):
    """Peak bytes of completion_logprobs' fp32 logits: one checkpointed chunk of <= 2**26 // vocab
    completion tokens at a time, about four (rows, vocab) fp32 tensors of it alive at once (head
    output, tempered logits, and in backward their softmax and gradient)."""
    vocab = config.vocab_size
    return min(rows, max(1, 2**26 // vocab)) * vocab * 16


def generation_plan(config, sequences, prompt_length, completion_length, nbytes):
    """Bytes of sampling `sequences` at once: the KV cache (2 x layers x kv width per token) plus
    the prefill's transient MLP activations and fp32 next-token logits."""
    h, layers, kv = config.hidden_size, config.num_hidden_layers, _kv_width(config)
    inter = getattr(config, "intermediate_size", 4 * h)
    cache = 2 * layers * kv * nbytes * sequences * (prompt_length + completion_length)
    prefill = sequences * prompt_length * (3 * inter + 4 * h) * nbytes
    return cache + prefill + 3 * sequences * config.vocab_size * 4


def estimate_memory(args, script):
    """The memory plan of `script` with these settings: a list of (component, bytes, note).

    Static rows (weights, gradients, optimizer states, frozen models) are exact counts from the
    config; the last row is the larger of the training micro-batch (activations + one chunk of
    logits) and the rollout (generation) or the optimizer step's fp32 bucket, which never
    coexist. Not counted: the CUDA context (~0.5 GB) and allocator fragmentation.
    """
    dtype = torch_dtype(args.dtype)
    nb = dtype.itemsize
    config = model_config(args)
    numels, buffers = parameter_numels(config, "score" if script == "reward" else "lm")
    weights = (sum(numels) + buffers) * nb
    B = args.batch_size
    P = getattr(args, "max_prompt_length", 512)
    C = getattr(args, "max_completion_length", 256)
    ckpt = args.gradient_checkpointing
    opt_note = {"adamw_8bit": "8-bit AdamW: ~2 bytes/param", "adamw": "AdamW: 8 bytes/param (fp32 moments)"}[args.optim]
    rows = [("policy weights", weights, f"{sum(numels) / 1e6:,.1f}M params x {nb} bytes ({dtype})"),
            ("gradients", sum(numels) * nb, f"{dtype}, like the weights"),
            ("optimizer states", optimizer_state_plan(numels, args.optim, dtype), opt_note + "; no master weights")]

    # frozen models and the critic, by script
    reward_paths, has_ref, critic = [], False, False
    train_seqs, gen_seqs, gen_len = B, 0, C  # sequences in one training forward; sequences sampled at once
    if script == "reward":
        train_seqs = 2 * B
    elif script == "dpo":
        online = getattr(args, "online", False)
        has_ref = online or not getattr(args, "precompute_ref_logps", True)
        train_seqs = 2 * B
        if online:
            C = gen_len = getattr(args, "max_new_tokens", C)
            gen_seqs = 2 * B
            reward_paths = [getattr(args, "reward_model", "")]
    elif script == "grpo":
        G = getattr(args, "num_generations", 8)
        has_ref = getattr(args, "beta", 0.04) != 0
        train_seqs = gen_seqs = B * G
        reward_paths = getattr(args, "reward_model", "").split(",")
    elif script == "ppo":  # micro-batches of batch_size sequences in the rollout and in the update
        has_ref, critic = True, True
        gen_seqs = B
        reward_paths = [] if getattr(args, "reward_fn", "") else [getattr(args, "reward_model", "runs/reward")]
    offload = getattr(args, "offload_frozen", False)
    where = " (on the CPU: --offload_frozen)" if offload else ""
    if script not in ("sft", "reward"):
        rows.append(("reference model", 0 if (not has_ref or offload) else weights,
                     ("frozen copy of the policy" + where) if has_ref else "none: " + {
                         "dpo": "log-probs precomputed (--precompute_ref_logps)", "grpo": "--beta 0"}[script]))
    if critic:
        c_config = _config_or_policy(args, reward_paths[0] if reward_paths else args.model, config)  # as ppo.py
        c_numels, c_buffers = parameter_numels(c_config, "score")
        rows += [("critic weights", (sum(c_numels) + c_buffers) * nb, f"{sum(c_numels) / 1e6:,.1f}M params, score head"),
                 ("critic gradients", sum(c_numels) * nb, ""),
                 ("critic optimizer states", optimizer_state_plan(c_numels, args.optim, dtype), opt_note)]
    reward_bytes, notes = 0, []
    for path in [p for p in reward_paths if p]:
        r_numels, r_buffers = parameter_numels(_config_or_policy(args, path, config), "score")
        reward_bytes += (sum(r_numels) + r_buffers) * nb
        notes.append(path if os.path.exists(os.path.join(path, "config.json")) else f"{path} (not found: policy-shaped)")
    reward_bytes_on_device, reward_bytes = reward_bytes, 0 if offload else reward_bytes
    if script not in ("sft", "reward"):
        rows.append(("reward model", reward_bytes, ", ".join(notes) + where if notes else
                     "none: implicit in DPO" if script == "dpo" else "none: reward function(s) only"))

    # the largest transient: a training micro-batch, a rollout, or the optimizer step's fp32 bucket
    logits = logits_plan(config, train_seqs * C) if script != "reward" else 0  # a reward model has a score head
    train = activation_plan(config, train_seqs * (P + C), nb, ckpt) + logits
    if critic:
        train += activation_plan(c_config, train_seqs * (P + C), nb, ckpt)
    gen = generation_plan(config, gen_seqs, P, gen_len, nb) if gen_seqs else 0
    visit = max(weights, reward_bytes_on_device) if offload else 0  # a frozen model on the device for its pass
    bucket = 8 * sr_bucket_numel(numels) if dtype == torch.bfloat16 else 0
    peak = max(train, gen, visit, bucket)
    if peak == train:
        what = (f"training micro-batch: {train_seqs} x ({P}+{C}) tokens{', checkpointed' if ckpt else ''}"
                + (", + one logits chunk" if logits else ""))
    elif peak == gen:
        what = f"generation: KV cache of {gen_seqs} x ({P}+{gen_len}) tokens, prefill, logits"
    elif peak == visit:
        what = "--offload_frozen: one frozen model on the device for its forward pass"
    else:
        what = "optimizer step: fp32 copy of the largest bf16 bucket"
    rows.append(("activations", peak, what))
    return rows


def _config_or_policy(args, path, policy_config):
    """A frozen model's config if its folder exists, else the policy's (e.g. before reward.py ran)."""
    if path and os.path.exists(os.path.join(path, "config.json")):
        return model_config(args, path)
    return policy_config


def memory_table(rows, title):
    """The rows as text, one per component, the last one `total ... GB`."""
    width = max(len(r[0]) for r in rows + [("total", 0, "")])
    lines = [title, f"{'component':<{width}}  {'GB':>8}  {'MiB':>10}  note"]
    for name, n, note in rows:
        lines.append(f"{name:<{width}}  {gb(n):8.3f}  {n / 2**20:10.1f}  {note}")
    total = sum(n for _, n, _ in rows)
    lines.append(f"{'total':<{width}}  {gb(total):8.3f}  {total / 2**20:10.1f}  GB = 2**30 bytes")
    return "\n".join(lines)


def print_memory_plan(args, script):
    """--estimate_memory: print the plan and exit (called from parse_args)."""
    dtype = torch_dtype(args.dtype)
    title = (f"{script}.py memory plan for {args.model or 'the from-scratch model'} ({dtype}, --optim {args.optim}, "
             f"--batch_size {args.batch_size}{', --gradient_checkpointing' if args.gradient_checkpointing else ''}; "
             f"per device, estimated from the config)")
    print(memory_table(estimate_memory(args, script), title))
    sys.exit(0)


_MEMORY_LOGGED = set()  # output folders whose memory.json holds a complete measurement


def log_memory(output_dir, components):
    """Measure the memory plan's rows in a real run: bytes of each component's tensors (a module's
    weights and buffers, an optimizer's states, (optimizer, module) for the states of that
    module's parameters, a list of tensors (gradients) or of modules; None for an absent model)
    on the training device, and the peak so far; write <output_dir>/memory.json and print the table.

    Call it right before every optimizer step: it measures once, at the first call where every
    optimizer already has its states (they are created by the first step), and returns at once
    after that. A run of one step records what it has (optimizer states 0).
    """
    if output_dir in _MEMORY_LOGGED or not is_main():  # under torchrun: rank 0's device stands for all
        return

    def tensors(c):  # a module's parameters and buffers, or a list of tensors and modules
        items = [c] if isinstance(c, torch.nn.Module) else list(c or [])
        out = []
        for t in items:
            out += list(t.parameters()) + list(t.buffers()) if isinstance(t, torch.nn.Module) else [t]
        return out

    def on_device(ts):  # device memory only (not models offloaded to the CPU); FSDP2: this rank's shard
        ts = [t.to_local() if hasattr(t, "to_local") else t for t in ts if torch.is_tensor(t)]
        return tensor_bytes([t for t in ts if t.device.type == device().type])

    measured, complete = {}, True
    for name, c in components.items():
        if isinstance(c, tuple):  # (optimizer, module): the states of that module's parameters only
            states = [c[0].state[p] for p in c[1].parameters() if p in c[0].state]
            complete = complete and bool(states)
            measured[name] = on_device(v for s in states for v in s.values())
        elif isinstance(c, torch.optim.Optimizer):
            complete = complete and bool(c.state)
            measured[name] = on_device(v for s in c.state.values() for v in s.values())
        else:
            measured[name] = on_device(tensors(c))
    peak = peak_memory_bytes()
    kind = "torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "peak RSS of the process"
    write_json(os.path.join(output_dir, "memory.json"), {
        "components": measured, "total_bytes": sum(measured.values()), "peak_bytes": peak, "peak_kind": kind,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "complete": complete})
    if complete:
        _MEMORY_LOGGED.add(output_dir)
        rows = [(name, n, "measured") for name, n in measured.items()]
        print(memory_table(rows, f"measured memory (peak so far: {gb(peak):.3f} GB, {kind}):"))
