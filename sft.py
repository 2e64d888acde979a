"""sft.py: supervised fine-tuning, the first stage of RLHF (Stiennon et al. 2020, Sec. 3.5).

Maximises log pi(y | x) of demonstration completions y given prompts x; prompt tokens are masked
out of the loss (TRL's `completion_only_loss`). The loss is the mean over the completion tokens of
the optimizer batch (every micro-batch of the step, on every rank), as in TRL. `messages` rows
train on every assistant turn, the user (and other) turns between them masked (TRL's
`assistant_only_loss`).

Departures from the paper and from TRL:
- With no --model, a tiny Qwen2 is built from a config and trained *from scratch* (scratch.py):
  on the embedded TL;DR world (world.py) with its tokenizer (one token per word of its
  vocabulary), which is what the tests and `make demo` run; on any other --dataset (the
  arithmetic and code worlds, a .jsonl) with a character- or word-level tokenizer fitted to the training
  text (--scratch_tokenizer). All are in Qwen2's byte-level layout, which AutoTokenizer loads exactly (scratch.py).
- `messages` rows train on every assistant turn (TRL's assistant_only_loss); the other turns are masked.
- A `tools` column (TRL's): each row's JSON schemas go to the chat template's `tools=` argument,
  as grpo.py --tools renders its prompts; None in a row: no tools listed. On embedded:arith_tools
  the from-scratch tokenizer gets the world's chat template (world_arith.CHAT_TEMPLATE) and is
  fitted to the conversations as it renders them, so it holds every character the template writes.
- --max_length cuts each whole example (prompt and completion, or a whole conversation) at its
  end, as TRL's max_length, instead of the prompt/completion split of --max_prompt_length and
  --max_completion_length; --packing then fills rows of --max_length tokens with several examples
  (best-fit decreasing, TRL's default strategy), the position ids restarting with each example:
  transformers reads the examples' bounds from them (no attention across examples), so the loss
  is that of the same examples unpacked (tests/test_sft.py), with less padding to compute.
  --num_train_epochs (every script's) is the alternative to --max_steps; with --packing it counts
  passes over the packed rows, which hold every example once.
- Log-probs come from sampling.completion_logprobs: the LM head runs on completion positions only,
  in checkpointed chunks, so no (batch, seq, vocab) fp32 tensor is ever built.

Run:
    python sft.py                                   # embedded world, from scratch -> runs/sft
    python sft.py --dataset embedded:arith --hidden_size 128 --num_layers 4 --output_dir runs/sft_arith
    python sft.py --dataset embedded:arith_tools --hidden_size 128 --num_layers 4 --output_dir runs/sft_arith_tools
    python sft.py --model Qwen/Qwen2.5-1.5B --dataset trl-lib/Capybara
    python sft.py --model Qwen/Qwen2.5-1.5B --dataset trl-lib/Capybara --max_length 1024 --packing --num_train_epochs 1
"""

import time
from dataclasses import dataclass, field

import torch

from rlhf import checkpoints
import common
from rlhf import data
from rlhf import memory
from rlhf import parallel
from rlhf import sampling
from worlds import scratch
from rlhf import tracking
from worlds import world
from worlds import world_arith
from common import TrainArgs

# what training the embedded world's tiny policy from scratch needs (common.apply_defaults)
EMBEDDED_DEFAULTS = {"learning_rate": 1e-3, "lr_scheduler_type": "cosine", "warmup_steps": 30, "weight_decay": 0.01,
                     "batch_size": 32, "max_steps": 1000, "num_train_epochs": 0.0}


