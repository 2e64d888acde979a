"""kto.py: Kahneman-Tversky Optimization (Ethayarajh et al. 2024) from unpaired feedback: each
row is one completion with a thumbs-up or thumbs-down (TRL's `prompt`, `completion`, `label`),
not a pair. Recipes and evidence: docs/kto.md.

The implicit reward is DPO's, r(x, y) = log pi(y|x) - log ref(y|x) with log pi the *sum* of the
completion's token log-probs. KTO's value function weighs it against a reference point z0, the
policy's KL to the reference, estimated on mismatched pairs: each prompt of the micro-batch with
the completion of the row before it (TRL's rotation by one), detached and floored at 0:

    z0   = max(0, mean_j [log pi(y'_j | x_j) - log ref(y'_j | x_j)])          (y'_j = y_{j-1}; TRL's estimate)
    L_i  = lambda_D (1 - sigmoid(beta (r(x_i, y_i) - z0)))   for a desirable y_i  (KTO, Eq. 7)
           lambda_U (1 - sigmoid(beta (z0 - r(x_i, y_i))))   for an undesirable y_i
    L    = mean_i L_i

lambda_D, lambda_U are --desirable_weight and --undesirable_weight: the paper advises
lambda_D n_D / (lambda_U n_U) in [1, 4/3] (n_D, n_U: desirable and undesirable rows), and
kto.py prints that ratio.

Memory: as dpo.py, the reference is the initial policy; with --precompute_ref_logps (on by
default) its log-probs of every row and of every row's mismatched pair are computed once before
training, so training holds one model.

Departures from the paper and from TRL:
- The mismatched pairs are fixed for the run, as in TRL (which precomputes them in dataset order):
  the rows are split once into blocks of --batch_size (a seeded permutation, the last block
  filled from the start), each micro-batch is one block, and within it y'_j = y_{j-1}. Each
  epoch visits the blocks in a new order; TRL's default sampler keeps the dataset's order.
- Preference pairs (prompt, chosen, rejected) are accepted and unpaired as TRL does: chosen rows
  desirable, rejected rows undesirable. The embedded world's pairs arrive this way.
- No held-out evaluation during training (--eval_dataset is refused): eval.py scores the saved
  policy. On the embedded world the gold score is printed before and after, as dpo.py does.
"""

from dataclasses import dataclass, field

import torch

from rlhf import checkpoints
import common
from rlhf import data
from rlhf import lora
from rlhf import memory
from rlhf import parallel
from rlhf import sampling
from rlhf import tracking
from common import TrainArgs


