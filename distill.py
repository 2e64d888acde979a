"""distill.py: on-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language
Models", GKD): the student samples completions and is trained to match a frozen teacher's
next-token distribution on every token it wrote. Recipes and evidence: docs/distill.md.

For a prompt x and a completion y, at each completion token t both models read (x, y_<t), and
p_S, p_T are their next-token distributions at temperature tau (softmax(z / tau)). The divergence
is TRL's generalized_jsd_loss, the generalized JSD of GKD Eq. 1 with its two ends made the KLs:

    beta = 0:      D_t = KL(p_T || p_S) = sum_v p_T (log p_T - log p_S)          (forward KL)
    beta = 1:      D_t = KL(p_S || p_T) = sum_v p_S (log p_S - log p_T)          (reverse KL)
    0 < beta < 1:  m = beta p_T + (1 - beta) p_S
                   D_t = beta KL(p_T || m) + (1 - beta) KL(p_S || m)              (GKD Eq. 1)
    L = sum over the step's completion tokens of D_t / (their number)

y comes from the student (sampled at tau, no gradient through the sampling: GKD's on-policy
objective, Eq. 3) in a fraction lmbda of the micro-batches, and from the dataset in the rest
(GKD Algorithm 1's mix; lmbda = 1 is fully on-policy).

Memory: the teacher is frozen (eval mode, no gradient) and held beside the student. Neither
model's (B, T, V) logits exist: both heads are applied to completion tokens only, in chunks of
tokens under activation checkpointing, so one chunk of each model's fp32 logits exists at a time.

Departures from the paper and from TRL:
- Defaults are TRL's DistillationTrainer's (lmbda 1, beta 1, temperature 1 for sampling and for
  the divergence); TRL's experimental GKDTrainer has lmbda 0.5, beta 0.5, samples at 0.9 and
  computes the divergence at temperature 1 (docs/trl.md lists every difference).
- The on-/off-policy choice of each micro-batch is a seeded draw of (seed, step, micro-batch), the
  same on every rank and again on resume (TRL: Python's random per training step).
- The loss is divided by the step's completion tokens over every micro-batch and rank, counted
  after sampling (DistillationTrainer's; GKDTrainer counts the dataset's tokens before sampling).
- No seq_kd (teacher-sampled sequences for the off-policy batches): the dataset's completions.
- The teacher must share the student's tokenizer and vocabulary (as in TRL), refused otherwise.
- No held-out evaluation during training (--eval_dataset is refused): eval.py scores the saved
  student. On the embedded world the gold score is printed before and after, and the teacher's.
"""

import copy
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rlhf import checkpoints
import common
from rlhf import data
from rlhf import memory
from rlhf import parallel
from rlhf import rollouts
from rlhf import sampling
from rlhf import tracking
from common import SamplingArgs

# what the embedded world's tiny policy needs instead of the pretrained defaults (docs/distill.md)
EMBEDDED_DEFAULTS = {"learning_rate": 5e-5, "max_steps": 100, "batch_size": 16, "max_completion_length": 32}


@dataclass
class Args(SamplingArgs):
    # model and data
    teacher: str = field(default="runs/grpo", metadata={"help": "Hub id or local folder of the frozen teacher (a causal LM with the student's tokenizer); never loaded with remote code."})
    max_prompt_length: int = field(default=512, metadata={"help": "Prompts are cut to their last this-many tokens."})
    # generation
    max_completion_length: int = field(default=256, metadata={"help": "Sampled completions stop at a stop token or this many tokens; dataset completions are cut to it."})
    temperature: float = field(default=1.0, metadata={"help": "tau: the student samples at it, and both distributions are softened by it in the divergence (TRL's DistillationTrainer)."})
    # algorithm
    lmbda: float = field(default=1.0, metadata={"help": "The fraction of micro-batches the student samples (on-policy); the rest train on the dataset's completions (GKD's lambda; 1: fully on-policy)."})
    beta: float = field(default=1.0, metadata={"help": "The divergence: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), in between the generalized JSD with mixture beta p_T + (1 - beta) p_S."})
    # optimisation
    max_steps: int = field(default=150, metadata={"help": "Optimizer steps."})
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (TRL's DistillationTrainer's)."})
    lr_scheduler_type: str = field(default="linear", metadata={"help": "Any transformers scheduler name."})
    batch_size: int = field(default=8, metadata={"help": "Prompts per micro-batch, one completion each."})


