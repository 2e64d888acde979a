"""grpo.py: Group Relative Policy Optimization, critic-free RL from verifiable or learned rewards
(Shao et al. 2024, DeepSeekMath, Sec. 4.1).

For every prompt x the policy samples a group of G completions y_1..y_G and scores them. The
baseline is the group itself, so no value network is trained or held in memory:

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)        (DeepSeekMath Sec. 4.1.2)

Every token of y_i gets A_i. The policy then minimises a clipped surrogate (PPO, with dual clip
and clip-higher) plus a per-token k3 estimate of KL(pi || pi_ref), weighted by beta:

    r_t  = pi(y_t | x, y_<t) / pi_old(y_t | x, y_<t)
    s_t  = min(r_t A, clip(r_t, 1 - epsilon, 1 + epsilon_high) A)           (PPO Eq. 7)
    s_t  = max(s_t, c A)  where A < 0                                         (dual clip, Ye et al. 2020)
    kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                         (DeepSeekMath Eq. 4)
    l_t  = -(s_t - beta kl_t), aggregated over tokens by --loss_type          (DeepSeekMath Eq. 3)

Rewards: the embedded world's gold judge used as a rule verifier (`--reward_fn gold`, RLVR, the
default), a reward model saved by reward.py (`--reward_model runs/reward`), a user function
`--reward_fn rewards.py:fn` called as fn(prompts, completions, **other_columns) -> list[float]
(TRL's signature), or a weighted sum of several (`--reward_weights`).

Departures from the paper and from TRL:
- `--loss_type grpo` (the default) is DeepSeekMath's per-sequence token mean; `dr_grpo` and
  `dapo` are the later fixes of its length bias (see `grpo_loss`). TRL defaults to `dapo`.
- The dual clip (off in TRL) is on by default, as in the design document; with
  --num_iterations 1 the ratio is exactly 1, so neither clip can bind until --num_iterations > 1.
- `--scale_rewards auto` is `none` for dr_grpo (Dr. GRPO drops the std), `batch` when a
  `--reward_model` is among the rewards, and `group` otherwise. A reward model gives the G
  near-identical samples of a converged group scores that differ by noise (0.01 apart, say);
  dividing by that group's std turns the noise into full-size advantages, and the policy chases
  it (the README's Results measure it on the embedded world). A verifier's tied rewards give
  std 0 and A = 0 instead.
- `--reward_model` scores have the reward model's training mean (`reward_mean`, stored by
  reward.py) subtracted, so logged rewards read like PPO's; advantages do not change.
- The defaults are tuned for the tiny from-scratch policy in runs/sft: lr 5e-5, 32-token
  completions, temperature 0.7 (TRL: 1.0). At 1.0 its samples score far below its greedy
  output, the group baseline then favours the empty summary (gold 0), and the policy collapses
  to it. For a pretrained model use TRL-like values (--learning_rate 1e-6, --temperature 1.0,
  longer completions).

Run:
    python grpo.py                                        # runs/sft + gold verifier -> runs/grpo
    python grpo.py --reward_model runs/reward             # learned reward instead of the verifier
    python grpo.py --reward_model runs/reward --reward_fn gold --reward_weights 0,1 --output_dir runs/grpo_rm
                                                          # ... and log the samples' gold score (weight 0)
    python grpo.py --model Qwen/Qwen2.5-1.5B --learning_rate 1e-6 --temperature 1.0   # embedded prompts, gold
    python grpo.py --model <folder> --dataset prompts.jsonl --reward_fn rewards.py:fn
"""

import os
import time
from dataclasses import dataclass, field

import torch

import common
import memory
import parallel
import sampling
from common import TrainArgs

ADV_EPS = 1e-4  # eps of the group normalisation (TRL's value); a group with std 0 gets A = 0


