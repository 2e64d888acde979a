"""sft.py: supervised fine-tuning, the first stage of RLHF (Stiennon et al. 2020, Sec. 3.5).

Maximises log pi(y | x) of demonstration completions y given prompts x; prompt tokens are masked
out of the loss (TRL's `completion_only_loss`). The loss is the mean over completion tokens of
the micro-batch, as in TRL.

Departures from the paper and from TRL:
- With no --model, a tiny Qwen2 is built from a config and trained *from scratch* on the
  embedded TL;DR world (world.py); this is what the tests and `make demo` run.
- `messages` rows train on the last assistant turn only (everything before it is the prompt).
- Log-probs come from sampling.completion_logprobs: the LM head runs on completion positions only,
  in checkpointed chunks, so no (batch, seq, vocab) fp32 tensor is ever built.

Run:
    python sft.py                                   # embedded world, from scratch -> runs/sft
    python sft.py --model Qwen/Qwen2.5-1.5B --dataset trl-lib/Capybara --learning_rate 2e-5
"""

from dataclasses import dataclass, field

import torch

import common
import memory
import parallel
import sampling
import world
from common import TrainArgs


@dataclass
class Args(TrainArgs):
    # model and data
    model: str = field(default="", metadata={"help": "Hub id or folder; empty: a tiny Qwen2 trained from scratch on the embedded world."})
    max_prompt_length: int = field(default=512, metadata={"help": "Prompts are cut to their last this-many tokens."})
    max_completion_length: int = field(default=256, metadata={"help": "Completions are cut to their first this-many tokens (EOS included)."})
    hidden_size: int = field(default=192, metadata={"help": "From-scratch model only: hidden size of the tiny Qwen2."})
    num_layers: int = field(default=2, metadata={"help": "From-scratch model only: number of layers of the tiny Qwen2."})
    # optimisation (defaults train the tiny model from scratch; use ~2e-5 for a pretrained one)
    max_steps: int = field(default=1000, metadata={"help": "Optimizer steps; cycles through the data as needed."})
    learning_rate: float = field(default=1e-3, metadata={"help": "Peak learning rate (1e-3 suits the from-scratch model; ~2e-5 a pretrained one)."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Any transformers scheduler name."})
    warmup_steps: int = field(default=30, metadata={"help": "Linear warm-up steps."})
    batch_size: int = field(default=32, metadata={"help": "Examples per micro-batch."})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay."})


def sft_loss(logprobs, completion_mask, num_tokens):
    """Negative log-likelihood, mean over completion tokens: -sum_t log pi(y_t|x,y_<t) / #tokens.

    `num_tokens` is this micro-batch's token count, averaged over ranks under torchrun: the
    ranks' averaged loss (and gradient) is then the mean over every token of the global batch,
    exactly what one process with the whole batch computes.
    """
    return -(logprobs * completion_mask).sum() / num_tokens.clamp(min=1)


def main():
    args = common.parse_args(Args)
    if args.estimate_memory:  # what SFT holds: one trained model, no rollouts
        memory.print_plan(args, train_sequences=args.batch_size, prompt_length=args.max_prompt_length,
                          completion_length=args.max_completion_length)
    parallel.init_distributed()  # under torchrun: join the process group; a no-op otherwise
    common.set_seed(args.seed + parallel.rank())  # rank-offset seeds; the data order comes from batch_indices
    device = common.device()

    # ---- model and tokenizer
    from_scratch = args.model == ""
    if from_scratch:
        if args.dataset != common.EMBEDDED:
            common.fail("a model trained from scratch only knows the embedded world's words; pass --model with --dataset.")
        tokenizer = world.build_tokenizer()
        model = world.build_model(tokenizer, args.hidden_size, args.num_layers, args.seed)
        model = model.to(device=device, dtype=common.torch_dtype(args.dtype))
        if args.gradient_checkpointing:
            common.enable_checkpointing(model)
    else:
        tokenizer = common.load_tokenizer(args.model, args.trust_remote_code)
        model = common.load_model(args.model, args)
    model.train()
    model = parallel.distribute(model, args)  # --parallel ddp | fsdp2 under torchrun

    # ---- data: (prompt, completion) pairs rendered to text
    ds = common.training_data(args, "sft")
    pairs = common.sft_pairs(ds, args.dataset)
    prompts = [common.render_prompt(tokenizer, p) for p, _ in pairs]
    completions = [common.render_completion(tokenizer, p, c) for p, c in pairs]
    print(f"sft: {len(pairs)} examples from {common.dataset_name(args.dataset)}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, device {device}")
    # out-of-range inputs are counted up front: long texts are cut (prompts keep their end)
    truncated = {"prompts_truncated": common.count_truncated(tokenizer, prompts, args.max_prompt_length),
                 "completions_truncated": common.count_truncated(tokenizer, completions, args.max_completion_length, True)}
    if any(truncated.values()):
        print(f"sft: {truncated['prompts_truncated']} prompts longer than --max_prompt_length {args.max_prompt_length} "
              f"keep their last tokens; {truncated['completions_truncated']} completions longer than "
              f"--max_completion_length {args.max_completion_length} are cut (their EOS is not learned)")
    global_batch = args.batch_size * parallel.world_size()
    if len(pairs) < global_batch:  # allowed: batch_indices cycles, so a batch repeats examples
        print(f"sft: note: {len(pairs)} examples are fewer than one batch of {global_batch}; batches repeat examples")

    init = {}
    if args.dataset == common.EMBEDDED and from_scratch:  # the floor the policy must rise from
        init = {"init_gold_score": common.gold_eval(model, tokenizer, args)["gold_score"]}
        print(f"sft: random-init gold score {init['init_gold_score']:.3f}")

    # ---- optimizer
    optimizer = common.make_optimizer(model, args)
    scheduler = common.make_scheduler(optimizer, args)
    start_step = common.maybe_resume(args, model, optimizer, scheduler)  # --resume: 0 if not resuming
    logger = common.MetricsLogger(args, start_step)

    # ---- loop
    pbar = common.progress(args, start_step, desc="sft")
    losses = []  # stays empty when resuming a run that had already finished
    for step in pbar:
        losses, n_tokens = [], 0
        for micro in range(args.gradient_accumulation_steps):
            # this rank's slice of the global micro-batch; the step is the position in the data
            idx = parallel.shard(common.batch_indices(len(pairs), global_batch, args.seed,
                                                    step * args.gradient_accumulation_steps + micro))
            prompt_ids, prompt_mask = common.encode_prompts(tokenizer, [prompts[i] for i in idx], args.max_prompt_length)
            completion_ids, completion_mask = common.encode_completions(
                tokenizer, [completions[i] for i in idx], args.max_completion_length)
            prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
            completion_ids, completion_mask = completion_ids.to(device), completion_mask.to(device)

            logprobs = sampling.completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)  # (B, C)
            rank_tokens = parallel.all_reduce(completion_mask.sum().float())  # mean over ranks (see sft_loss)
            loss = sft_loss(logprobs, completion_mask, rank_tokens)
            common.check_finite("loss", loss, step + 1)  # stop on NaN/inf before it reaches the weights
            (loss / args.gradient_accumulation_steps).backward()
            losses.append(loss.detach())
            n_tokens += round(float(rank_tokens) * parallel.world_size())
        memory.log_memory(args.output_dir, model, optimizer)  # memory.json, once, at the first full step
        grad_norm = common.optimizer_step(optimizer, args.max_grad_norm, step + 1)  # stops on a NaN/inf gradient
        scheduler.step()

        # ---- log and save
        if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
            logger.log(step + 1, {"loss": torch.stack(losses).mean(), "grad_norm": grad_norm,
                                  "learning_rate": scheduler.get_last_lr()[0], "num_tokens": n_tokens}, pbar)
        if args.save_steps and (step + 1) % args.save_steps == 0:
            common.save_checkpoint(model, tokenizer, args, f"{args.output_dir}/checkpoint-{step + 1}",
                                   common.training_state(step + 1, optimizer, scheduler))

    # ---- final save and evaluation
    logger.close()
    common.save_final(model, tokenizer, args)
    summary = {"final_loss": parallel.all_reduce(torch.stack(losses).mean()).item() if losses else None,
               **truncated, **init}
    if args.dataset == common.EMBEDDED:
        ev = common.gold_eval(model, tokenizer, args)
        summary.update(ev, **world.world_stats(common.embedded_world(args.seed)))
        print(f"sft: test gold score {ev['gold_score']:.3f} (references {summary['reference_gold']:.3f}, "
              f"demonstrations {summary['demo_gold']:.3f}); e.g. {ev['samples'][0]!r}")
    common.write_json(f"{args.output_dir}/summary.json", summary)
    print(f"sft: saved to {args.output_dir}")


if __name__ == "__main__":
    main()
