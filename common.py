"""Plumbing shared by every script: arguments, loading, the optimizer, data, log-probs,
generation, logging, checkpoints and memory accounting. No algorithm lives here: losses,
advantages, KL and clipping stay in sft.py / reward.py / ppo.py / dpo.py / grpo.py.
"""

import contextlib
import importlib.util
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

import world

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
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward: less memory, ~30% more time."})
    # logging and saving
    logging_steps: int = field(default=1, metadata={"help": "Log metrics every this many steps."})
    save_steps: int = field(default=0, metadata={"help": "Save <output_dir>/checkpoint-<step>/ every this many steps (0: final save only)."})
    report_to: str = field(default="none", metadata={"help": "none | tensorboard | wandb (imported only when asked)."})
    eval_batch_size: int = field(default=64, metadata={"help": "Prompts per generation batch when scoring the test split."})


def parse_args(cls, script):
    """Parse the command line into the script's Args dataclass; fill the output folder."""
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(cls).parse_args_into_dataclasses()
    args.output_dir = args.output_dir or os.path.join("runs", script)
    check_choice("--optim", args.optim, ["adamw_8bit", "adamw"])
    check_choice("--dtype", args.dtype, ["auto", "bfloat16", "float16", "float32"])
    check_choice("--report_to", args.report_to, ["none", "tensorboard", "wandb"])
    check_choice("--attn_implementation", args.attn_implementation, ["auto", "sdpa", "eager", "flash_attention_2"])
    for name in ("max_steps", "batch_size", "gradient_accumulation_steps", "logging_steps"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be at least 1, got {getattr(args, name)}.")
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
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        fail(f"the tokenizer of {name} has no EOS token; set one with tokenizer.eos_token = ... and save it.")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_model_source(name):
    if name == "runs/sft" and not os.path.exists(os.path.join(name, "config.json")):
        fail("runs/sft holds no model yet: run `python sft.py` first, or pass --model.")
    if os.path.sep in name and not os.path.exists(name):
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
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model.to(device())


def freeze(model):
    """A frozen copy in eval mode: no grads, dropout off."""
    model.eval()
    model.requires_grad_(False)
    return model


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
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # silence its CPU-kernel notice
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

    Returns the gradient norm before clipping.
    """
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
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


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                        temperature=1.0, with_entropy=False, chunk_tokens=None):
    """Per-token log pi(y_t | x, y_<t) of the completion tokens: (B, C), 0 where masked.

    Memory: the head is applied to completion positions only (not the prompt, not padding), in
    chunks of rows, each under activation checkpointing, so at most one chunk of fp32 logits
    `(chunk_tokens, vocab)` exists at a time, in forward and in backward; never `(B, T, V)`.
    With `with_entropy`, also returns the per-token entropy of the (tempered) distribution.
    """
    ids = torch.cat([prompt_ids, completion_ids], 1)  # (B, P+C)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    hidden = backbone(model)(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                             use_cache=False).last_hidden_state  # (B, P+C, H)
    C = completion_ids.shape[1]
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
             top_p=1.0, top_k=0, do_sample=True):
    """Sample completions with HF `generate`; stop at EOS.

    Returns completion ids (B, C) with everything after the first EOS set to pad, the mask
    (1 up to and including EOS), and `truncated` (B,): True where no EOS was produced.
    """
    was_training = model.training
    model.eval()
    kw = dict(do_sample=do_sample, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
              eos_token_id=tokenizer.eos_token_id, use_cache=True)
    if do_sample:
        kw.update(temperature=temperature, top_p=top_p, top_k=top_k)
    else:
        kw.update(temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kw)
    model.train(was_training)
    completion = out[:, prompt_ids.shape[1]:]  # (B, C)
    is_eos = completion == tokenizer.eos_token_id
    truncated = ~is_eos.any(1)
    first_eos = torch.where(truncated, completion.shape[1], is_eos.int().argmax(1))  # (B,)
    arange = torch.arange(completion.shape[1], device=completion.device)
    completion_mask = (arange[None] <= first_eos[:, None]).long()
    completion = completion.masked_fill(completion_mask == 0, tokenizer.pad_token_id)
    width = max(int(completion_mask.sum(1).max()), 1)
    return completion[:, :width], completion_mask[:, :width], truncated


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
        kept = []
        if start_step and os.path.exists(self.path):  # resuming: keep the lines up to the checkpoint
            with open(self.path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= start_step]
        with open(self.path, "w") as f:
            f.writelines(kept)
        self.tracker = None
        if args.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.tracker = SummaryWriter(args.output_dir)
        elif args.report_to == "wandb":
            import wandb

            self.tracker = wandb.init(config=vars(args), dir=args.output_dir)

    def log(self, step, metrics, pbar=None):
        metrics = {k: (float(v) if torch.is_tensor(v) else v) for k, v in metrics.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if pbar is not None:
            pbar.set_postfix({k: f"{v:.3g}" for k, v in list(metrics.items())[:4] if isinstance(v, float)})
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
                dynamic_ncols=True, disable=os.environ.get("TQDM_DISABLE") == "1")


def mean_metrics(rows):
    """Average a list of metric dicts (e.g. over minibatches) key by key."""
    return {k: sum(float(r[k]) for r in rows) / len(rows) for k in rows[0]}


# ============================================================================ checkpoints
def save_checkpoint(model, tokenizer, args, folder, state=None):
    """save_pretrained of model and tokenizer plus args.json (and `state`, e.g. optimizer and
    step, as trainer_state.pt), written to a temporary folder and renamed into place, so a crash
    never leaves half a checkpoint."""
    tmp = folder.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
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
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out, "config.json"))
    names = sorted(os.listdir(tmp), key=lambda n: n == "config.json")
    for name in names:
        os.replace(os.path.join(tmp, name), os.path.join(out, name))
    os.rmdir(tmp)


def write_json(path, obj):
    """Write JSON atomically (temporary file, then rename)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


# ============================================================================ memory
def tensor_bytes(tensors):
    """Sum of storage sizes of tensors (or of a module's parameters and buffers)."""
    if isinstance(tensors, torch.nn.Module):
        tensors = list(tensors.parameters()) + list(tensors.buffers())
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
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