def validate(args):
    """The checks main() needs before anything loads."""
    if not 0 <= args.lmbda <= 1 or not 0 <= args.beta <= 1:
        common.fail(f"--lmbda {args.lmbda} and --beta {args.beta} must be in [0, 1] (the on-policy fraction, the "
                    "divergence's interpolation).")
    if args.eval_dataset:
        common.fail("distill.py has no held-out evaluation during training: drop --eval_dataset and score the saved "
                    "student with eval.py.")
    if args.teacher == "runs/grpo" and not os.path.exists(os.path.join(args.teacher, "config.json")):
        common.fail("runs/grpo holds no teacher yet: run `python grpo.py` first (the embedded world's demo), or pass "
                    "--teacher <folder or Hub id> of a model with the student's tokenizer.")
    return args


def print_memory_plan(args):
    """--estimate_memory: what distillation holds (the student, the frozen teacher, one rollout)."""
    split = "sft" if has_completions(data.training_data(args, "sft")) else "rl"
    memory.print_plan(args, teacher=args.teacher, train_sequences=args.batch_size, train_prompts=args.batch_size,
                      generation_sequences=args.batch_size,
                      **dict(zip(["prompt_length", "completion_length"],
                                 memory.data_lengths(args, split, args.max_completion_length))))


# ============================================================================ the divergence
def generalized_jsd(student_logits, teacher_logits, beta, temperature=1.0):
    """D_t of the docstring for each row of (n, V) fp32 logits -> (n,): TRL's generalized_jsd_loss
    before its reduction (beta 0: forward KL, 1: reverse KL, else GKD Eq. 1)."""
    s = F.log_softmax(student_logits / temperature, -1)  # (n, V) log p_S
    t = F.log_softmax(teacher_logits / temperature, -1)  # (n, V) log p_T
    if beta == 0:  # KL(p_T || p_S)
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:  # KL(p_S || p_T)
        return (s.exp() * (s - t)).sum(-1)
    log_m = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))  # log m, m = beta p_T + (1 - beta) p_S
    return beta * (t.exp() * (t - log_m)).sum(-1) + (1 - beta) * (s.exp() * (s - log_m)).sum(-1)  # GKD Eq. 1


