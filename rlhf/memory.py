"""Memory accounting: the plan (`--estimate_memory`, from config.json alone) and the
measurement of a real run (`log_memory` -> <output_dir>/memory.json), row for row, so a plan can
be checked line by line (tests/test_memory.py). Knows no script: each script says what it holds
(trained models, frozen models, sequences per micro-batch, rollout sizes) from its own Args.
GB here means 2**30 bytes.
"""

import copy
import os
import resource
import sys

import torch

from rlhf import checkpoints
from rlhf import basics
from rlhf import models
from rlhf import data
from rlhf import lora
from rlhf import parallel
from worlds import world


def tensor_bytes(tensors):
    """Sum of storage sizes of tensors (or of a module's parameters and buffers); of an FSDP2
    shard, this rank's part."""
    if isinstance(tensors, torch.nn.Module):
        tensors = list(tensors.parameters()) + list(tensors.buffers())
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = t.to_local() if parallel.is_sharded_param(t) else t
        key = t.untyped_storage().data_ptr()
        if key not in seen:  # tied weights are counted once
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def optimizer_state_bytes(optimizer):
    return tensor_bytes([v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)])


def peak_memory_bytes():
    """Peak allocated CUDA memory on a GPU; peak resident set size of the process on the CPU. On Linux
    from /proc/self/status's VmHWM, this program's own peak: getrusage's ru_maxrss survives exec, so a
    script started by a large process (a test worker, a notebook) would report its parent's size."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024  # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB, macOS bytes


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
    models.check_model_source(name)
    return AutoConfig.from_pretrained(name, trust_remote_code=args.trust_remote_code)


def parameter_numels(config, head="lm"):
    """Element counts of a model's parameters (tied weights once) and buffers, from a model built
    on the meta device: exact for any architecture, no memory, well under a second for 1.5B."""
    model = _meta_model(config, head)
    return [p.numel() for p in model.parameters()], sum(b.numel() for b in model.buffers())


def _meta_model(config, head):
    import copy

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = copy.deepcopy(config)
    if head == "score":  # reward models and critics: the LM head becomes a (hidden -> 1) score head
        config.num_labels = 1
    cls = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
    with torch.device("meta"):
        return cls.from_config(config)


def peft_plan(args, config, head, nb):
    """What a model holds under --use_peft, from its config: (bytes of the frozen base, element
    counts of what trains, bytes of what trains, LoRA activation bytes per token and layer).

    Every linear layer of the decoder (not the head) is quantised by --load_in_4bit (NF4: half a
    byte per weight, one fp32 absmax per block of 64, a 16-entry fp32 code per layer) or
    --load_in_8bit (one byte per weight, one fp32 scale per output row); everything else stays in
    --dtype. Each --lora_target_modules layer (in -> out) gets A (r x in) and B (out x r) in fp32
    (peft keeps adapters in fp32 on a bf16 base); a score head trains as a copy in --dtype.
    Activations, per adapted layer and token: the fp32 copy of its input that peft makes for the
    adapter on a bf16/fp16 base (with --lora_dropout, the dropout's output instead, plus a 1-byte
    mask on a GPU; the CPU keeps 4-byte noise), and A's output (r fp32). Measured with
    saved_tensors_hooks on a tiny Qwen2 (tests/test_peft.py): the base's own activations are
    counted as if its layers trained, so the total is an upper bound (by ~20% there).
    """
    model = _meta_model(config, head)
    heads = {id(model.get_output_embeddings()), id(getattr(model, "score", None))}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and id(m) not in heads]
    targets = None if args.lora_target_modules == "all-linear" else {
        t.strip() for t in args.lora_target_modules.split(",") if t.strip()}
    quantised, base, trained, act = set(), 0, [], 0
    for name, m in linears:
        n = m.weight.numel()
        if args.load_in_4bit:
            base += -(-n // 2) + 4 * -(-n // 64) + 16 * 4
            quantised.add(id(m.weight))
        elif args.load_in_8bit:
            base += n + 4 * m.out_features
            quantised.add(id(m.weight))
        if targets is None or name.split(".")[-1] in targets:
            trained += [args.lora_r * m.in_features, m.out_features * args.lora_r]
            act += ((4 if nb < 4 or args.lora_dropout else 0) + (1 if args.lora_dropout else 0)) * m.in_features + 4 * args.lora_r
    base += (sum(p.numel() for p in model.parameters() if id(p) not in quantised)
             + sum(b.numel() for b in model.buffers())) * nb
    trained_bytes = 4 * sum(trained)
    if head == "score":  # the trained copy of the score head (peft's modules_to_save)
        trained.append(model.score.weight.numel())
        trained_bytes += nb * model.score.weight.numel()
    return base, trained, trained_bytes, act // config.num_hidden_layers


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
        if numel >= basics.SR_BUCKET_NUMEL or i == len(numels) - 1:
            largest, numel = max(largest, numel), 0
    return largest


def activation_plan(config, tokens, nbytes, checkpointing, adapters_per_layer=0, kv_tokens=None, kv_width=None):
    """Bytes autograd keeps for backward over `tokens` (sequences x length) of a Llama/Qwen-style
    decoder with flash/SDPA attention (no seq x seq scores kept).

    Per token and layer, counted from the tensors saved for backward (saved_tensors_hooks on a
    tiny Qwen2, exact there): nbytes * (8 h + 4 I + 2 kv) for the norm outputs, q/k/v/o inputs,
    attention output and the SwiGLU MLP, + 2 h * (4 - nbytes) because RMSNorm saves its input in
    fp32, + 4 * heads + 8 (attention log-sum-exp, norm statistics). h: hidden size, I:
    intermediate size, kv: key/value width. Keys and values are kept once per key position that
    each row attends to, `kv_tokens` (default: `tokens`; rows that continue a shared prompt's cache
    attend to all of its positions, so there it is rows x (prompt + completion)), at `kv_width`
    (default: the config's; HF's SDPA path with an attention mask repeats them to every query head,
    estimate_memory passes that width). With gradient checkpointing only each layer's input
    (nbytes * h) is kept, and one layer's activations are rebuilt at a time in backward.
    `adapters_per_layer`: LoRA's bytes per token and layer (peft_plan), on top of the base's
    (counted in full, as if the frozen base layers saved what trained ones do: an upper bound).
    This assumes what every training script does: dropout zeroed (models.disable_dropout) and the
    trained models in training mode, since HF layers checkpoint only while training (in eval
    mode --gradient_checkpointing would keep the full activations).
    """
    h, layers = config.hidden_size, config.num_hidden_layers
    inter = getattr(config, "intermediate_size", 4 * h)
    heads = config.num_attention_heads
    kv = kv_width or _kv_width(config)
    kv_tokens = tokens if kv_tokens is None else kv_tokens
    per_layer = nbytes * (8 * h + 4 * inter) + 2 * h * (4 - nbytes) + 4 * heads + 8 + adapters_per_layer
    layer = tokens * per_layer + kv_tokens * 2 * kv * nbytes  # one layer's, over the whole micro-batch
    final_norm = (4 + nbytes) * h
    if checkpointing:
        return tokens * (layers * nbytes * h + final_norm) + layer
    return layers * layer + tokens * final_norm


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


def vllm_engine_plan(args, config, numels, buffers, sequences, prompt_length, completion_length):
    """--use_vllm: the engine's row. On a CUDA GPU vLLM reserves --vllm_gpu_memory_utilization of
    its memory (its weights, in --vllm_dtype, plus as much KV cache as fits) and holds it all run
    long; elsewhere the plan shows the least the engine needs: its weights and one rollout's KV
    cache (2 x layers x kv width per token), and says what a GPU would reserve."""
    nb = basics.torch_dtype(args.vllm_dtype or args.dtype).itemsize
    least = (sum(numels) + buffers) * nb + 2 * config.num_hidden_layers * _kv_width(config) * nb * sequences * (
        prompt_length + completion_length)
    sleep = "; freed during each update (--vllm_enable_sleep_mode)" if args.vllm_enable_sleep_mode else ""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        return ("vLLM engine", int(args.vllm_gpu_memory_utilization * total),
                f"--vllm_gpu_memory_utilization {args.vllm_gpu_memory_utilization} of this GPU's {gb(total):.0f} GB "
                f"(its weights + KV cache; at least {gb(least):.3f} GB){sleep}")
    return ("vLLM engine", least, f"its weights + one rollout's KV cache; on a GPU it reserves "
            f"--vllm_gpu_memory_utilization {args.vllm_gpu_memory_utilization} of the GPU's memory{sleep}")


def estimate_memory(args, *, train_sequences, prompt_length, completion_length, head="lm", reference=None,
                    critic_from=None, reward_models=None, reward_note="", generation_sequences=0,
                    generation_length=None, offload=False, extra_layers=0, train_prompts=None, teacher=None):
    """The memory plan of a script that holds these things: a list of (component, bytes, note).

    What the script holds, from its own Args:
      head                  "lm" for a policy; "score" for a model trained with a scalar head;
      reference             None: not part of this algorithm; True: a frozen copy of the policy;
                            a string: not held, and why ("--beta 0");
      critic_from           folder of the model a trained critic (scalar head) starts from;
      reward_models         None: not part of this algorithm; else folders of frozen reward
                            models (maybe none: `reward_note` says what scores instead);
      train_sequences       sequences of prompt_length + completion_length tokens in one
                            training forward (a micro-batch);
      train_prompts         the distinct prompts among them, when sequences continue a shared
                            prompt (GRPO's groups, chosen + rejected: sampling.completion_states
                            runs each prompt once, except under gradient checkpointing);
      prompt_length, completion_length: the widest micro-batch's, in tokens (data_lengths);
      generation_sequences  sequences sampled at once, `generation_length` new tokens each;
      offload               frozen models wait on the CPU (--offload_frozen).
      extra_layers          decoder layers added on top of the model's (reward.py --expand_layers).
      teacher               None: not part of this algorithm; else the folder or Hub id of a frozen
                            causal LM read beside the policy on the same tokens (distill.py): its
                            weights, and in the training micro-batch its hidden states and one chunk
                            of its logits.
    With --use_vllm the engine samples instead (vllm_engine_plan): its row replaces the rollout.

    Static rows (weights, gradients, optimizer states, frozen models) are exact counts from the
    config; the last row is the larger of the training micro-batch (activations + one chunk of
    logits) and the rollout (generation) or the optimizer step's fp32 bucket, which never
    coexist. Not counted: the CUDA context (~0.5 GB) and allocator fragmentation.
    """
    dtype = basics.torch_dtype(args.dtype)
    nb = dtype.itemsize
    config = model_config(args)
    if extra_layers:  # the trained model is deeper than the one it loads
        config = copy.deepcopy(config)
        config.num_hidden_layers += extra_layers
        if getattr(config, "layer_types", None):
            config.layer_types = list(config.layer_types) + [config.layer_types[-1]] * extra_layers
    numels, buffers = parameter_numels(config, head)
    weights = (sum(numels) + buffers) * nb
    P, C, gen_len = prompt_length, completion_length, generation_length or completion_length
    ckpt = args.gradient_checkpointing
    optim = models.default_optim(args) if args.optim == "auto" else args.optim  # "auto": an Args built in code
    opt_note = {"adamw_8bit": "8-bit AdamW: ~2 bytes/param", "adamw": "AdamW: 8 bytes/param (fp32 moments)"}[optim]
    adapters = 0  # LoRA activation bytes per token and layer
    if args.use_peft:  # a frozen (maybe 4/8-bit) base, and only the adapters (and a score head) train
        base, trained, trained_bytes, adapters = peft_plan(args, config, head, nb)
        bits = "4-bit NF4" if args.load_in_4bit else "8-bit" if args.load_in_8bit else str(dtype)
        rows = [("policy weights", base, f"frozen base, {sum(numels) / 1e6:,.1f}M params, linear layers {bits}"),
                ("adapter weights", trained_bytes, f"LoRA r={args.lora_r}, {sum(trained) / 1e6:,.2f}M params in fp32"
                 + (" + score head" if head == "score" else "")),
                ("gradients", trained_bytes, "of the adapters only"),
                ("optimizer states", optimizer_state_plan(trained, optim, torch.float32), opt_note + ", adapters only")]
    else:
        rows = [("policy weights", weights, f"{sum(numels) / 1e6:,.1f}M params x {nb} bytes ({dtype})"),
                ("gradients", sum(numels) * nb, f"{dtype}, like the weights"),
                ("optimizer states", optimizer_state_plan(numels, optim, dtype), opt_note + "; no master weights")]
    where = " (on the CPU: --offload_frozen)" if offload else ""
    if reference is True and args.use_peft:
        rows.append(("reference model", 0, "none: the policy's base with its adapters off (--use_peft)"))
    elif reference is not None:
        held = reference is True
        rows.append(("reference model", weights if held and not offload else 0,
                     "frozen copy of the policy" + where if held else f"none: {reference}"))
    c_adapters = 0
    if critic_from is not None:
        c_config = _config_or_policy(args, critic_from, config)
        c_numels, c_buffers = parameter_numels(c_config, "score")
        if args.use_peft:
            c_base, c_trained, c_bytes, c_adapters = peft_plan(args, c_config, "score", nb)
            rows += [("critic weights", c_base, f"frozen base, {sum(c_numels) / 1e6:,.1f}M params"),
                     ("critic adapter weights", c_bytes, "LoRA + score head"),
                     ("critic gradients", c_bytes, ""),
                     ("critic optimizer states", optimizer_state_plan(c_trained, optim, torch.float32), opt_note)]
        else:
            rows += [("critic weights", (sum(c_numels) + c_buffers) * nb, f"{sum(c_numels) / 1e6:,.1f}M params, score head"),
                     ("critic gradients", sum(c_numels) * nb, ""),
                     ("critic optimizer states", optimizer_state_plan(c_numels, optim, dtype), opt_note)]
    reward_bytes, notes = 0, []
    for path in [p for p in reward_models or [] if p]:
        r_numels, r_buffers = parameter_numels(_config_or_policy(args, path, config), "score")
        reward_bytes += (sum(r_numels) + r_buffers) * nb
        notes.append(path if os.path.exists(os.path.join(path, "config.json")) else f"{path} (not found: policy-shaped)")
    if reward_models is not None:
        rows.append(("reward model", 0 if offload else reward_bytes,
                     ", ".join(notes) + where if notes else f"none: {reward_note}"))
    t_config = None
    if teacher is not None:
        t_config = _config_or_policy(args, teacher, config)
        t_numels, t_buffers = parameter_numels(t_config, "lm")
        rows.append(("teacher model", (sum(t_numels) + t_buffers) * nb,
                     f"{teacher}, frozen, {sum(t_numels) / 1e6:,.1f}M params x {nb} bytes ({dtype})"
                     + ("" if os.path.exists(os.path.join(teacher, "config.json")) else " (not found: policy-shaped)")))

    if getattr(args, "use_vllm", False) and generation_sequences:  # the engine samples, within its own memory
        rows.append(vllm_engine_plan(args, config, numels, buffers, generation_sequences, P, gen_len))
        generation_sequences = 0

    # the largest transient: a training micro-batch, a rollout, or the optimizer step's fp32 bucket
    logits = logits_plan(config, train_sequences * C) if head == "lm" else 0  # a score head has no vocabulary
    prompts = train_sequences if ckpt or not train_prompts else train_prompts  # each prompt's forward
    tokens, kv_tokens = prompts * P + train_sequences * C, (prompts * P if prompts < train_sequences else 0) + train_sequences * (P + C)
    flash = models.attn_implementation(args.attn_implementation) == "flash_attention_2"
    width = None if flash else config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    train = activation_plan(config, tokens, nb, ckpt, adapters, kv_tokens, width) + logits
    if critic_from is not None:
        c_width = None if flash else c_config.num_attention_heads * (
            getattr(c_config, "head_dim", None) or c_config.hidden_size // c_config.num_attention_heads)
        train += activation_plan(c_config, tokens, nb, ckpt, c_adapters, kv_tokens, c_width)
    if t_config is not None:  # no gradient: its hidden states at every token and one chunk of its logits
        train += tokens * t_config.hidden_size * nb + logits_plan(t_config, train_sequences * C)
    gen = generation_plan(config, generation_sequences, P, gen_len, nb) if generation_sequences else 0
    visit = max(weights, reward_bytes) if offload else 0  # a frozen model on the device for its pass
    bucket = 8 * sr_bucket_numel(numels) if dtype == torch.bfloat16 and not args.use_peft else 0  # LoRA: fp32
    peak = max(train, gen, visit, bucket)
    if peak == train:
        shared = f"{prompts} x {P} + {train_sequences} x {C}" if prompts < train_sequences else f"{train_sequences} x ({P}+{C})"
        what = (f"training micro-batch: {shared} tokens{', checkpointed' if ckpt else ''}"
                + (", + one logits chunk" if logits else ""))
    elif peak == gen:
        what = f"generation: KV cache of {generation_sequences} x ({P}+{gen_len}) tokens, prefill, logits"
    elif peak == visit:
        what = "--offload_frozen: one frozen model on the device for its forward pass"
    else:
        what = "optimizer step: fp32 copy of the largest bf16 bucket"
    rows.append(("activations", peak, what))
    return rows


def data_lengths(args, split, completions="data"):
    """(P, C): the tokens of the widest micro-batch the plan sizes, from the training data rather than
    the flags' maxima: the longest prompt as the script renders it (chat template, default system
    prompt) and cuts it (--max_prompt_length), and with `completions="data"` the longest completion
    (SFT's, or a chosen or rejected response: EOS included, cut at --max_completion_length); sampled
    completions (`completions` a number: their maximum length) may reach that maximum. A plan from
    --max_prompt_length alone sized GRPO on SmolLM2 with 40-token prompts at 512 (5x the measured peak).
    Without a local tokenizer (sft.py's from-scratch model, a folder holding a config alone, a Hub id:
    the plan reads no more than config.json there), the flags' maxima."""
    limit_c = args.max_completion_length if completions == "data" else completions
    if not any(os.path.isfile(os.path.join(args.model, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return args.max_prompt_length, limit_c
    tokenizer = models.load_tokenizer(args.model, args.trust_remote_code)
    ds = data.training_data(args, split)
    if split == "prefs":
        triples = data.preference_triples(ds, args.dataset)
        pairs = [(p, r) for p, c, rj in triples for r in (c, rj)]
    elif split == "rl":
        data.require_columns(ds, ["prompt"], args.dataset)
        pairs = [(p, None) for p in ds["prompt"]]
    else:
        pairs = data.sft_pairs(ds, args.dataset)
    tools = list(ds["tools"]) if "tools" in ds.column_names and split != "prefs" else [None] * len(pairs)
    prompt_mask = data.encode_prompts(tokenizer, [data.render_prompt(tokenizer, p, t) for (p, _), t in zip(pairs, tools)])[1]
    P = min(int(prompt_mask.sum(1).max()), args.max_prompt_length)
    if completions != "data":
        return P, limit_c
    texts = ["".join(text for text, _ in data.render_turns(tokenizer, p, c, t)) for (p, c), t in zip(pairs, tools)]
    C = int(data.encode_completions(tokenizer, texts)[1].sum(1).max())
    return P, min(C, limit_c)


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


def print_plan(args, **holds):
    """--estimate_memory: print estimate_memory(args, **holds) as a table and exit. The plan is for
    the CUDA GPU the run will train on, so --dtype auto plans in bf16 and --optim auto 8-bit AdamW
    (auto's choices there) even on a machine without one, where a run would load fp32 and torch's
    AdamW; the printout says so. --dtype float32 on a machine without CUDA plans a run here: the
    optimizer --optim auto picks here, and the process's own resident size."""
    note = ""
    if args.dtype == "auto":
        args = copy.copy(args)
        args.dtype = "bfloat16"
        if not torch.cuda.is_available():
            note = ("--dtype auto planned in bf16, what it loads on a CUDA GPU; this machine has none, and a run "
                    "here would load fp32 (about twice the weights): pass --dtype float32 to plan that.\n")
    here = not torch.cuda.is_available() and args.dtype == "float32"  # --dtype float32 on a CPU: plan a run here
    if not here and not basics.passed("optim") and args.parallel != "fsdp2" and args.optim != "adamw_8bit":
        args = copy.copy(args)  # --optim auto on a machine without CUDA: plan the GPU's 8-bit AdamW too
        args.optim = "adamw_8bit"
        note += "--optim auto planned 8-bit AdamW, what it takes on a CUDA GPU; pass --optim adamw to plan torch's.\n"
    dtype = basics.torch_dtype(args.dtype)
    script = os.path.basename(sys.argv[0])
    title = (f"{script} memory plan for {args.model or 'the from-scratch model'} ({dtype}, --optim {args.optim}, "
             f"--batch_size {args.batch_size}{', --gradient_checkpointing' if args.gradient_checkpointing else ''}; "
             f"per device, estimated from the config)")
    rows = estimate_memory(args, **holds)
    if not torch.cuda.is_available() and dtype == torch.float32:  # a run on this CPU: the process itself counts
        rows.insert(-1, ("runtime", peak_memory_bytes(), "this process so far: Python, torch, transformers, tokenizer, "
                         "data (on the CPU; a GPU plan leaves out the CUDA context)"))
    print(note + memory_table(rows, title))  # the table's last line stays its total
    sys.exit(0)


def quantisation_constants(params):
    """The tensors bitsandbytes keeps beside quantised weights: 4-bit absmax and code (of both
    levels with nested quantisation), 8-bit row scales."""
    out = []
    for p in params:
        state = getattr(p, "quant_state", None)
        while state is not None:
            out += [state.absmax, state.code, getattr(state, "offset", None)]
            state = getattr(state, "state2", None)
        out.append(getattr(p, "SCB", None))
    return [t for t in out if torch.is_tensor(t)]


_MEMORY_LOGGED = set()  # output folders whose memory.json holds a complete measurement


def log_memory(output_dir, model, optimizer, critic=None, frozen=None):
    """Measure the memory plan's rows in a real run, on the training device: the trained model's
    weights, gradients and optimizer states (and the critic's, which may share the optimizer),
    and each `frozen` component ({row name: a model, a list of models, or None when absent}),
    plus the peak so far; write <output_dir>/memory.json and print the table.

    Call it right before every optimizer step: it measures once, at the first call where every
    optimizer already has its states (they are created by the first step), and returns at once
    after that. A run of one step records what it has (optimizer states 0).
    """
    if output_dir in _MEMORY_LOGGED or not parallel.is_main():  # under torchrun: rank 0's device stands for all
        return

    def tensors(c):  # a module's parameters and buffers, or a list of tensors and modules
        items = [c] if isinstance(c, torch.nn.Module) else list(c or [])
        out = []
        for t in items:
            out += list(t.parameters()) + list(t.buffers()) if isinstance(t, torch.nn.Module) else [t]
        return out

    def on_device(ts):  # device memory only (not models offloaded to the CPU); FSDP2: this rank's shard
        ts = [t.to_local() if hasattr(t, "to_local") else t for t in ts if torch.is_tensor(t)]
        return tensor_bytes([t for t in ts if t.device.type == basics.device().type])

    def weights(m, prefix):  # under --use_peft: the frozen base (with its quantisation constants) and the adapters
        if not lora.is_peft(m):
            return {f"{prefix} weights": m}
        frozen = [p for p in m.parameters() if not p.requires_grad]
        return {f"{prefix} weights": frozen + list(m.buffers()) + quantisation_constants(frozen),
                ("critic adapter weights" if prefix == "critic" else "adapter weights"):
                    [p for p in m.parameters() if p.requires_grad]}

    components = {**weights(model, "policy"), "gradients": [p.grad for p in model.parameters()],
                  "optimizer states": (optimizer, model)}
    if critic is not None:
        components.update({**weights(critic, "critic"), "critic gradients": [p.grad for p in critic.parameters()],
                           "critic optimizer states": (optimizer, critic)})
    components.update({k: c for k, c in (frozen or {}).items() if c is not None and not (isinstance(c, list) and not c)})  # absent: no row
    measured, complete = {}, True
    for name, c in components.items():
        if isinstance(c, tuple):  # (optimizer, module): the states of that module's parameters only
            states = [c[0].state[p] for p in c[1].parameters() if p in c[0].state]
            complete = complete and bool(states)
            measured[name] = on_device(v for s in states for v in s.values())
        else:
            measured[name] = on_device(tensors(c))
    peak = peak_memory_bytes()
    kind = "torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "peak RSS of the process"
    checkpoints.write_json(os.path.join(output_dir, "memory.json"), {
        "components": measured, "total_bytes": sum(measured.values()), "peak_bytes": peak, "peak_kind": kind,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "complete": complete})
    if complete:
        _MEMORY_LOGGED.add(output_dir)
        rows = [(name, n, "measured") for name, n in measured.items()]
        print(memory_table(rows, f"measured memory (peak so far: {gb(peak):.3f} GB, {kind}):"))