@dataclass
class Args(TrainArgs):
    # model and data
    max_prompt_length: int = field(default=512, metadata={"help": "Prompts are cut to their last this-many tokens."})
    max_completion_length: int = field(default=256, metadata={"help": "Completions are cut to their first this-many tokens (EOS included)."})
    # algorithm
    beta: float = field(default=0.1, metadata={"help": "KL strength: the implicit reward is log pi/ref, scaled by beta in the sigmoid (Eq. 7; TRL's default)."})
    desirable_weight: float = field(default=1.0, metadata={"help": "lambda_D: the weight of a desirable row's loss."})
    undesirable_weight: float = field(default=1.0, metadata={"help": "lambda_U: the weight of an undesirable row's loss."})
    precompute_ref_logps: bool = field(default=True, metadata={"help": "Compute the reference log-probs (rows and their mismatched pairs) once before training, so training holds one model."})
    # optimisation
    max_steps: int = field(default=250, metadata={"help": "Optimizer steps; cycles through the blocks as needed."})
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (TRL's default)."})
    lr_scheduler_type: str = field(default="linear", metadata={"help": "Any transformers scheduler name."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up steps (TRL's default)."})
    batch_size: int = field(default=8, metadata={"help": "Rows per micro-batch (at least 2: the KL point needs mismatched pairs)."})


# the values tuned for the embedded world's tiny policy (common.apply_defaults; docs/kto.md)
EMBEDDED_DEFAULTS = {"learning_rate": 1e-5, "max_steps": 250, "batch_size": 32, "warmup_steps": 5}


def validate(args):
    """The checks main() needs before anything loads."""
    if args.beta <= 0:
        common.fail(f"--beta must be positive, got {args.beta}.")
    if args.desirable_weight <= 0 or args.undesirable_weight <= 0:
        common.fail("--desirable_weight and --undesirable_weight must be positive.")
    if args.batch_size < 2:
        common.fail(f"--batch_size {args.batch_size}: the KL reference point pairs each prompt with another row's "
                    "completion, so a micro-batch needs at least 2 rows.")
    if args.eval_dataset:
        common.fail("kto.py has no held-out evaluation during training: drop --eval_dataset and score the saved "
                    "policy with eval.py.")
    return args


def print_memory_plan(args):
    """--estimate_memory: what KTO holds (the policy, a reference unless precomputed); each row is
    read twice, with its own completion and with its mismatched pair's."""
    unpaired = "label" in data.training_data(args, "prefs").column_names  # prompt/completion rows read as SFT's
    memory.print_plan(args, reference=True if not args.precompute_ref_logps else "log-probs precomputed (--precompute_ref_logps)",
                      reward_models=[], reward_note="implicit in KTO", train_sequences=2 * args.batch_size,
                      train_prompts=args.batch_size, generation_sequences=0,
                      **dict(zip(["prompt_length", "completion_length"],
                                 memory.data_lengths(args, "sft" if unpaired else "prefs", "data"))))


# ------------------------------------------------------------------------ the KTO loss
def kto_loss(logps, ref_logps, kl_logps, ref_kl_logps, labels, beta, desirable_weight=1.0, undesirable_weight=1.0):
    """Per-row losses, implicit rewards and the reference point; all inputs (B,): sequence
    log-probs of the rows (logps, ref_logps) and of their mismatched pairs (kl_logps,
    ref_kl_logps), labels True for desirable rows.

    Returns (losses (B,), rewards (B,) detached, z0 (a scalar, detached))."""
    # z0, Eq. 7's reference point: the KL estimate on mismatched pairs, mean over every rank, floored at 0, no gradient
    z0 = parallel.all_reduce((kl_logps - ref_kl_logps).mean().detach()).clamp(min=0)
    logratios = logps - ref_logps  # (B,) r(x, y) / beta
    # Eq. 7: a desirable row gains when its reward rises above z0; an undesirable one when it falls below
    desirable = desirable_weight * (1 - torch.sigmoid(beta * (logratios - z0)))
    undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratios)))
    losses = torch.where(labels, desirable, undesirable)  # (B,)
    return losses, beta * logratios.detach(), z0


def row_logps(model, batch):
    """log pi(y|x) of each row's completion and of its mismatched pair in one forward: prompts
    (B, P), completions (B, C) and their mismatched completions (B, C). Returns (logps,
    kl_logps), each (B,). The rows go in as y_0, y'_0, y_1, y'_1, ..., so each prompt is encoded
    once for both (sampling.completion_logprobs shares it)."""
    B = batch["prompt_ids"].shape[0]
    completion_ids = torch.stack([batch["completion_ids"], batch["kl_completion_ids"]], 1).flatten(0, 1)  # (2B, C)
    completion_mask = torch.stack([batch["completion_mask"], batch["kl_completion_mask"]], 1).flatten(0, 1)
    logprobs = sampling.completion_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                            completion_ids, completion_mask)  # (2B, C)
    logps = logprobs.sum(1).view(B, 2)  # sequence log-prob = sum of per-token log-probs
    return logps[:, 0], logps[:, 1]


# ------------------------------------------------------------------------ data
def unpaired_rows(ds, spec):
    """(prompt, completion, label) rows: TRL's unpaired format as it is, or preference pairs
    unpaired as TRL does (chosen: True, rejected: False)."""
    if "label" in ds.column_names:
        data.require_columns(ds, ["prompt", "completion", "label"], spec, "Unpaired data needs prompt + completion + label.")
        data.check_text(ds, ["prompt", "completion"], spec)
        bad = [i for i, v in enumerate(ds["label"]) if not isinstance(v, bool)]
        if bad:
            common.fail(f"{data.dataset_name(spec)}, row {bad[0]}: 'label' must be true or false (a thumbs up or down), "
                        f"got {ds['label'][bad[0]]!r}.")
        return list(zip(ds["prompt"], ds["completion"], ds["label"]))
    triples = data.preference_triples(ds, spec)
    return [row for p, c, r in triples for row in ((p, c, True), (p, r, False))]