def token_divergence(model, teacher, batch, beta, temperature, chunk_tokens=None):
    """D_t on every completion token the loss is taken over (batch["completion_mask"]), 0 elsewhere,
    and the student's entropy there (detached): (B, C) each. Both models read the prompt and the
    completion (batch["attention_mask"]); their heads run on the kept tokens only, in checkpointed
    chunks of `chunk_tokens` (default: 2**26 // vocab, 256 MB of fp32 logits per model)."""
    args = (batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["attention_mask"])
    hidden = sampling.states_before(model, *args)  # (B, C, H): the state before each completion token
    with torch.no_grad():
        teacher_hidden = sampling.states_before(teacher, *args)  # (B, C, H')
    keep = batch["completion_mask"].bool()  # (B, C)
    h, h_teacher = hidden[keep], teacher_hidden[keep]  # (N, H), (N, H'): kept tokens only
    chunk = chunk_tokens or max(1, 2**26 // model.get_output_embeddings().weight.shape[0])
    parts = []
    for i in range(0, h.shape[0], chunk):
        part = (model, teacher, h[i:i + chunk], h_teacher[i:i + chunk], beta, temperature)
        if torch.is_grad_enabled() and h.requires_grad:  # backward recomputes the chunk's logits
            parts.append(torch.utils.checkpoint.checkpoint(_chunk_divergence, *part, use_reentrant=False))
        else:
            parts.append(_chunk_divergence(*part))
    divergence = torch.zeros(keep.shape, device=h.device).masked_scatter(keep, torch.cat([d for d, _ in parts]))
    entropy = torch.zeros(keep.shape, device=h.device).masked_scatter(keep, torch.cat([e for _, e in parts]))
    return divergence, entropy


def _chunk_divergence(model, teacher, h, h_teacher, beta, temperature):
    """One chunk: both heads (sampling.lm_logits: the logits each model samples from), D_t, entropy."""
    logits = sampling.lm_logits(model, h)  # (n, V) fp32
    with torch.no_grad():
        teacher_logits = sampling.lm_logits(teacher, h_teacher)
        logp = F.log_softmax(logits.detach() / temperature, -1)
        entropy = -(logp.exp() * logp).sum(-1)  # (n,)
    return generalized_jsd(logits, teacher_logits, beta, temperature), entropy


def token_normaliser(completion_masks):
    """L's denominator on this rank: the completion tokens of every micro-batch of the step on every
    rank, over the number of ranks (optimizer_step averages the ranks' gradients, so L is then the
    token mean of the global batch, as one process computes it)."""
    num_tokens = parallel.all_reduce(sum(m.sum() for m in completion_masks).float())
    return num_tokens.clamp(min=1 / parallel.world_size())


# ============================================================================ the data: on- or off-policy
def has_completions(ds):
    return "completion" in ds.column_names or "messages" in ds.column_names


def prompt_split(spec):
    """The world split the student's prompts come from: sft (prompts with completions, for the
    off-policy micro-batches), or rl for the worlds and tasks that have no completions
    (embedded:ifeval, reasoning_gym:TASK): a fully on-policy run needs only prompts."""
    return "rl" if spec == common.IFEVAL or data.is_task(spec) else "sft"


def distill_rows(ds, spec, lmbda):
    """(prompt, completion) rows from TRL's SFT formats (prompt + completion, messages), or
    (prompt, None) from prompt-only rows, which serve only a fully on-policy run (lmbda 1)."""
    if has_completions(ds):
        return data.sft_pairs(ds, spec)
    data.require_columns(ds, ["prompt"], spec, "Distillation reads prompts (and, for --lmbda < 1, completions).")
    data.check_text(ds, ["prompt"], spec)
    if lmbda < 1:
        common.fail(f"--lmbda {lmbda}: a fraction {1 - lmbda:g} of the micro-batches trains on the dataset's "
                    f"completions, and {data.dataset_name(spec)} has none (prompt-only rows): pass data with "
                    "'completion' or 'messages', or --lmbda 1 (every completion sampled by the student).")
    return [(p, None) for p in ds["prompt"]]


def is_on_policy(args, step, micro):
    """Whether micro-batch `micro` of `step` is sampled by the student: probability lmbda, a draw
    keyed by (seed, step, micro), the same on every rank and after a resume."""
    key = (args.seed * 1_000_003 + step) * 1_009 + micro
    return bool(torch.rand((), generator=torch.Generator().manual_seed(key)) < args.lmbda)


def micro_batch(sampler, model, world, step, micro):
    """One micro-batch of this rank's prompts with completions: the student's (sampled through the
    run's sampler, rlhf/rollouts.py) or the dataset's. The dict the loss reads: prompts (B, P),
    completions, what both models read (attention_mask) and what the loss is taken over
    (completion_mask: the model's own tokens, or a dataset conversation's assistant turns), (B, C)."""
    args, tokenizer = world["args"], world["tokenizer"]
    idx = data.rank_batch(len(world["prompts"]), args.batch_size, args.seed, step * args.gradient_accumulation_steps + micro)
    prompt_ids, prompt_mask = data.encode_prompts(tokenizer, [world["prompts"][i] for i in idx], args.max_prompt_length,
                                                  world["device"])
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "on_policy": is_on_policy(args, step, micro),
             "prompts": [world["raw_prompts"][i] for i in idx]}
    if batch["on_policy"]:
        rollout = rollouts.sample(sampler, model, prompt_ids, prompt_mask, batch["prompts"], 1, (step, micro))
        return {**batch, "completion_ids": rollout.completion_ids, "attention_mask": rollout.attention_mask,
                "completion_mask": rollout.completion_mask, "truncated": rollout.truncated, "texts": rollout.texts}
    ids, mask, trained = data.encode_turns(tokenizer, [world["turns"][i] for i in idx], args.max_completion_length,
                                           world["stop_ids"])
    texts = ["".join(text for text, _ in world["turns"][i]) for i in idx]
    return {**batch, "completion_ids": ids.to(world["device"]), "attention_mask": mask.to(world["device"]),
            "completion_mask": trained.to(world["device"]), "truncated": None, "texts": texts}


