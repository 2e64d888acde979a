"""reward.py: a reward model from preference pairs, the second stage of RLHF
(Stiennon et al. 2020, Sec. 3.5; Ouyang et al. 2022, Sec. 3.5).

R_psi(x, y) is the policy's transformer with a scalar head (`AutoModelForSequenceClassification`,
num_labels=1), read at the last non-pad token. It is trained with the Bradley-Terry loss

    loss = -log sigmoid(R_psi(x, y_w) - R_psi(x, y_l))            (Stiennon et al. 2020, Eq. 1)

on pairs where the labeller preferred y_w (chosen) over y_l (rejected).

Departures from the paper and from TRL's RewardTrainer:
- No reward normalisation inside the model (Stiennon et al. add a bias so references score 0).
  Instead the mean score on the chosen responses of the training pairs is stored as
  `reward_mean` in summary.json and in the saved config, and ppo.py / grpo.py subtract it.
- A held-out part of the pairs (--test_size) gives the test accuracy; on the embedded world,
  summary.json also gives the label-noise ceiling (how often the gold judge itself agrees with
  the noisy labels), which no reward model can beat on average, and the test accuracy against
  the gold judge's own preference (`test_gold_accuracy`), which it can.
- Chosen and rejected share their prompt's pass: each prompt goes through the model once and both
  responses read it (its key/value cache, or on a CPU one row with a block mask; TRL runs 2B whole
  sequences); the scores are the same.
- `--expand_layers N` (embedded world: 1) adds N decoder layers on top of the policy's trunk,
  initialised so that the model starts as the trunk (block expansion, `expand_layers`); the
  papers initialise the reward model from the SFT policy as it is.

Run:
    python reward.py                                # runs/sft + embedded prefs -> runs/reward
    python reward.py --model Qwen/Qwen2.5-1.5B --dataset trl-lib/ultrafeedback_binarized \\
        --max_steps 2000
    torchrun --nproc_per_node 2 reward.py ...       # each rank scores its own pairs (--parallel ddp | fsdp2)
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rlhf import checkpoints
import common
from rlhf import data
from rlhf import memory
from rlhf import parallel
from rlhf import sampling
from rlhf import tracking
from worlds import world
from common import TrainArgs

# what the embedded world's tiny model needs instead of the pretrained defaults (common.apply_defaults);
# docs/reward.md gives the measurements behind each value. learning_rate 3e-4 and max_steps 1200: a fact
# copied wrongly (the world's contrast pairs) is learnt only after about 1000 steps; expand_layers 1: a
# layer above the policy's two reads at the last token which fact a clause copies; warmup_steps 100 keeps
# that new layer from missing the wrong actions; eval_steps 300: each evaluation scores all 1600 test pairs.
EMBEDDED_DEFAULTS = {"learning_rate": 3e-4, "lr_scheduler_type": "cosine", "warmup_steps": 100, "batch_size": 32,
                     "max_steps": 1200, "expand_layers": 1, "eval_steps": 300, "num_train_epochs": 0.0}


@dataclass
class Args(TrainArgs):
    # model and data
    eval_dataset: str = field(default="", metadata={"help": "Held-out pairs: a file, or a Hub name (its 'test' split); empty: hold out --test_size of --dataset."})
    test_size: float = field(default=0.1, metadata={"help": "Fraction of the pairs held out for the test accuracy when --eval_dataset is empty."})
    max_prompt_length: int = field(default=512, metadata={"help": "Prompts are cut to their last this-many tokens."})
    max_completion_length: int = field(default=256, metadata={"help": "Responses are cut to their first this-many tokens (EOS included)."})
    # optimisation (defaults for a pretrained model; EMBEDDED_DEFAULTS for the embedded world's tiny one)
    num_train_epochs: float = field(default=3.0, metadata={"help": "Passes over the training pairs (TRL's 3), which set the number of steps; --max_steps N trains N steps instead."})
    max_steps: int = field(default=400, metadata={"help": "Optimizer steps (with --num_train_epochs 0 or when passed); cycles through the pairs as needed."})
    learning_rate: float = field(default=1e-5, metadata={"help": "Peak learning rate (embedded world: 3e-4)."})
    lr_scheduler_type: str = field(default="linear", metadata={"help": "Any transformers scheduler name (embedded world: cosine)."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up steps (embedded world: 100)."})
    batch_size: int = field(default=8, metadata={"help": "Preference pairs per micro-batch, 2x sequences (TRL's; embedded world: 32)."})
    expand_layers: int = field(default=0, metadata={"help": "New decoder layers added on top of the policy's before training, output projections at zero so the model starts as the policy's (block expansion; embedded world: 1)."})
    # logging
    eval_steps: int = field(default=100, metadata={"help": "Log test loss/accuracy/margin every this many steps (0: at the end only; embedded world: 300)."})


def expand_layers(model, n):
    """Block expansion (Wu et al. 2024, LLaMA Pro): n new decoder layers on top of the trunk, with
    the architecture's initialisation (LLaMA Pro copies the layer below) except their two output projections (attention's o_proj, the MLP's
    down_proj), which start at zero. Each new layer then adds nothing to the residual
    stream, so the expanded model computes exactly what the policy's trunk did, and training
    grows it from there. Why a reward model may need one: read at the last token, it must see
    what the policy's last layer computes at every other position -- which fact a clause copies
    -- and only a layer above that one can read it there."""
    body, config = sampling.backbone(model), model.config
    for _ in range(n):
        top = body.layers[-1] if getattr(body, "layers", None) else body  # GPT-2's blocks are body.h
        if not (hasattr(getattr(top, "self_attn", None), "o_proj") and hasattr(getattr(top, "mlp", None), "down_proj")):
            common.fail(f"--expand_layers: {type(top).__name__} has no self_attn.o_proj and mlp.down_proj "
                        "(Llama, Qwen, Mistral and Gemma layers have them); pass --expand_layers 0.")
        config.num_hidden_layers = len(body.layers) + 1
        if getattr(config, "layer_types", None):  # one entry per layer (sliding or full attention): the top one's
            config.layer_types = list(config.layer_types) + [config.layer_types[-1]]
        layer = type(top)(config, len(body.layers))
        for module in layer.modules():
            model._init_weights(module)
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            torch.nn.init.zeros_(proj.weight)
        body.layers.append(layer.to(device=top.self_attn.o_proj.weight.device, dtype=top.self_attn.o_proj.weight.dtype))
    return model


def score_pad_token(tokenizer, stops):
    """The pad token to save with the reward model. transformers' *ForSequenceClassification (what TRL
    and pipelines score with) reads the score at the last token that is not config.pad_token_id; with
    pad == EOS (SmolLM2, Llama 3, Qwen2.5 base) a completion ending in EOS is scored one token early
    there, where this project reads it at the EOS itself (masks come from lengths, not ids). A pad
    token that is no stop token makes both read the same token: the unknown token, else the first
    special token that is neither a stop token nor BOS; None where the vocabulary has none."""
    if tokenizer.pad_token_id not in stops:
        return tokenizer.pad_token
    for token in [tokenizer.unk_token, *tokenizer.all_special_tokens]:
        token_id = tokenizer.convert_tokens_to_ids(token) if token else None
        if token_id is not None and token_id not in stops and token_id != tokenizer.bos_token_id:
            return token
    return None


def bradley_terry_loss(chosen_rewards, rejected_rewards):
    """-log sigmoid(r_w - r_l), mean over pairs (Stiennon et al. 2020, Eq. 1), with its metrics."""
    margin = chosen_rewards - rejected_rewards  # (B,)
    loss = -F.logsigmoid(margin).mean()  # logsigmoid, not log(sigmoid): no underflow at large margins
    return loss, {"accuracy": (margin > 0).float().mean(), "margin": margin.mean().detach()}


def pair_scores(model, tokenizer, triples, args):
    """R_psi on chosen and rejected of a list of (prompt, chosen, rejected) texts: two (B,) tensors.

    Each prompt (left-padded) goes through the model once and both responses (right-padded) read
    it (sampling.completion_scores); the score is read at each response's last
    real token, the same number as on prompt + response in one sequence.
    """
    prompts = [p for p, _, _ in triples]
    responses = [x for _, c, r in triples for x in (c, r)]  # pair i's chosen, then its rejected
    p_ids, p_mask = data.encode_prompts(tokenizer, prompts, args.max_prompt_length)  # (B, P)
    c_ids, c_mask = data.encode_completions(tokenizer, responses, args.max_completion_length,
                                              sampling.stop_token_ids(model, tokenizer))  # (2B, C)
    scores = sampling.completion_scores(model, p_ids.to(model.device), p_mask.to(model.device),
                                        c_ids.to(model.device), c_mask.to(model.device))  # (2B,)
    return scores[0::2], scores[1::2]


@torch.no_grad()
def evaluate(model, tokenizer, triples, args):
    """Loss, accuracy and margin over a list of triples, plus all scores (for the gold check)."""
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    for i in range(0, len(triples), args.eval_batch_size):
        c, r = pair_scores(model, tokenizer, triples[i:i + args.eval_batch_size], args)
        chosen.append(c.cpu())
        rejected.append(r.cpu())
    model.train(was_training)
    chosen, rejected = torch.cat(chosen), torch.cat(rejected)
    loss, m = bradley_terry_loss(chosen, rejected)
    return {"loss": float(loss), "accuracy": float(m["accuracy"]), "margin": float(m["margin"])}, chosen, rejected


def render(tokenizer, triples):
    return [(data.render_prompt(tokenizer, p), data.render_completion(tokenizer, p, c),
             data.render_completion(tokenizer, p, r)) for p, c, r in triples]


def main():
    script = common.script_name()  # a fork (my_grpo.py) prints, and shows its progress, under its own name
    from transformers import AutoModelForSequenceClassification

    args = common.apply_defaults(common.parse_args(Args), EMBEDDED_DEFAULTS)
    if args.eval_steps < 0 or args.expand_layers < 0 or not (0 < args.test_size < 1 or args.eval_dataset):
        common.fail("--eval_steps and --expand_layers must be >= 0 and --test_size in (0, 1) (or pass --eval_dataset).")
    if args.expand_layers and args.use_peft:
        if common.passed("expand_layers"):
            common.fail("--expand_layers trains new layers in full, which --use_peft's adapter folder cannot hold: "
                        "pass one of them.")
        args.expand_layers = 0  # the embedded default gives way to adapters
        if parallel.is_main():
            print(f"{script}: --use_peft: no new layers (--expand_layers 0)")
    if args.estimate_memory:  # what reward.py holds: one model with a score head, chosen + rejected per pair
        prompt_length, completion_length = memory.data_lengths(args, "prefs")  # the widest micro-batch's tokens
        memory.print_plan(args, head="score", train_sequences=2 * args.batch_size, train_prompts=args.batch_size,
                          extra_layers=args.expand_layers, prompt_length=prompt_length, completion_length=completion_length)
    parallel.init_distributed()  # under torchrun: join the process group; a no-op otherwise
    common.set_seed(args.seed + parallel.rank())
    device = common.device()

    # ---- data: (prompt, chosen, rejected), a held-out test part
    ds = data.training_data(args, "prefs")
    if args.eval_dataset:
        train_ds, test_ds = ds, data.load_data(args.eval_dataset, "test")
        test_triples = data.preference_triples(test_ds, args.eval_dataset)
    else:
        data.require_columns(ds, ["chosen", "rejected"], args.dataset, "Preference data needs prompt + chosen + rejected.")
        n_test = max(1, int(len(ds) * args.test_size))
        if len(ds) - n_test < 1:
            common.fail(f"{data.dataset_name(args.dataset)} has {len(ds)} pairs: too few to hold out {args.test_size:.0%}.")
        perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(args.seed)).tolist()
        train_ds, test_ds = ds.select(perm[n_test:]), ds.select(perm[:n_test])
        test_triples = data.preference_triples(test_ds, args.dataset)
    train_triples = data.preference_triples(train_ds, args.dataset)
    data.set_max_steps(args, len(train_triples), args.batch_size * args.gradient_accumulation_steps)

    # ---- model: the policy's trunk with a fresh scalar head
    tokenizer = common.load_tokenizer(args.model, args.trust_remote_code)
    # --use_peft: LoRA adapters on a frozen base, and the new score head trained in full
    model = common.load_model(args.model, args, cls=AutoModelForSequenceClassification, num_labels=1, adapters=True)
    expand_layers(model, args.expand_layers)  # before distributing, resuming and the optimizer: they see the new layers
    pad = score_pad_token(tokenizer, sampling.stop_token_ids(model, tokenizer))
    if pad is None:
        print(f"{script}: note: every special token of {args.model} is a stop token, so the saved pad token is "
              "EOS and transformers' sequence classifiers will read this model's scores one token before EOS.")
    else:
        tokenizer.pad_token = pad
    model.config.pad_token_id = tokenizer.pad_token_id  # saved: where transformers' classes read the score
    # dropout off (TRL's disable_dropout=True) by zeroing it, in training mode (gradient checkpointing
    # works only there): scores are deterministic
    common.disable_dropout(model).train()
    model = parallel.distribute(model, args)  # --parallel ddp | fsdp2 under torchrun
    train_triples, test_triples = render(tokenizer, train_triples), render(tokenizer, test_triples)
    data.check_readable(tokenizer, [p + c for p, c, _ in train_triples], args.model, args.dataset)
    truncated = data.truncation_counts(tokenizer, [p for p, _, _ in train_triples],
                                         [r for _, c, rj in train_triples for r in (c, rj)], args, script,
                                       sampling.stop_token_ids(model, tokenizer))
    print(f"{script}: {len(train_triples)} train / {len(test_triples)} test pairs from {data.dataset_name(args.dataset)}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, device {device}")
    if not args.eval_dataset:  # TRL's RewardTrainer holds out nothing: say where the test pairs come from
        print(f"{script}: the {len(test_triples)} test pairs are --test_size {args.test_size:g} of --dataset, held out of "
              "training for the test accuracy (pass --eval_dataset to train on every pair)"
              + (f"; with so few, the accuracy moves by 1/{len(test_triples)} a pair" if len(test_triples) < 50 else "") + ".")

    # ---- optimizer
    optimizer = common.make_optimizer(model, args)
    scheduler = common.make_scheduler(optimizer, args)
    start_step = checkpoints.maybe_resume(args, model, optimizer, scheduler)  # --resume: 0 if not resuming
    logger = tracking.MetricsLogger(args, start_step, model)  # + each step's time, throughput and MFU

    # ---- loop
    pbar = tracking.progress(args, start_step, desc=script)
    for step in pbar:
        rows = []
        for micro in range(args.gradient_accumulation_steps):
            # this rank's slice of the global micro-batch; the step is the position in the data
            idx = parallel.shard(data.batch_indices(len(train_triples), args.batch_size * parallel.world_size(),
                                                      args.seed, step * args.gradient_accumulation_steps + micro))
            chosen_rewards, rejected_rewards = pair_scores(model, tokenizer, [train_triples[i] for i in idx], args)  # (B,), (B,)
            loss, m = bradley_terry_loss(chosen_rewards, rejected_rewards)
            common.check_finite("loss", loss, step + 1)  # stop on NaN/inf before it reaches the weights
            (loss / args.gradient_accumulation_steps).backward()
            rows.append({"loss": loss.detach(), **m, "mean_reward": torch.cat([chosen_rewards, rejected_rewards]).mean().detach()})
        memory.log_memory(args.output_dir, model, optimizer)  # memory.json, once, at the first full step
        grad_norm = common.optimizer_step(optimizer, args.max_grad_norm, step + 1)  # clip, NaN guard, step, bf16 rounding
        scheduler.step()

        # ---- log (means over the --logging_steps window) and save
        logger.update({**tracking.mean_metrics(rows), "grad_norm": grad_norm})
        if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
            metrics = {"learning_rate": scheduler.get_last_lr()[0]}
            if args.eval_steps and (step + 1) % args.eval_steps == 0 and step + 1 < args.max_steps:
                ev, _, _ = evaluate(model, tokenizer, test_triples, args)
                metrics.update({f"eval_{k}": v for k, v in ev.items()})
            logger.log(step + 1, metrics, pbar)
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoints.save_checkpoint(model, tokenizer, args, f"{args.output_dir}/checkpoint-{step + 1}",
                                   checkpoints.training_state(step + 1, optimizer, scheduler))

    # ---- final evaluation: test and (an equal-sized slice of) train accuracy
    test, test_chosen, test_rejected = evaluate(model, tokenizer, test_triples, args)
    n_slice = min(len(train_triples), max(len(test_triples), 256))
    train_slice = [train_triples[i] for i in data.batch_indices(len(train_triples), n_slice, args.seed + 1, 0)]
    train, train_chosen, _ = evaluate(model, tokenizer, train_slice, args)
    logger.log(args.max_steps, {f"eval_{k}": v for k, v in test.items()})
    logger.close()
    # the centre of the reward scale: mean score on (a slice of) the training chosen responses
    reward_mean = float(train_chosen.mean())
    summary = {"test_loss": test["loss"], "test_accuracy": test["accuracy"], "test_margin": test["margin"],
               "train_loss": train["loss"], "train_accuracy": train["accuracy"], "train_margin": train["margin"],
               "reward_mean": reward_mean, "reward_std": float(train_chosen.std()), **truncated}
    if args.dataset == common.EMBEDDED and not args.eval_dataset:
        # the gold judge's own preference on the test pairs (ties count 1/2): what the noisy labels estimate
        gold = torch.tensor(test_ds["chosen_gold"]) - torch.tensor(test_ds["rejected_gold"])
        ours = test_chosen - test_rejected
        agree = torch.where(gold == 0, 0.5, ((gold > 0) == (ours > 0)).float())
        # the label-noise ceiling on these test pairs: how often the gold judge agrees with their labels
        ceiling = torch.where(gold == 0, 0.5, (gold > 0).float())
        summary.update(test_gold_accuracy=float(agree.mean()), test_label_ceiling=float(ceiling.mean()),
                       label_ceiling=world.world_stats(common.embedded_world(args.seed))["label_ceiling"])
        # what the model can see: accuracy on minimal pairs (reference vs. one error of one kind, test posts)
        probes = world.probe_pairs(common.embedded_world(args.seed)["test"], args.seed)
        summary["probe_accuracy"] = {kind: evaluate(model, tokenizer, render(tokenizer, list(zip(*texts))), args)[0]["accuracy"]
                                     for kind, texts in probes.items()}
    print(f"{script}: test accuracy {test['accuracy']:.3f} (train {train['accuracy']:.3f}"
          + (f", label ceiling {summary['label_ceiling']:.3f} (test pairs {summary['test_label_ceiling']:.3f}), vs gold {summary['test_gold_accuracy']:.3f}" if "label_ceiling" in summary else "")
          + f"), margin {test['margin']:.3f}, reward_mean {reward_mean:.3f}")
    if "probe_accuracy" in summary:
        print(f"{script}: accuracy on minimal pairs (reference vs. one error): "
              + ", ".join(f"{k} {v:.2f}" for k, v in summary["probe_accuracy"].items()))
    if not math.isfinite(test["loss"]):
        common.fail("the reward model's test loss is not finite: lower --learning_rate.")

    # ---- final save: reward_mean travels in the config so ppo.py / grpo.py can centre rewards
    model.config.reward_mean = reward_mean
    checkpoints.save_final(model, tokenizer, args)
    summary.update(tracking.divergence(args.output_dir))  # a loss that blew up: said, and not a success
    checkpoints.finish_run(args, summary)  # summary.json, then the lock goes
    print(f"{script}: {checkpoints.saved_where(args)}")


if __name__ == "__main__":
    main()