@dataclass
class Args(TrainArgs):
    # model and data
    max_prompt_length: int = field(default=512, metadata={"help": "Prompts are cut to their last this-many tokens."})
    # rewards
    reward_fn: str = field(default="", metadata={"help": "Comma-separated reward functions: 'gold' (the embedded judge as a verifier) or file.py:function, called as fn(prompts, completions, **other_columns). Default: gold when no --reward_model is given."})
    reward_model: str = field(default="", metadata={"help": "Comma-separated folders of reward models saved by reward.py."})
    reward_weights: str = field(default="", metadata={"help": "Comma-separated weights, one per reward: the --reward_fn ones first, then --reward_model (default: all 1)."})
    # generation
    num_generations: int = field(default=8, metadata={"help": "G: completions sampled per prompt (at least 2)."})
    max_completion_length: int = field(default=32, metadata={"help": "Completions stop at EOS or this many tokens."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature (TRL: 1.0); log-probs are computed at the same temperature."})
    # algorithm
    beta: float = field(default=0.04, metadata={"help": "Weight of the k3 KL to the reference; 0 never loads the reference model."})
    epsilon: float = field(default=0.2, metadata={"help": "Clip range: the ratio is clipped below at 1 - epsilon."})
    epsilon_high: float = field(default=0.0, metadata={"help": "Upper clip 1 + epsilon_high (DAPO clip-higher, e.g. 0.28); 0: same as --epsilon."})
    dual_clip_c: float = field(default=3.0, metadata={"help": "Dual clip c > 1: for A < 0 the objective is bounded below by c*A; 0 disables."})
    num_iterations: int = field(default=1, metadata={"help": "Optimizer steps per rollout (mu); 1 is on-policy. log pi_old comes from the first update's forward, so reuse costs no extra pass."})
    loss_type: str = field(default="grpo", metadata={"help": "grpo (per-sequence mean) | dr_grpo (constant normaliser) | dapo (token mean over the batch)."})
    scale_rewards: str = field(default="auto", metadata={"help": "group | batch | none: divide advantages by the group's or the batch's reward std, or not; auto: none for dr_grpo, batch with a --reward_model, else group."})
    mask_truncated_completions: bool = field(default=False, metadata={"help": "Completions without EOS contribute no loss (their rewards still shape the group baseline)."})
    # optimisation (defaults fit the tiny runs/sft policy; use ~1e-6 for a pretrained model)
    max_steps: int = field(default=150, metadata={"help": "Optimizer steps (a new rollout every --num_iterations steps)."})
    learning_rate: float = field(default=5e-5, metadata={"help": "Peak learning rate (5e-5 suits the tiny runs/sft policy; ~1e-6 a pretrained one)."})
    batch_size: int = field(default=8, metadata={"help": "Prompts per micro-batch; each yields --num_generations completions."})
    eval_batch_size: int = field(default=200, metadata={"help": "Prompts per generation batch when scoring the test split."})


# ============================================================================ advantages
def group_advantages(rewards, num_generations, scale_rewards="group"):
    """A_i = (r_i - mean_group) / (std + eps) for rewards laid out in groups of G consecutive
    completions: (N,) -> (N,). A group whose rewards are all equal gets A = 0 (no gradient)."""
    grouped = rewards.view(-1, num_generations)  # (B, G)
    advantages = grouped - grouped.mean(1, keepdim=True)
    if scale_rewards == "group":  # DeepSeekMath: each group's own std (unbiased, as torch.std)
        advantages = advantages / (grouped.std(1, keepdim=True) + ADV_EPS)
    elif scale_rewards == "batch":  # one std for the whole batch: keeps easy groups' small gaps small
        advantages = advantages / (rewards.std() + ADV_EPS)
    return advantages.reshape(-1)  # (N,)


# ============================================================================ loss
def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, completion_mask, args,
              num_sequences=None, num_tokens=None):
    """The GRPO objective (module docstring) for a micro-batch, and its metrics.

    logprobs, old_logprobs, ref_logprobs (None when beta == 0), completion_mask: (N, C);
    advantages: (N,). `num_sequences` / `num_tokens` are the normalisers of the whole
    optimizer batch (default: this micro-batch), so gradient accumulation sums exactly.
    """
    mask = completion_mask.float()
    num_sequences = num_sequences or mask.shape[0]
    num_tokens = num_tokens or mask.sum().clamp(min=1)
    adv = advantages[:, None]  # (N, 1): every token of y_i gets A_i

    # clipped surrogate with clip-higher (PPO Eq. 7; DAPO Sec. 3.1)
    epsilon_high = args.epsilon_high or args.epsilon
    ratio = torch.exp(logprobs - old_logprobs)  # (N, C)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - args.epsilon, 1 + epsilon_high) * adv)
    # dual clip (Ye et al. 2020): for A < 0 a huge ratio would give an unbounded loss; cap it at c*A
    if args.dual_clip_c:
        surrogate = torch.where(adv < 0, torch.max(surrogate, args.dual_clip_c * adv), surrogate)
    per_token_loss = -surrogate  # (N, C)

    # k3 estimator of KL(pi || pi_ref), unbiased and >= 0 (DeepSeekMath Eq. 4; Schulman 2020)
    kl = None
    if ref_logprobs is not None:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1  # (N, C)
        per_token_loss = per_token_loss + args.beta * kl

    # aggregate over tokens; the three choices weight long and short completions differently
    if args.loss_type == "grpo":  # DeepSeekMath Eq. 3: 1/G sum_i 1/|y_i| sum_t (biased to long wrong answers)
        per_seq = (per_token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)
        loss = per_seq.sum() / num_sequences
    elif args.loss_type == "dr_grpo":  # Dr. GRPO (Liu et al. 2025): a constant G * max_len normaliser
        loss = (per_token_loss * mask).sum() / (num_sequences * args.max_completion_length)
    else:  # dapo (Yu et al. 2025, Sec. 3.3): every token of the batch weighs the same
        loss = (per_token_loss * mask).sum() / num_tokens

    # metrics: fractions of tokens where each clip binds (TRL's clip_ratio/*), mean KL
    with torch.no_grad():
        def masked_mean(x):
            return (x.float() * mask).sum() / mask.sum().clamp(min=1)

        low = (ratio < 1 - args.epsilon) & (adv < 0)
        high = (ratio > 1 + epsilon_high) & (adv > 0)
        dual = (ratio > args.dual_clip_c) & (adv < 0) if args.dual_clip_c else torch.zeros_like(low)
        metrics = {"clip_ratio": masked_mean(low | high), "clip_ratio/low_mean": masked_mean(low),
                   "clip_ratio/high_mean": masked_mean(high), "clip_ratio/dual_mean": masked_mean(dual)}
        if kl is not None:
            metrics["kl"] = masked_mean(kl)
    return loss, metrics


# ============================================================================ rewards
def load_rewards(args):
    """Every reward source as {"name", "fn"} (a reward function) or {"name", "model", "tokenizer"}
    (a reward model), and their weights (K,)."""
    specs = [s for s in args.reward_fn.split(",") if s]
    paths = [p for p in args.reward_model.split(",") if p]
    if not specs and not paths:  # no reward named: the verifier, which only knows the embedded world
        if args.dataset != common.EMBEDDED:
            common.fail(f"--dataset {args.dataset} needs a reward: pass --reward_fn file.py:function "
                        "(fn(prompts, completions, **columns) -> list[float]) or --reward_model PATH.")
        specs = ["gold"]
    rewards = []
    for spec in specs:
        fn = common.load_reward_fn(spec)
        rewards.append({"name": "gold" if spec == "gold" else fn.__name__, "fn": fn})
    for path in paths:
        model, tokenizer = common.load_reward_model(path, args)
        rewards.append({"name": os.path.basename(path.rstrip("/")), "model": model, "tokenizer": tokenizer})
    # weights: r = sum_k w_k r_k, before the group normalisation (as TRL's reward_weights)
    weights = [1.0] * len(rewards)
    if args.reward_weights:
        try:
            weights = [float(w) for w in args.reward_weights.split(",")]
        except ValueError:
            common.fail(f"--reward_weights {args.reward_weights!r}: expected comma-separated numbers.")
        if len(weights) != len(rewards):
            common.fail(f"--reward_weights has {len(weights)} values for {len(rewards)} rewards "
                        f"({', '.join(r['name'] for r in rewards)}).")
    return rewards, torch.tensor(weights)


@torch.no_grad()
def score(rewards, prompts, texts, columns, args):
    """Rewards of each source for N completions: (N, K). `prompts` are the dataset's prompts
    (text or conversations), `texts` the decoded completions, `columns` the other dataset columns."""
    completions = sampling.reward_completions(prompts, texts)  # TRL's form: text, or an assistant message
    out = []
    for r in rewards:
        if "fn" in r:
            out.append(common.call_reward_fn(r["fn"], prompts, completions, columns))
        else:  # a reward model reads the text through its own tokenizer and chat template
            scores = sampling.score_texts(r["model"], r["tokenizer"], prompts, completions, args.eval_batch_size,
                                          args.max_prompt_length)
            out.append(scores - getattr(r["model"].config, "reward_mean", 0.0))  # reward.py's training mean
    return torch.stack(out, 1)  # (N, K)


# ============================================================================ main
def main():
    args = common.parse_args(Args)
    if args.estimate_memory:  # what GRPO holds: the policy, a reference unless beta == 0, reward models
        memory.print_plan(args, reference=True if args.beta else "--beta 0",
                          reward_models=args.reward_model.split(","), reward_note="reward function(s) only",
                          train_sequences=args.batch_size * args.num_generations,
                          generation_sequences=args.batch_size * args.num_generations,
                          prompt_length=args.max_prompt_length, completion_length=args.max_completion_length)
    common.check_choice("--loss_type", args.loss_type, ["grpo", "dr_grpo", "dapo"])
    common.check_choice("--scale_rewards", args.scale_rewards, ["auto", "group", "batch", "none"])
    if args.scale_rewards == "auto":
        # a reward model's within-group noise must not be scaled up to full-size advantages (docstring)
        args.scale_rewards = "none" if args.loss_type == "dr_grpo" else "batch" if args.reward_model else "group"
    if args.num_generations < 2:
        common.fail(f"--num_generations {args.num_generations}: GRPO needs at least 2 completions per prompt, "
                    "since each is judged against the others of its group (with 1, every advantage is 0).")
    if args.dual_clip_c and args.dual_clip_c <= 1:
        common.fail(f"--dual_clip_c {args.dual_clip_c}: must be > 1 (or 0 to disable).")
    if args.num_iterations < 1 or args.beta < 0 or args.epsilon <= 0 or args.temperature <= 0:
        common.fail("--num_iterations must be >= 1, --beta >= 0, --epsilon and --temperature > 0.")
    if args.save_steps and args.save_steps % args.num_iterations:
        common.fail(f"--save_steps {args.save_steps} must be a multiple of --num_iterations {args.num_iterations}, "
                    "so a checkpoint never falls inside a rollout's reuse.")
    G = args.num_generations  # completions per prompt; rows i*G..(i+1)*G-1 are prompt i's group
    parallel.init_distributed()  # under torchrun: join the process group; a no-op otherwise
    common.set_seed(args.seed + parallel.rank())  # each rank samples differently
    device = common.device()

    # ---- data: prompt-only rows (TRL's format); every other column goes to the reward functions
    ds = common.training_data(args, "rl")
    common.require_columns(ds, ["prompt"], args.dataset, "GRPO trains on prompt-only data.")
    common.check_text(ds, ["prompt"], args.dataset)
    extra_columns = [c for c in ds.column_names if c != "prompt"]

    # ---- models: policy, frozen reference (only if beta > 0), reward sources
    tokenizer = common.load_tokenizer(args.model, args.trust_remote_code)
    model = common.load_model(args.model, args)
    model.train()
    model = parallel.distribute(model, args)  # --parallel ddp | fsdp2 under torchrun
    # the KL anchor: the starting policy, frozen; beta == 0 saves its memory entirely
    ref_model = common.freeze(common.load_model(args.model, args)) if args.beta else None
    rewards, weights = load_rewards(args)
    reward_names = [r["name"] for r in rewards]
    raw_prompts = ds["prompt"]  # what reward functions see: text or conversations
    prompts = [common.render_prompt(tokenizer, p) for p in raw_prompts]  # what the policy sees
    column_values = {c: ds[c] for c in extra_columns}
    truncated_counts = common.truncation_counts(tokenizer, prompts, None, args, "grpo")  # + completions as sampled
    print(f"grpo: {len(ds)} prompts from {common.dataset_name(args.dataset)}, rewards {reward_names} "
          f"(weights {weights.tolist()}, --scale_rewards {args.scale_rewards}), "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{args.batch_size} x {G} completions per micro-batch, device {device}")

    # ---- optimizer
    optimizer = common.make_optimizer(model, args)
    scheduler = common.make_scheduler(optimizer, args)
    start_step = common.maybe_resume(args, model, optimizer, scheduler)  # --resume: 0 if not resuming
    logger = common.MetricsLogger(args, start_step)

    # ---- loop
    start = time.time()
    pbar = common.progress(args, start_step, desc="grpo")
    for step in pbar:
        # 1. rollout: a fresh batch every num_iterations steps, reused (off-policy) in between
        if step % args.num_iterations == 0:
            batches, rollout_metrics = [], []
            for micro in range(args.gradient_accumulation_steps):
                # this rank's prompts of the global batch; the step is the position in the data
                idx = parallel.shard(common.batch_indices(
                    len(ds), args.batch_size * parallel.world_size(), args.seed,
                    (step // args.num_iterations) * args.gradient_accumulation_steps + micro))
                prompt_ids, prompt_mask = common.encode_prompts(tokenizer, [prompts[i] for i in idx], args.max_prompt_length)
                prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)  # (B, P)
                # (B*G, C): groups are consecutive rows; each prompt is encoded once for its G samples,
                # here and in every log-prob pass below (sampling.completion_logprobs shares it)
                completion_ids, completion_mask, truncated = sampling.generate(
                    model, tokenizer, prompt_ids, prompt_mask, args.max_completion_length, args.temperature,
                    num_return_sequences=G)
                texts = sampling.decode_completions(tokenizer, completion_ids, completion_mask)
                truncated_counts["completions_truncated"] += int(truncated.sum())  # no EOS within --max_completion_length

                # 2. score every completion with every reward source, then the weighted sum
                group = [i for i in idx for _ in range(G)]
                columns = {c: [v[i] for i in group] for c, v in column_values.items()}
                rewards_per_source = score(rewards, [raw_prompts[i] for i in group], texts, columns, args)  # (N, K)
                reward = (rewards_per_source * weights).sum(1)  # (N,)
                common.check_finite("reward", reward, step + 1)

                # 3. group-relative advantages; groups with equal rewards carry no signal
                advantages = group_advantages(reward, G, args.scale_rewards).to(device)  # (N,)
                group_std = reward.view(-1, G).std(1)
                lengths = completion_mask.sum(1).float()
                rollout_metrics.append({
                    "reward": reward.mean(), "reward_std": group_std.mean(),
                    "frac_reward_zero_std": torch.isclose(group_std, torch.zeros_like(group_std)).float().mean(),
                    **{f"rewards/{n}/mean": rewards_per_source[:, k].mean() for k, n in enumerate(reward_names)},
                    **{f"rewards/{n}/std": rewards_per_source[:, k].std() for k, n in enumerate(reward_names)},
                    "completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
                    "completions/max_length": lengths.max(), "completions/clipped_ratio": truncated.float().mean(),
                })
                if args.mask_truncated_completions:  # no EOS: the reward judged an unfinished text
                    completion_mask = completion_mask * (~truncated[:, None]).long()

                # 4. log-probs of the reference (those of the sampling policy come with the first update)
                ref_logprobs = None
                if ref_model is not None:
                    with torch.no_grad():
                        ref_logprobs = sampling.completion_logprobs(ref_model, prompt_ids, prompt_mask, completion_ids,
                                                                  completion_mask, args.temperature)
                batches.append({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                                "completion_mask": completion_mask, "advantages": advantages,
                                "ref_logprobs": ref_logprobs, "old_logprobs": None})
            # normalisers of the whole optimizer batch, so accumulated micro-batches sum to one loss
            num_sequences = sum(b["completion_ids"].shape[0] for b in batches)
            num_tokens = sum(b["completion_mask"].sum() for b in batches).clamp(min=1)

        # 5. update: one optimizer step over the rollout's micro-batches
        step_metrics = []
        for mb in batches:
            logprobs, entropy = sampling.completion_logprobs(model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                                             mb["completion_mask"], args.temperature, with_entropy=True)
            # the rollout's first update runs on the weights that sampled it, so pi_old == pi here: the
            # ratio is exactly 1 with pi's gradient, and no extra forward pass is needed for pi_old;
            # later updates of the same rollout (--num_iterations > 1) reuse these log-probs
            if mb["old_logprobs"] is None:
                mb["old_logprobs"] = logprobs.detach()
            loss, metrics = grpo_loss(logprobs, mb["old_logprobs"], mb["ref_logprobs"], mb["advantages"],
                                      mb["completion_mask"], args, num_sequences, num_tokens)
            common.check_finite("loss", loss, step + 1)  # stop before a NaN reaches the weights
            if loss.requires_grad:  # False only when every completion is masked (all truncated)
                loss.backward()
            mask = mb["completion_mask"].float()
            metrics.update(loss=loss.detach(), entropy=(entropy * mask).sum() / mask.sum().clamp(min=1))
            step_metrics.append(metrics)
            del logprobs, entropy, loss
        memory.log_memory(args.output_dir, model, optimizer,  # memory.json, once, at the first full step
                          frozen={"reference model": ref_model, "reward model": [r["model"] for r in rewards if "model" in r]})
        grad_norm = common.optimizer_step(optimizer, args.max_grad_norm, step + 1)  # stops on a NaN/inf gradient
        scheduler.step()

        # ---- log and save
        if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
            metrics = common.mean_metrics(step_metrics)
            metrics["loss"] *= len(step_metrics)  # micro-batch losses are parts of one sum
            logger.log(step + 1, {**common.mean_metrics(rollout_metrics), **metrics, "grad_norm": grad_norm,
                                  "learning_rate": scheduler.get_last_lr()[0], "num_tokens": int(num_tokens)}, pbar)
        if args.save_steps and (step + 1) % args.save_steps == 0:
            common.save_checkpoint(model, tokenizer, args, f"{args.output_dir}/checkpoint-{step + 1}",
                                   common.training_state(step + 1, optimizer, scheduler))
    train_seconds = time.time() - start

    # ---- final save and evaluation
    logger.close()
    common.save_final(model, tokenizer, args)
    truncated_counts["completions_truncated"] = round(parallel.all_reduce(float(truncated_counts["completions_truncated"]), "sum"))
    summary = {"train_seconds": train_seconds,
               "seconds_per_step": train_seconds / max(args.max_steps - start_step, 1),
               **(common.mean_metrics(rollout_metrics) if args.max_steps > start_step else {}), **truncated_counts}
    if truncated_counts["completions_truncated"]:
        print(f"grpo: {truncated_counts['completions_truncated']} sampled completions reached --max_completion_length "
              f"{args.max_completion_length} without EOS")
    if args.dataset == common.EMBEDDED:
        ev = common.gold_eval(model, tokenizer, args)
        summary.update(ev)
        print(f"grpo: test gold score {ev['gold_score']:.3f}; e.g. {ev['samples'][0]!r}")
    common.write_json(f"{args.output_dir}/summary.json", summary)
    print(f"grpo: {train_seconds:.0f} s of training; saved to {args.output_dir}")


if __name__ == "__main__":
    main()