def batch_metrics(batch, divergence, entropy):
    """One micro-batch's metrics: its token-mean divergence and student entropy, whether the student
    sampled it, and (where it did) TRL's completion lengths and clipped ratio. Keeps each row's
    token-mean divergence in the batch, for --log_completions."""
    mask = batch["completion_mask"]
    batch["row_divergence"] = divergence.sum(1) / mask.sum(1).clamp(min=1)  # (B,), for --log_completions
    metrics = {"divergence": divergence.sum() / mask.sum().clamp(min=1), "entropy": entropy.sum() / mask.sum().clamp(min=1),
               "on_policy": float(batch["on_policy"])}
    if batch["truncated"] is not None:
        lengths = mask.sum(1).float()
        metrics.update({"completions/mean_length": lengths.mean(), "completions/clipped_ratio": batch["truncated"].float().mean()})
    return metrics


# ============================================================================ the teacher
def load_teacher(args, tokenizer, model):
    """The frozen teacher (--dtype, never remote code: a copy of args without it), in eval mode, after
    checking that it reads the student's tokens: the same tokenizer vocabulary and head size."""
    teacher_tokenizer = common.load_tokenizer(args.teacher)
    ours, theirs = tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
        common.fail(f"--teacher {args.teacher}: its tokenizer is not the student's ({len(theirs)} tokens against "
                    f"{len(ours)} of {args.model}; e.g. {differ}). Distillation compares the two next-token "
                    "distributions token by token, so both must read one vocabulary: pick a teacher of the student's "
                    "family (one tokenizer), or a student trained from the teacher's tokenizer.")
    teacher_args = copy.copy(args)
    teacher_args.trust_remote_code = False
    teacher = common.freeze(common.load_model(args.teacher, teacher_args))
    sizes = [m.get_output_embeddings().weight.shape[0] for m in (sampling.transformers_model(model), teacher)]
    if sizes[0] != sizes[1]:
        common.fail(f"--teacher {args.teacher}: its head scores {sizes[1]} tokens, the student's {sizes[0]} (the same "
                    "tokenizer, embeddings padded to other sizes); the divergence needs one vocabulary: resize one "
                    "with resize_token_embeddings and save it.")
    return teacher