def kl_blocks(n, batch_size, seed):
    """The run's fixed micro-batches: a seeded permutation of the n rows cut into blocks of
    `batch_size` (the last filled from the start). Each row's mismatched completion is that of the
    row before it in its block (TRL's rotation), so reference log-probs of the pairs can be
    precomputed. (num_blocks, batch_size) row indices."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    num_blocks = -(-n // batch_size)
    rows = (perm * (-(-num_blocks * batch_size // n)))[:num_blocks * batch_size]
    return torch.tensor(rows).view(num_blocks, batch_size)


def encode_rows(tokenizer, texts, block, args, stop_ids):
    """Token ids and masks of this rank's rows of a block of the rendered (prompt, completion,
    label) texts, with each row's mismatched completion (the whole block's completions rotated by
    one, y'_j = y_{j-1}, then sharded like the rows: N ranks pair what one rank would), on the device."""
    prompts, completions, labels = texts
    pairs = parallel.shard([block[-1]] + block[:-1])  # TRL's rotation: (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})
    rows = parallel.shard(block)
    prompt_ids, prompt_mask = data.encode_prompts(tokenizer, [prompts[i] for i in rows], args.max_prompt_length)  # (B, P)
    completion_ids, completion_mask = data.encode_completions(
        tokenizer, [completions[i] for i in rows] + [completions[i] for i in pairs], args.max_completion_length, stop_ids)
    B, dev = len(rows), common.device()
    return {"prompt_ids": prompt_ids.to(dev), "prompt_mask": prompt_mask.to(dev),
            "completion_ids": completion_ids[:B].to(dev), "completion_mask": completion_mask[:B].to(dev),
            "kl_completion_ids": completion_ids[B:].to(dev), "kl_completion_mask": completion_mask[B:].to(dev),
            "labels": torch.tensor([labels[i] for i in rows], device=dev)}


@torch.no_grad()
def precompute_ref_logps(model, tokenizer, texts, blocks, args, stop_ids):
    """One pass of the (still untrained, hence reference) model over every block: (num_blocks, B, 2)
    of (ref_logps, ref_kl_logps) for this rank's rows, on the CPU. With --use_peft: its base,
    adapters off."""
    was_training = model.training
    model.eval()  # the reference runs without dropout, as a frozen copy would
    out = []
    with lora.adapters_off(model):
        for block in blocks:
            batch = encode_rows(tokenizer, texts, block.tolist(), args, stop_ids)
            out.append(torch.stack(row_logps(model, batch), 1).cpu())  # (B, 2)
    model.train(was_training)
    return torch.stack(out)


@torch.no_grad()
def reference_logps(ref_cache, ref_model, block, batch):
    """(ref_logps, ref_kl_logps), each (B,): from the precomputed cache, or a forward of the frozen
    reference (with --use_peft: the policy with its adapters off)."""
    if ref_cache is not None:
        return ref_cache[block].to(common.device()).unbind(1)
    with lora.adapters_off(ref_model):
        return row_logps(ref_model, batch)


def render_rows(tokenizer, rows):
    """(prompt, completion, label) rows -> prompt texts, completion texts and labels, through the
    chat template."""
    return ([data.render_prompt(tokenizer, p) for p, _, _ in rows],
            [data.render_completion(tokenizer, p, c) for p, c, _ in rows], [bool(label) for _, _, label in rows])


def row_metrics(loss, rewards, logps, labels, z0):
    """TRL's KTO metrics of one micro-batch: the loss, kl (z0), and the mean reward and log-prob
    of its desirable (chosen) and undesirable (rejected) rows."""
    metrics = {"loss": loss.detach(), "kl": z0}
    for name, rows in (("chosen", labels), ("rejected", ~labels)):
        if rows.any():
            metrics[f"rewards/{name}"] = rewards[rows].mean()
            metrics[f"logps/{name}"] = logps.detach()[rows].mean()
    if labels.any() and (~labels).any():
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics


# ------------------------------------------------------------------------ main
def main():
    script = common.script_name()  # a fork (my_kto.py) prints, and shows its progress, under its own name
    args = common.apply_defaults(common.parse_args(Args), EMBEDDED_DEFAULTS)
    if args.estimate_memory:
        print_memory_plan(args)
    validate(args)  # after the plan, which reads only config.json and exits
    parallel.init_distributed()  # under torchrun: join the process group; a no-op otherwise
    common.set_seed(args.seed + parallel.rank())
    device = common.device()
    embedded = args.dataset == common.EMBEDDED

    # ---- model and tokenizer (the policy starts as the reference; --use_peft: LoRA adapters on a frozen base)
    tokenizer = common.load_tokenizer(args.model, args.trust_remote_code)
    model = common.load_model(args.model, args, adapters=True)
    common.disable_dropout(model).train()  # dropout off by zeroing it (TRL's disable_dropout), training mode
    stop_ids = sampling.stop_token_ids(model, tokenizer)  # a completion already ending in one gets no extra EOS
    model = parallel.distribute(model, args)  # --parallel ddp | fsdp2 under torchrun

    # ---- data: rendered (prompt, completion, label) rows, cut once into the run's fixed blocks
    rows = unpaired_rows(data.training_data(args, "prefs"), args.dataset)
    texts = render_rows(tokenizer, rows)
    data.check_readable(tokenizer, [p + c for p, c in zip(texts[0], texts[1])], args.model, args.dataset)
    truncated = data.truncation_counts(tokenizer, texts[0], texts[1], args, script, stop_ids)
    blocks = kl_blocks(len(rows), args.batch_size * parallel.world_size(), args.seed)  # (num_blocks, B * ranks)
    data.set_max_steps(args, len(rows), args.batch_size * args.gradient_accumulation_steps * parallel.world_size())
    n_desirable = sum(texts[2])
    balance = args.desirable_weight * n_desirable / max(args.undesirable_weight * (len(rows) - n_desirable), 1e-9)
    print(f"{script}: {len(rows)} rows ({n_desirable} desirable) from {data.dataset_name(args.dataset)}, "
          f"lambda_D n_D / (lambda_U n_U) = {balance:.3f} (the paper advises [1, 4/3]), "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, beta {args.beta}, device {device}")

    # ---- the reference: precomputed log-probs (one model), a frozen copy, or with --use_peft the base
    ref_model, ref_cache = None, None
    if args.precompute_ref_logps:
        ref_cache = precompute_ref_logps(model, tokenizer, texts, blocks, args, stop_ids)  # (num_blocks, B, 2)
    else:
        ref_model = common.reference_of(model, args)
    init = {}
    if embedded:
        init["init_gold_score"] = common.gold_eval(model, tokenizer, args)["gold_score"]
        print(f"{script}: gold score before training {init['init_gold_score']:.3f}")

    # ---- optimizer, resume
    optimizer = common.make_optimizer(model, args)
    scheduler = common.make_scheduler(optimizer, args)
    start_step = checkpoints.maybe_resume(args, model, optimizer, scheduler)  # --resume: 0 if not resuming
    logger = tracking.MetricsLogger(args, start_step, model)  # + each step's time, throughput and MFU
    frozen = {"reference model": None if ref_model is model else ref_model, "reward model": None}

    # ---- loop
    pbar = tracking.progress(args, start_step, desc=script)
    final = {}  # the last step's training loss and margin
    for step in pbar:
        step_metrics, num_tokens = [], 0
        for micro in range(args.gradient_accumulation_steps):
            # 1. the batch: one of the run's blocks (a new order each epoch), this rank's rows, their mismatched pairs
            block = data.batch_indices(len(blocks), 1, args.seed, step * args.gradient_accumulation_steps + micro)[0]
            batch = encode_rows(tokenizer, texts, blocks[block].tolist(), args, stop_ids)
            # 2. reference log-probs: from the cache, or a forward of the frozen reference
            ref_logps, ref_kl_logps = reference_logps(ref_cache, ref_model, block, batch)  # (B,), (B,)
            # 3. policy log-probs and the KTO loss (Eq. 7), mean over rows
            logps, kl_logps = row_logps(model, batch)  # (B,), (B,)
            losses, rewards, z0 = kto_loss(logps, ref_logps, kl_logps, ref_kl_logps, batch["labels"], args.beta,
                                           args.desirable_weight, args.undesirable_weight)
            loss = losses.mean()
            common.check_finite("loss", loss, step + 1)  # stop on NaN/inf before it reaches the weights
            (loss / args.gradient_accumulation_steps).backward()
            num_tokens += int(batch["prompt_mask"].sum()) + int(batch["completion_mask"].sum())
            step_metrics.append(row_metrics(loss, rewards, logps, batch["labels"], z0))
        memory.log_memory(args.output_dir, model, optimizer, frozen=frozen)  # memory.json, once, at the first full step
        grad_norm = common.optimizer_step(optimizer, args.max_grad_norm, step + 1)  # clip, NaN guard, step, bf16 rounding
        scheduler.step()

        # 4. log (means over the --logging_steps window) and save
        metrics = tracking.mean_metrics(step_metrics)
        final = {f"final_{k}": float(metrics[k]) for k in ("loss", "kl", "rewards/margins") if k in metrics}
        logger.update({**metrics, "grad_norm": grad_norm}, num_tokens=num_tokens)
        if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
            logger.log(step + 1, {"learning_rate": scheduler.get_last_lr()[0]}, pbar)
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoints.save_checkpoint(model, tokenizer, args, f"{args.output_dir}/checkpoint-{step + 1}",
                                        checkpoints.training_state(step + 1, optimizer, scheduler))

    # ---- final save
    logger.close()
    checkpoints.save_final(model, tokenizer, args)
    summary = {**init, "models_alive": 1 + (ref_model is not None and ref_model is not model),
               "peak_memory_bytes": memory.peak_memory_bytes(), **final, **truncated}
    common.end_run(model, tokenizer, args, summary, before="before: {init_gold_score:.3f}")


if __name__ == "__main__":
    main()