@dataclass
class Args(TrainArgs):
    # model and data
    model: str = field(default="", metadata={"help": "Hub id or folder; empty: a tiny Qwen2 trained from scratch on --dataset (scratch.py)."})
    max_prompt_length: int = field(default=512, metadata={"help": "Prompts are cut to their last this-many tokens."})
    max_completion_length: int = field(default=256, metadata={"help": "Completions are cut to their first this-many tokens (EOS included)."})
    max_length: int = field(default=0, metadata={"help": "Tokens of a whole example (prompt and completion, or a whole conversation), cut at its end, as TRL's max_length (0: --max_prompt_length and --max_completion_length cut the two apart)."})
    packing: bool = field(default=False, metadata={"help": "Pack several examples into each row of --max_length tokens (TRL's packing, best-fit decreasing), position ids restarting with each example so that none attends to another: the loss of unpacked rows, less padding. --batch_size then counts packed rows."})
    hidden_size: int = field(default=192, metadata={"help": "From-scratch model only (any --dataset): hidden size of the tiny Qwen2."})
    num_layers: int = field(default=2, metadata={"help": "From-scratch model only (any --dataset): number of layers of the tiny Qwen2."})
    scratch_tokenizer: str = field(default="", metadata={"help": "From-scratch model only: char | word, a tokenizer fitted to the training text. Default: the TL;DR world's own byte-level tokenizer on 'embedded' (world.build_tokenizer), char on embedded:arith and embedded:code, word on other datasets."})
    # optimisation (TRL's defaults for a pretrained model; EMBEDDED_DEFAULTS for the from-scratch one)
    num_train_epochs: float = field(default=3.0, metadata={"help": "Passes over --dataset (TRL's 3), which set the number of steps; --max_steps N trains N steps instead."})
    max_steps: int = field(default=1000, metadata={"help": "Optimizer steps (with --num_train_epochs 0 or when passed); cycles through the data as needed."})
    learning_rate: float = field(default=2e-5, metadata={"help": "Peak learning rate (from scratch: 1e-3)."})
    lr_scheduler_type: str = field(default="linear", metadata={"help": "Any transformers scheduler name (from scratch: cosine)."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up steps (from scratch: 30)."})
    batch_size: int = field(default=8, metadata={"help": "Examples per micro-batch (TRL's; from scratch: 32)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (from scratch: 0.01)."})


def sft_loss(logprobs, completion_mask, num_tokens):
    """Negative log-likelihood, mean over trained tokens: -sum_t log pi(y_t|x,y_<t) / #tokens.
    `completion_mask` is the loss mask: 1 on trained tokens (all of a completion; of a
    conversation, its assistant turns).

    `num_tokens` is the token count of the whole optimizer batch (all micro-batches of the step),
    averaged over ranks under torchrun: the micro-batches' losses then sum, and the ranks'
    averaged gradient is the mean over every token of the global batch, exactly what one
    process with the whole batch in one micro-batch computes (TRL's token mean).
    """
    return -(logprobs * completion_mask).sum() / num_tokens.clamp(min=1)


@torch.no_grad()
def evaluate(model, tokenizer, pairs, args, stop_ids):
    """--eval_dataset: the loss (mean NLL over every trained token) on held-out pairs, dropout off,
    encoded as training encodes its rows (the same `stop_ids`: sampling.stop_token_ids)."""
    was_training, device = model.training, common.device()
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(pairs), args.eval_batch_size):
        chunk = pairs[i:i + args.eval_batch_size]
        if args.max_length:  # whole examples cut at --max_length, one per row, as training's
            ids, masks, _ = data.encode_examples(tokenizer, [data.render_prompt(tokenizer, p) for p, _ in chunk],
                                                 [data.render_turns(tokenizer, p, c) for p, c in chunk], args.max_length, stop_ids)
            input_ids, position_ids, _, loss_mask = data.packed_batch([[j] for j in range(len(chunk))], ids, masks,
                                                                      tokenizer.pad_token_id)
            logprobs = sampling.packed_logprobs(model, input_ids.to(device), position_ids.to(device), loss_mask.to(device))
            total -= float((logprobs * loss_mask.to(device)).sum())
            count += int(loss_mask.sum())
            continue
        prompt_ids, prompt_mask = data.encode_prompts(tokenizer, [data.render_prompt(tokenizer, p) for p, _ in chunk],
                                                        args.max_prompt_length)
        completion_ids, completion_mask, loss_mask = data.encode_turns(
            tokenizer, [data.render_turns(tokenizer, p, c) for p, c in chunk], args.max_completion_length, stop_ids)
        logprobs = sampling.completion_logprobs(model, prompt_ids.to(device), prompt_mask.to(device),
                                                completion_ids.to(device), completion_mask.to(device))
        total -= float((logprobs * loss_mask.to(device)).sum())
        count += int(loss_mask.sum())
    model.train(was_training)
    return total / max(count, 1)


def main():
    script = common.script_name()  # a fork (my_grpo.py) prints, and shows its progress, under its own name
    args = common.apply_defaults(common.parse_args(Args), EMBEDDED_DEFAULTS)
    if args.packing and not args.max_length:
        common.fail("--packing fills rows of --max_length tokens: add --max_length (e.g. 1024, TRL's default).")
    if args.max_length and (common.passed("max_prompt_length") or common.passed("max_completion_length")):
        common.fail("--max_length cuts whole examples: drop --max_prompt_length / --max_completion_length (they cut "
                    "prompt and completion apart, without --max_length).")
    if args.estimate_memory:  # what SFT holds: one trained model, no rollouts
        if args.max_length:  # whole examples cut at --max_length (with --packing, rows of it)
            prompt_length, completion_length = 0, args.max_length
        else:  # the widest micro-batch's tokens, from the data
            prompt_length, completion_length = memory.data_lengths(args, script)
        memory.print_plan(args, train_sequences=args.batch_size, prompt_length=prompt_length,
                          completion_length=completion_length)
    parallel.init_distributed()  # under torchrun: join the process group; a no-op otherwise
    common.set_seed(args.seed + parallel.rank())  # rank-offset seeds; the data order comes from batch_indices
    device = common.device()

    # ---- data, then the model and tokenizer (a from-scratch tokenizer is fitted to the data)
    ds = data.training_data(args, script)
    pairs = data.sft_pairs(ds, args.dataset)
    row_tools = list(ds["tools"]) if "tools" in ds.column_names else [None] * len(pairs)  # TRL's `tools` column
    from_scratch = args.model == ""
    if from_scratch and args.use_peft:
        common.fail("--use_peft trains adapters on a pretrained base: pass --model (e.g. runs/sft).")
    if from_scratch:
        common.check_choice("--scratch_tokenizer", args.scratch_tokenizer, ["", "char", "word"])
        # the arithmetic world with a calculator has its own chat template (tool calls and replies)
        template = world_arith.CHAT_TEMPLATE if args.dataset == common.ARITH_TOOLS else None
        if args.dataset == common.EMBEDDED and not args.scratch_tokenizer:
            tokenizer = world.build_tokenizer()  # the world's whole lexicon, not only the words its data uses
        else:  # a tokenizer fitted to the training text: every character, or every word, it contains
            if not template and any(not isinstance(p, str) or not isinstance(c, str) for p, c in pairs):
                common.fail("a from-scratch tokenizer has no chat template: pass prompt/completion as plain text, or --model.")
            texts = [t for pair in pairs for t in pair]
            if template:  # each conversation (with its row's tools) as the template renders it
                from transformers.utils.chat_template_utils import render_jinja_template

                texts = [render_jinja_template([p + c], tools=t, chat_template=template)[0][0]
                         for (p, c), t in zip(pairs, row_tools)]
            level = args.scratch_tokenizer or ("char" if args.dataset.startswith(common.ARITH) or args.dataset == common.CODE else "word")
            tokenizer = scratch.fit_tokenizer(texts, level)
            tokenizer.chat_template = template
        model = scratch.build_model(tokenizer, args.hidden_size, args.num_layers, args.seed,
                                    texts=texts if template else [p + c for p, c in pairs])
        model = model.to(device=device, dtype=common.torch_dtype(args.dtype))
        if args.gradient_checkpointing:
            common.enable_checkpointing(model)
    else:
        tokenizer = common.load_tokenizer(args.model, args.trust_remote_code)
        with_tools = next((i for i, t in enumerate(row_tools) if t), None)  # a row whose `tools` the template must show
        if with_tools is not None:
            data.check_renders_tools(tokenizer, pairs[with_tools][0], row_tools[with_tools], "the dataset's 'tools' column")
        model = common.load_model(args.model, args, adapters=True)  # --use_peft: LoRA adapters on a frozen base
    common.disable_dropout(model).train()  # dropout off by zeroing it (TRL's disable_dropout), training mode
    stop_ids = sampling.stop_token_ids(model, tokenizer)  # a completion already ending in one gets no extra EOS
    model = parallel.distribute(model, args)  # --parallel ddp | fsdp2 under torchrun

    # ---- the (prompt, completion) pairs rendered to text
    prompts = [data.render_prompt(tokenizer, p, t) for (p, _), t in zip(pairs, row_tools)]
    turns = [data.render_turns(tokenizer, p, c, t) for (p, c), t in zip(pairs, row_tools)]  # [(text, trained), ...] per example
    completions = ["".join(t for t, _ in segments) for segments in turns]
    data.check_readable(tokenizer, [p + c for p, c in zip(prompts, completions)], args.model, args.dataset)
    eval_ds = data.eval_data(args)
    eval_pairs = data.sft_pairs(eval_ds, args.eval_dataset) if eval_ds is not None else None
    # --max_length: whole examples as token lists (cut at max_length), in rows of one, or packed
    rows = None
    if args.max_length:
        example_ids, example_masks, cut = data.encode_examples(tokenizer, prompts, turns, args.max_length, stop_ids,
                                                               args.dataset)
        lengths = [len(ids) for ids in example_ids]
        rows = data.pack(lengths, args.max_length) if args.packing else [[i] for i in range(len(pairs))]
        truncated = {"examples_truncated": cut}
        if args.packing:
            print(f"{script}: --packing: {len(pairs)} examples in {len(rows)} rows of --max_length {args.max_length} "
                  f"({sum(lengths) / (len(rows) * args.max_length):.0%} full)")
    data.set_max_steps(args, len(rows or pairs), args.batch_size * args.gradient_accumulation_steps * parallel.world_size())
    print(f"{script}: {len(pairs)} examples from {data.dataset_name(args.dataset)}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, device {device}")
    # out-of-range inputs are counted up front: long texts are cut (prompts keep their end)
    if args.max_length and truncated["examples_truncated"]:
        print(f"{script}: {truncated['examples_truncated']} examples longer than --max_length {args.max_length} are cut "
              "(their end, EOS included, is not learned)")
    if not args.max_length:
        truncated = {"prompts_truncated": data.count_truncated(tokenizer, prompts, args.max_prompt_length),
                     "completions_truncated": data.count_truncated(tokenizer, turns, args.max_completion_length, stop_ids)}
    if not args.max_length and any(truncated.values()):
        print(f"{script}: {truncated['prompts_truncated']} prompts longer than --max_prompt_length {args.max_prompt_length} "
              f"keep their last tokens; {truncated['completions_truncated']} completions longer than "
              f"--max_completion_length {args.max_completion_length} are cut (their EOS is not learned)")
    global_batch = args.batch_size * parallel.world_size()
    num_rows = len(rows or pairs)  # what a batch draws: examples, or packed rows of them
    if num_rows < global_batch:  # allowed: batch_indices cycles, so a batch repeats examples
        print(f"{script}: note: {num_rows} {'rows' if rows else 'examples'} are fewer than one batch of {global_batch}; "
              "batches repeat them")

    init = {}
    if args.dataset == common.EMBEDDED and from_scratch:  # the floor the policy must rise from
        init = {"init_gold_score": common.gold_eval(model, tokenizer, args)["gold_score"]}
        print(f"{script}: random-init gold score {init['init_gold_score']:.3f}")

    # ---- optimizer
    optimizer = common.make_optimizer(model, args)
    scheduler = common.make_scheduler(optimizer, args)
    start_step = checkpoints.maybe_resume(args, model, optimizer, scheduler)  # --resume: 0 if not resuming
    logger = tracking.MetricsLogger(args, start_step, model)  # + each step's time, throughput and MFU

    # ---- loop
    pbar = tracking.progress(args, start_step, desc=script)
    start = time.time()
    losses, eval_metrics = [], {}  # stay empty when resuming a run that had already finished
    for step in pbar:
        batches = []
        for micro in range(args.gradient_accumulation_steps):
            # this rank's slice of the global micro-batch; the step is the position in the data
            idx = parallel.shard(data.batch_indices(num_rows, global_batch, args.seed,
                                                    step * args.gradient_accumulation_steps + micro))
            if rows:  # whole examples, one or several per row: (B, T) ids, position ids, loss mask
                batches.append([t.to(device) for t in data.packed_batch([rows[i] for i in idx], example_ids, example_masks,
                                                                         tokenizer.pad_token_id)])
                continue
            prompt_ids, prompt_mask = data.encode_prompts(tokenizer, [prompts[i] for i in idx], args.max_prompt_length)
            completion_ids, completion_mask, loss_mask = data.encode_turns(
                tokenizer, [turns[i] for i in idx], args.max_completion_length, stop_ids)
            batches.append([t.to(device) for t in (prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask)])
        # one token mean over the optimizer batch (every micro-batch, every rank; see sft_loss)
        rank_tokens = parallel.all_reduce(sum(b[-1].sum() for b in batches).float())
        losses, n_tokens = [], 0
        for batch in batches:
            if rows:
                input_ids, position_ids, real, loss_mask = batch
                logprobs = sampling.packed_logprobs(model, input_ids, position_ids, loss_mask)  # (B, T)
                n_tokens += int(real.sum())  # this rank's input tokens (TRL's num_tokens)
            else:
                prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask = batch
                logprobs = sampling.completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)  # (B, C)
                n_tokens += int(prompt_mask.sum() + completion_mask.sum())  # this rank's input tokens (TRL's num_tokens)
            loss = sft_loss(logprobs, loss_mask, rank_tokens)  # this micro-batch's part of the step's loss
            common.check_finite("loss", loss, step + 1)  # stop on NaN/inf before it reaches the weights
            loss.backward()
            losses.append(loss.detach())
        memory.log_memory(args.output_dir, model, optimizer)  # memory.json, once, at the first full step
        grad_norm = common.optimizer_step(optimizer, args.max_grad_norm, step + 1)  # clip, NaN guard, step, bf16 rounding
        scheduler.step()

        # ---- log (means over the --logging_steps window), evaluate and save
        logger.update({"loss": torch.stack(losses).sum(), "grad_norm": grad_norm}, num_tokens=n_tokens)  # parts of one mean
        if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
            logger.log(step + 1, {"learning_rate": scheduler.get_last_lr()[0]}, pbar)
        if eval_pairs and ((args.eval_steps and (step + 1) % args.eval_steps == 0) or step + 1 == args.max_steps):
            eval_metrics = {"eval_loss": evaluate(model, tokenizer, eval_pairs, args, stop_ids)}
            logger.log_eval(step + 1, eval_metrics)
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoints.save_checkpoint(model, tokenizer, args, f"{args.output_dir}/checkpoint-{step + 1}",
                                   checkpoints.training_state(step + 1, optimizer, scheduler))

    train_seconds = time.time() - start

    # ---- final save and evaluation
    logger.close()
    checkpoints.save_final(model, tokenizer, args)
    summary = {"final_loss": parallel.all_reduce(torch.stack(losses).sum()).item() if losses else None,
               "train_seconds": train_seconds, "seconds_per_step": train_seconds / max(args.max_steps - start_step, 1),
               **truncated, **init, **eval_metrics}
    if args.dataset == common.EMBEDDED:
        ev = common.gold_eval(model, tokenizer, args)
        summary.update(ev, **world.world_stats(common.embedded_world(args.seed)))
        print(f"{script}: test gold score {ev['gold_score']:.3f} (references {summary['reference_gold']:.3f}, "
              f"demonstrations {summary['demo_gold']:.3f}); e.g. {ev['samples'][0]!r}")
    summary.update(tracking.divergence(args.output_dir))  # a loss that blew up: said, and not a success
    checkpoints.finish_run(args, summary)  # summary.json, then the lock goes
    print(f"{script}: {train_seconds:.0f} s of training; {checkpoints.saved_where(args)}")


if __name__ == "__main__":
    main()