# ============================================================================ main
def main():
    script = common.script_name()  # a fork (my_distill.py) prints, and shows its progress, under its own name
    args = common.apply_defaults(common.parse_args(Args), EMBEDDED_DEFAULTS)
    if args.estimate_memory:
        print_memory_plan(args)
    validate(args)  # after the plan, which reads only config.json and exits
    parallel.init_distributed()  # under torchrun: join the process group; a no-op otherwise
    common.set_seed(args.seed + parallel.rank())
    device = common.device()
    embedded = args.dataset == common.EMBEDDED

    # ---- data: prompts, and completions for the off-policy micro-batches (TRL's SFT formats)
    rows = distill_rows(data.training_data(args, prompt_split(args.dataset)), args.dataset, args.lmbda)
    data.set_max_steps(args, len(rows), args.batch_size * args.gradient_accumulation_steps * parallel.world_size())

    # ---- models: the student (LoRA adapters on a frozen base with --use_peft) and the frozen teacher
    tokenizer = common.load_tokenizer(args.model, args.trust_remote_code)
    model = common.load_model(args.model, args, adapters=True)
    common.disable_dropout(model).train()  # dropout off by zeroing it (TRL's disable_dropout), training mode
    stop_ids = sampling.stop_token_ids(model, tokenizer)  # a dataset completion already ending in one gets no extra EOS
    teacher = load_teacher(args, tokenizer, model)
    model = parallel.distribute(model, args)  # --parallel ddp | fsdp2 under torchrun
    prompts = [data.render_prompt(tokenizer, p) for p, _ in rows]
    turns = [data.render_turns(tokenizer, p, c) if c is not None else None for p, c in rows]
    data.check_readable(tokenizer, prompts, args.model, args.dataset)
    # what a micro-batch reads (micro_batch)
    world = {"tokenizer": tokenizer, "prompts": prompts, "raw_prompts": [p for p, _ in rows], "turns": turns,
             "stop_ids": stop_ids, "args": args, "device": device}
    truncated = data.truncation_counts(tokenizer, prompts, None, args, script)  # + completions as sampled
    print(f"{script}: {len(rows)} prompts from {data.dataset_name(args.dataset)}, teacher {args.teacher}, "
          f"lmbda {args.lmbda:g} (on-policy fraction), beta {args.beta:g}, temperature {args.temperature:g}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, device {device}")
    init = {}
    if embedded:
        init["init_gold_score"] = common.gold_eval(model, tokenizer, args)["gold_score"]
        init["teacher_gold_score"] = common.gold_eval(teacher, tokenizer, args)["gold_score"]
        print(f"{script}: gold score before training {init['init_gold_score']:.3f}, the teacher's "
              f"{init['teacher_gold_score']:.3f}")

    # ---- optimizer, resume, and the sampler (plain or --use_vllm: rlhf/rollouts.py)
    optimizer = common.make_optimizer(model, args)
    scheduler = common.make_scheduler(optimizer, args)
    start_step = checkpoints.maybe_resume(args, model, optimizer, scheduler)  # --resume: 0 if not resuming
    logger = tracking.MetricsLogger(args, start_step, model)  # + each step's time, throughput and MFU
    sampler = rollouts.start(model, tokenizer, args, args.max_completion_length)

    # ---- loop
    pbar = tracking.progress(args, start_step, desc=script)
    final = {}
    for step in pbar:
        # 1. the step's micro-batches: completions sampled by the student (a fraction lmbda) or the dataset's
        sync_metrics = rollouts.load_weights(sampler, model)  # the sampler samples with the current weights
        batches = [micro_batch(sampler, model, world, step, micro)
                   for micro in tracking.within(range(args.gradient_accumulation_steps), "sampling")]
        rollouts.release(sampler)  # the sampler frees what it holds for the update, where it can
        truncated["completions_truncated"] += sum(int(b["truncated"].sum()) for b in batches if b["truncated"] is not None)

        # 2. update: teacher and student distributions on every completion token, the divergence D_t,
        #    summed over the step's tokens and divided by their number (L)
        step_metrics, num_tokens = [], 0
        normaliser = token_normaliser([b["completion_mask"] for b in batches])
        for mb in tracking.within(batches, "update"):
            divergence, entropy = token_divergence(model, teacher, mb, args.beta, args.temperature)  # (B, C)
            loss = divergence.sum() / normaliser  # this micro-batch's part of L
            common.check_finite("loss", loss, step + 1)  # stop before a NaN reaches the weights
            loss.backward()
            step_metrics.append({"loss": loss.detach(), **batch_metrics(mb, divergence.detach(), entropy)})
            num_tokens += int(mb["prompt_mask"].sum()) + int(mb["attention_mask"].sum())
            del divergence, entropy, loss
        memory.log_memory(args.output_dir, model, optimizer, frozen={"teacher model": teacher})  # once, at the first step
        grad_norm = common.optimizer_step(optimizer, args.max_grad_norm, step + 1)  # clip, NaN guard, step, bf16 rounding
        scheduler.step()

        # 3. log (means over the --logging_steps window) and save
        metrics = tracking.window_mean(step_metrics)  # key by key: lengths only where the student sampled
        metrics["loss"] *= len(step_metrics)  # micro-batch losses are parts of one sum
        final = {"final_loss": float(metrics["loss"])}
        logger.update({**metrics, **sync_metrics, "grad_norm": grad_norm}, num_tokens=num_tokens)
        if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
            logger.log(step + 1, {"learning_rate": scheduler.get_last_lr()[0]}, pbar)
            log_completions(args, step + 1, batches[-1])
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoints.save_checkpoint(model, tokenizer, args, f"{args.output_dir}/checkpoint-{step + 1}",
                                        checkpoints.training_state(step + 1, optimizer, scheduler))

    # ---- final save
    logger.close()
    checkpoints.save_final(model, tokenizer, args)
    truncated["completions_truncated"] = round(parallel.all_reduce(float(truncated["completions_truncated"]), "sum"))
    summary = {**init, "peak_memory_bytes": memory.peak_memory_bytes(), **final, **truncated}
    common.end_run(model, tokenizer, args, summary, sampler, "before: {init_gold_score:.3f}, the teacher: {teacher_gold_score:.3f}")


def log_completions(args, step, batch):
    """--log_completions: the last micro-batch's prompts, completions, each one's token-mean
    divergence to the teacher, and whether the student sampled it."""
    tracking.log_completions(args, step, batch["prompts"], batch["texts"], {
        "divergence": batch["row_divergence"], "on_policy": [float(batch["on_policy"])] * len(batch["texts"])})


if __name__ == "__main__":
    main()
