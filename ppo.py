"""ppo.py: classical RLHF with PPO and four models (Stiennon et al. 2020; Ouyang et al. 2022),
with dual-clip PPO (Ye et al. 2020) for stability on large negative advantages. Recipes, LoRA,
offloading and evidence: docs/ppo.md.

The four models:
    pi_theta  the actor (trained), from the SFT policy (--model);
    pi_ref    the frozen reference, the same SFT policy;
    V_phi     the critic (trained), initialised from the reward model (Huang et al. 2024, "The N+
              implementation details of RLHF with PPO"); from the policy with --reward_fn;
    R_psi     the frozen reward model (--reward_model, from reward.py), or reward functions
              (--reward_fn) in its place.

One step (= one rollout batch):
    1. rollout    sample y ~ pi_theta(.|x), truncated at its first EOS;
    2. rewards    r_t = -kl_coef * (log pi_theta(y_t) - log pi_ref(y_t)) per token, plus the
                  score R_psi(x, y) on the last token (Stiennon et al. 2020, Eq. 2);
    3. advantages GAE(gamma, lam) (Schulman et al. 2016, Eq. 16), whitened over the batch;
    4. update     --num_ppo_epochs passes over --num_mini_batches minibatches of the dual-clip
                  surrogate (Schulman et al. 2017, Eq. 7; Ye et al. 2020, Eq. 5) plus the clipped
                  value loss, weighted by --vf_coef.

Departures from the papers and from TRL's (removed) PPOTrainer:
- The score is centred: R_psi(x, y) - reward_mean (reward.py stores the mean score on chosen
  responses); the critic's head gets a bias of -reward_mean, so it starts centred the same way.
- A completion without EOS gets the fixed score -missing_eos_penalty (Huang et al. 2024; TRL
  subtracts the penalty from the model's score): a truncated text's score is meaningless.
- Dropout is off in every forward pass, so log-probs at rollout and at the first update match
  exactly: ratio == 1.
- Policy and critic share one optimizer and one gradient-norm clip (as TRL's wrapper does).
- The policy and value losses are token means over the whole minibatch, every micro-batch on
  every rank (`minibatch_tokens`); TRL averages per micro-batch.
- The reward model shares the policy's tokenizer (the critic reads the rollout's token ids); it
  scores the decoded completion rendered as reward.py rendered its training pairs.
- With --use_peft, pi_ref is the actor's base and R_psi the critic's, adapters off: two bases,
  not four models (docs/ppo.md).
- When another engine samples (--use_vllm), the gap between its log-probs and pi_old is logged
  (`sampling/*`), not corrected: TRL's PPO has no such sampler to follow.
"""

import dataclasses
from dataclasses import dataclass, field

import torch

from rlhf import checkpoints
import common
from rlhf import data
from rlhf import lora
from rlhf import memory
from rlhf import parallel
from rlhf import rollouts
from rlhf import sampling
from rlhf import tracking
from rlhf import vllm_rollouts
from common import SamplingArgs

# what the embedded world's tiny policy needs instead of the pretrained defaults (common.apply_defaults)
EMBEDDED_DEFAULTS = {"learning_rate": 2e-5, "max_completion_length": 32, "batch_size": 64, "gradient_accumulation_steps": 1}


@dataclass
class Args(SamplingArgs):
    # model and data
    reward_model: str = field(default="runs/reward", metadata={"help": "Folder or Hub id of the reward model (reward.py's output); ignored with --reward_fn."})
    reward_fn: str = field(default="", metadata={"help": "Comma-separated reward functions (gold, file.py:function, ...) used instead of the reward model (TRL's contract: docs/usage.md)."})
    reward_weights: str = field(default="", metadata={"help": "Comma-separated weights, one per --reward_fn (default: all 1)."})
    eval_reward_fn: str = field(default="", metadata={"help": "Reward functions that score the --eval_dataset completions but are never trained on (e.g. gold beside the reward model)."})
    dataset_split: str = field(default="train", metadata={"help": "Split of --dataset (a prompt column; other columns go to --reward_fn)."})
    max_prompt_length: int = field(default=512, metadata={"help": "Prompts are cut to their last this-many tokens."})
    # generation
    max_completion_length: int = field(default=256, metadata={"help": "Tokens sampled per completion, stop token included."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature (TRL's default); log-probs and the KL use the same."})
    missing_eos_penalty: float = field(default=1.0, metadata={"help": "A completion with no EOS gets the score -missing_eos_penalty."})
    # algorithm
    kl_coef: float = field(default=0.1, metadata={"help": "Per-token KL penalty in the reward: r_t -= kl_coef * (log pi - log pi_ref)."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Scale the per-token rewards to unit variance over the batch before GAE."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor of GAE."})
    lam: float = field(default=0.95, metadata={"help": "Lambda of GAE."})
    cliprange: float = field(default=0.2, metadata={"help": "Policy ratio clip epsilon."})
    dual_clip_c: float = field(default=3.0, metadata={"help": "Dual clip: the surrogate is bounded below by c * A where A < 0 (c > 1; 0 disables)."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip: new values stay within this of the rollout's."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss."})
    num_ppo_epochs: int = field(default=2, metadata={"help": "Passes over each rollout batch."})
    num_mini_batches: int = field(default=2, metadata={"help": "Minibatches (optimizer steps) per pass; rollout batch = batch_size * gradient_accumulation_steps * num_mini_batches."})
    # optimisation
    max_steps: int = field(default=30, metadata={"help": "Rollout batches (each followed by num_ppo_epochs * num_mini_batches optimizer steps)."})
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate of the policy and the critic."})
    batch_size: int = field(default=8, metadata={"help": "Prompts per micro-batch (generation and forward passes)."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per minibatch (one optimizer step)."})
    # memory
    offload_frozen: bool = field(default=False, metadata={"help": "Keep the reference and reward model on the CPU between their forward passes."})


def validate(args):
    """The checks main() needs before anything loads."""
    if args.dual_clip_c and args.dual_clip_c <= 1:
        common.fail(f"--dual_clip_c must be > 1 (or 0 to disable), got {args.dual_clip_c}.")
    for name in ("num_ppo_epochs", "num_mini_batches", "max_completion_length"):
        if getattr(args, name) < 1:
            common.fail(f"--{name} must be at least 1, got {getattr(args, name)}.")
    if args.offload_frozen and args.use_peft:
        common.fail("--offload_frozen moves frozen copies to the CPU; with --use_peft the reference and reward model "
                    "are the trained models' own bases, so there is nothing to offload: drop one of the two flags.")
    if args.use_vllm:
        vllm_rollouts.check_args(args)
    return args


def print_memory_plan(args):
    """--estimate_memory: what PPO holds (actor, frozen reference, critic, reward model or a function)."""
    shared_rm = args.use_peft and not args.reward_fn  # R_psi is the critic's base (docstring)
    memory.print_plan(args, reference=True, critic_from=args.model if args.reward_fn else args.reward_model,
                      reward_models=[] if args.reward_fn or shared_rm else [args.reward_model],
                      reward_note="the critic's base with its adapters off (--use_peft)" if shared_rm else "--reward_fn only",
                      train_sequences=args.batch_size, generation_sequences=args.batch_size,
                      offload=args.offload_frozen, **dict(zip(["prompt_length", "completion_length"],
                                                              memory.data_lengths(args, "rl", args.max_completion_length))))


# ============================================================================ the algorithm
def masked_mean(x, mask, num_tokens=None):
    """Mean over the masked entries; with num_tokens, the sum divided by it instead (a share of
    a mean over more tokens than these: minibatch_tokens)."""
    return (x * mask).sum() / (mask.sum().clamp(min=1) if num_tokens is None else num_tokens)


def minibatch_tokens(masks):
    """The normaliser of a minibatch's losses, given this rank's micro-batch masks: its token
    count on every rank, divided by the number of ranks -- optimizer_step averages the ranks'
    gradients, so the summed micro-batch losses are then the token mean of the whole minibatch."""
    return parallel.all_reduce(sum(m.sum() for m in masks).float()).clamp(min=1 / parallel.world_size())


def masked_whiten(x, mask, shift_mean=True):
    """(x - mean) / std over the masked entries of the global batch (every rank's rows under
    torchrun); without shift_mean the mean is added back."""
    dtype, x, mask = x.dtype, x.double(), mask.double()  # float64: float32's squares overflow past ~1e19 (var inf, A = 0)
    count = parallel.all_reduce(mask.sum(), "sum").clamp(min=1)
    mean = parallel.all_reduce((x * mask).sum(), "sum") / count
    var = parallel.all_reduce(((x - mean) ** 2 * mask).sum(), "sum") / count
    whitened, mean = ((x - mean) * torch.rsqrt(var + 1e-8)).to(dtype), mean.to(dtype)
    return whitened if shift_mean else whitened + mean


def per_token_rewards(scores, logprobs, ref_logprobs, completion_mask, kl_coef):
    """Stiennon et al. 2020, Eq. 2, spread over tokens (Ziegler et al. 2019):
    r_t = -kl_coef * (log pi(y_t) - log pi_ref(y_t)), plus the score R(x, y) on the last token.

    Returns the rewards (B, C), the per-token KL (B, C) and the non-score part (B, C)."""
    kl = (logprobs - ref_logprobs) * completion_mask  # (B, C), the k1 estimator of KL(pi || pi_ref)
    non_score_reward = -kl_coef * kl
    last = completion_mask.sum(1).long() - 1  # (B,) index of EOS (or of the last sampled token)
    rewards = non_score_reward.clone()
    rewards[torch.arange(len(scores)), last] += scores
    return rewards, kl, non_score_reward


def gae(rewards, values, mask, gamma, lam):
    """Generalised advantage estimation (Schulman et al. 2016, Eqs. 11-16), vectorised:

        delta_t = r_t + gamma * V_{t+1} - V_t          (V = 0 after the last token)
        A_t     = sum_{l>=0} (gamma * lam)^l * delta_{t+l}
        R_t     = A_t + V_t                            (the critic's target)

    The sum is one matmul with the (C, C) upper-triangular matrix of (gamma * lam)^(j - t);
    C is the completion length, so this costs C^2 floats, not a Python loop over tokens."""
    values = values * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)  # (B, C)
    deltas = (rewards + gamma * next_values - values) * mask
    C = rewards.shape[1]
    steps = torch.arange(C, device=rewards.device)
    lag = steps[:, None] - steps[None, :]  # (C, C): lag[j, t] = j - t
    discount = torch.where(lag >= 0, (gamma * lam) ** lag.clamp(min=0).to(rewards.dtype), 0.0)
    advantages = (deltas @ discount) * mask  # (B, C): A_t = sum_j delta_j (gamma lam)^(j-t), j >= t
    return advantages, advantages + values


def policy_loss(logprobs, old_logprobs, advantages, mask, cliprange, dual_clip_c, num_tokens=None):
    """Dual-clip PPO surrogate, as a loss to minimise (Schulman et al. 2017, Eq. 7; Ye et al. 2020, Eq. 5):

        L = -E_t[ max( min(r_t A_t, clip(r_t, 1-eps, 1+eps) A_t), c A_t ) ]   where A_t < 0
        L = -E_t[ min(r_t A_t, clip(r_t, 1-eps, 1+eps) A_t) ]                  where A_t >= 0

    with r_t = pi_theta(y_t) / pi_old(y_t). The dual clip bounds how much a token with a large
    ratio and a negative advantage can push: its loss is at most -c * A_t. E_t is the token mean
    of this micro-batch, or its share of one over `num_tokens` tokens (minibatch_tokens); the
    metrics are this micro-batch's means."""
    ratio = torch.exp(logprobs - old_logprobs)  # (B, C)
    surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - cliprange, 1 + cliprange) * advantages)
    objective = surrogate
    dual_clipped = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip_c:
        dual_clipped = (advantages < 0) & (surrogate < dual_clip_c * advantages)
        objective = torch.where(advantages < 0, torch.max(surrogate, dual_clip_c * advantages), surrogate)
    loss = -masked_mean(objective, mask, num_tokens)
    with torch.no_grad():
        stats = {
            "pg_loss": -masked_mean(objective, mask),
            "clipfrac": masked_mean((ratio * advantages > surrogate).float(), mask),  # the clip bound binds
            "dual_clip_frac": masked_mean(dual_clipped.float(), mask),
            "approx_kl": 0.5 * masked_mean((logprobs - old_logprobs) ** 2, mask),  # TRL's estimator
            "ratio": masked_mean(ratio, mask),
        }
    return loss, stats


def value_loss(values, old_values, returns, mask, cliprange_value, num_tokens=None):
    """Clipped value loss (Schulman et al. 2017 baselines; Huang et al. 2024, detail 8):
    0.5 * E[max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)], E as in policy_loss."""
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    losses = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    loss = 0.5 * masked_mean(losses, mask, num_tokens)
    stats = {"vf_loss": 0.5 * masked_mean(losses.detach(), mask),
             "vf_clipfrac": masked_mean(((clipped - returns) ** 2 > (values - returns) ** 2).float(), mask)}
    return loss, stats


def explained_variance(values, returns, mask):
    """1 - Var(R - V) / Var(R) over real tokens: 1 is a perfect critic, 0 a constant one."""
    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    residual = returns - values
    var_residual = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    return 1 - var_residual / var_returns.clamp(min=1e-8)


# ============================================================================ the critic and forward passes
def load_critic(source, args):
    """V_phi: a transformer with a scalar head (AutoModelForSequenceClassification), from the
    reward model (or the policy with --reward_fn); with --use_peft, LoRA adapters on its frozen
    base and a trained copy of the head (peft's modules_to_save). Centre it with `centre_critic`."""
    from transformers import AutoModelForSequenceClassification

    return common.load_model(source, args, cls=AutoModelForSequenceClassification, num_labels=1, adapters=True)


def centre_critic(critic, reward_mean):
    """Give the critic's trained head a bias of -reward_mean (HF's score heads have none), so the
    critic starts centred like the score it learns to predict, R_psi(x, y) - reward_mean;
    without it, its values start off by reward_mean. With --use_peft the trained head is peft's
    copy; the original head, which R_psi reads with the adapters off, stays uncentred."""
    owner, name = (critic.score.modules_to_save, critic.active_adapter) if lora.is_peft(critic) else (critic, "score")
    head = getattr(owner, name)
    centred = torch.nn.Linear(head.in_features, 1, bias=True, device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        centred.weight.copy_(head.weight)
        centred.bias.fill_(-reward_mean if head.bias is None else float(head.bias) - reward_mean)
    setattr(owner, name, centred)
    return critic


def token_values(critic, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """V_phi(s_t) for each completion token: the critic's scalar head on every position, read at
    the state *before* each completion token (the same positions as its log-prob): (B, C)."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    hidden = sampling.backbone(critic)(input_ids=ids, attention_mask=mask, position_ids=sampling.position_ids(mask),
                                     use_cache=False).last_hidden_state  # (B, P+C, H)
    C = completion_ids.shape[1]
    return critic.score(hidden[:, -C - 1:-1]).squeeze(-1).float() * completion_mask  # (B, C)


def policy_and_values(policy, critic, mb, temperature):
    """Log-probs, entropies and values of one micro-batch; the same call at rollout (under
    no_grad) and in the update, so the first update sees ratio == 1."""
    logprobs, entropy = sampling.completion_logprobs(policy, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                                   mb["completion_mask"], temperature, with_entropy=True)  # (B, C)
    values = token_values(critic, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
    return logprobs, entropy, values


def pad_right(t, width, value=0):
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def slice_batch(batch, idx):
    """Rows `idx` of every (N, ...) tensor in the batch, trimmed to their own longest completion."""
    mb = {k: v[idx] for k, v in batch.items()}
    width = max(int(mb["completion_mask"].sum(1).max()), 1)
    return {k: (v[:, :width] if v.dim() == 2 and k not in ("prompt_ids", "prompt_mask") else v) for k, v in mb.items()}


@torch.no_grad()
def score(reward_fns, reward_model, rm_tokenizer, prompts, texts, completion_ids, columns, args, step=0, logs=None):
    """R(x, y) of decoded completions (N,): the reward functions (functions, weights) on TRL's
    form of the text, called as TRL calls them (with the token ids, the dataset's other columns
    and the step), their weighted sum over those that do not return None (a completion none
    applies to stops the run: PPO needs a score for every completion); or the reward model on
    reward.py's rendering of it (uncentred)."""
    completions = sampling.reward_completions(prompts, texts)  # TRL's form: text, or an assistant message
    if reward_fns is not None:
        fns, weights = reward_fns
        return common.weighted_rewards(common.call_reward_fns(fns, prompts, completions, completion_ids, columns, 1,
                                                              step, args.max_steps, logs), weights)
    return sampling.score_texts(reward_model, rm_tokenizer, prompts, completions, args.eval_batch_size,
                                args.max_prompt_length)


def on_device(model, device, offload):
    """Move a frozen model to `device` for its forward pass (a no-op unless --offload_frozen)."""
    return model.to(device) if offload and model is not None else model


@torch.no_grad()
def evaluate(policy, reward_model, rm_tokenizer, reward_fns, reward_mean, tokenizer, eval_ds, eval_fns, args, step=0):
    """--eval_dataset: eval_reward, the mean score of one greedy completion per held-out prompt,
    scored as the rollout scores (centred reward model or --reward_fn; no EOS: -missing_eos_penalty);
    and eval_rewards/<name>/mean of each --eval_reward_fn function (`eval_fns`, {name: fn}) on the
    same completions, as they are (no penalty: a reward the run never sees, e.g. the gold judge)."""
    device, offload = common.device(), torch.device("cpu") if args.offload_frozen else common.device()
    columns = {c: list(eval_ds[c]) for c in eval_ds.column_names if c != "prompt"}  # lists, not `datasets` Columns
    reward_model = on_device(reward_model, device, args.offload_frozen) if reward_model is not None else None
    scores, held_out = [], []
    for s in range(0, len(eval_ds), args.eval_batch_size):
        raw = eval_ds["prompt"][s:s + args.eval_batch_size]
        p_ids, p_mask = data.encode_prompts(tokenizer, [data.render_prompt(tokenizer, p) for p in raw], args.max_prompt_length)
        p_ids, p_mask = p_ids.to(device), p_mask.to(device)
        c_ids, c_mask, truncated = sampling.generate(policy, tokenizer, p_ids, p_mask, args.max_completion_length, do_sample=False)
        texts = sampling.decode_completions(tokenizer, c_ids, c_mask, truncated)
        with lora.adapters_off(reward_model):  # --use_peft: R_psi is the critic's base
            scored = score(reward_fns, reward_model, rm_tokenizer, raw, texts, sampling.completion_id_lists(c_ids, c_mask),
                           {k: v[s:s + args.eval_batch_size] for k, v in columns.items()}, args, step).cpu() - reward_mean
        scores.append(torch.where(truncated.cpu(), -args.missing_eos_penalty, scored))
        # --eval_reward_fn: the same completions, called as the training rewards are (no second generation)
        held_out.append(common.call_reward_fns(
            list(eval_fns.values()), raw, sampling.reward_completions(raw, texts), sampling.completion_id_lists(c_ids, c_mask),
            {k: v[s:s + args.eval_batch_size] for k, v in columns.items()}, step=step, max_steps=args.max_steps,
            every_row=False))  # (B, K_eval), NaN where a function returned None
    if reward_model is not None:
        on_device(reward_model, offload, args.offload_frozen)
    held_out = torch.cat(held_out)  # (N, K_eval): means over the completions each function applies to (TRL's nanmean)
    return {"eval_reward": float(torch.cat(scores).mean()),
            **{f"eval_rewards/{name}/mean": float(held_out[:, k].nanmean()) for k, name in enumerate(eval_fns)}}


# ============================================================================ one rollout's pieces
def load_models(args, device, offload_device):
    """The four models (docstring): the actor, its frozen reference, the critic (centred like the
    score) and the reward model with its tokenizer and training mean (None, None, 0 with
    --reward_fn). With --use_peft, R_psi is the critic's base with its adapters off."""
    tokenizer = common.load_tokenizer(args.model, args.trust_remote_code)
    policy = common.load_model(args.model, args, adapters=True)
    ref_policy = on_device(common.reference_of(policy, args), offload_device, args.offload_frozen)
    # the critic: a scalar head on a transformer, from the reward model (or the policy with --reward_fn)
    critic = load_critic(args.model if args.reward_fn else args.reward_model, args)
    reward_model, rm_tokenizer, reward_mean = None, None, 0.0
    if not args.reward_fn:
        if args.use_peft:  # R_psi is the critic's base with its adapters and trained head off
            reward_model, rm_tokenizer = critic, common.load_tokenizer(args.reward_model, args.trust_remote_code)
        else:
            reward_model, rm_tokenizer = common.load_reward_model(args.reward_model, args)
            reward_model = reward_model.to(offload_device)
        if rm_tokenizer.get_vocab() != tokenizer.get_vocab():
            common.fail(f"the reward model {args.reward_model} has another tokenizer than {args.model}; ppo.py scores "
                        "token ids directly, so train the reward model from the same policy (python reward.py --model ...).")
        reward_mean = float(getattr(reward_model.config, "reward_mean", 0.0))
    centre_critic(critic, reward_mean)  # starts centred like the score: R_psi(x, y) - reward_mean
    # dropout off everywhere (Huang et al. 2024) by zeroing it: the trained models stay in training
    # mode, where HF's gradient checkpointing works (it recomputes nothing in eval mode)
    common.disable_dropout(policy), common.disable_dropout(critic)
    policy.train(), critic.train()
    # --parallel ddp | fsdp2 under torchrun: both trained models (the frozen ones stay whole on every rank)
    policy, critic = parallel.distribute(policy, args), parallel.distribute(critic, args)
    return tokenizer, policy, ref_policy, critic, reward_model, rm_tokenizer, reward_mean


def sample_rollout(sampler, policy, prompt_ids, prompt_mask, prompts, args, step):
    """The rollout batch, sampled with the policy's current weights in micro-batches of --batch_size
    prompts (each seeded by its first row), as one Rollout right-padded to its longest completion;
    and the time the sampler took to load the weights, as a metric."""
    b = args.batch_size
    sync_metrics = rollouts.load_weights(sampler, policy)
    parts = [rollouts.sample(sampler, policy, prompt_ids[s:s + b], prompt_mask[s:s + b], prompts[s:s + b], 1, (step, s))
             for s in tracking.within(range(0, len(prompts), b), "sampling")]
    rollouts.release(sampler)  # the sampler frees what it holds for the update, where it can
    return rollouts.concat(parts, sampler.tokenizer.pad_token_id), sync_metrics


@torch.no_grad()
def rollout_logprobs_and_values(policy, critic, ref_policy, batch, args, device, offload_device):
    """log pi_old and V_phi (the same call as the update's, so the first update sees ratio == 1)
    and log pi_ref of the rollout's tokens, in micro-batches: (N, C) each. pi_ref visits the
    device only for its forward (--offload_frozen)."""
    old_logprobs, values, ref_logprobs = [], [], []
    ref_policy = on_device(ref_policy, device, args.offload_frozen)
    for s in range(0, batch["completion_ids"].shape[0], args.batch_size):
        mb = {k: v[s:s + args.batch_size] for k, v in batch.items()}
        lp, _, v = policy_and_values(policy, critic, mb, args.temperature)
        old_logprobs.append(lp)
        values.append(v)
        with lora.adapters_off(ref_policy):
            ref_logprobs.append(sampling.completion_logprobs(ref_policy, mb["prompt_ids"], mb["prompt_mask"],
                                                             mb["completion_ids"], mb["completion_mask"], args.temperature))
    on_device(ref_policy, offload_device, args.offload_frozen)
    return torch.cat(old_logprobs), torch.cat(values), torch.cat(ref_logprobs)


@torch.no_grad()
def score_rollout(reward_fns, reward_model, rm_tokenizer, prompts, rollout, columns, args, step, logs, device, offload_device):
    """R_psi(x, y) of the rollout's completions (N,) on `device` (`score`); the reward model
    visits the device only for it (--offload_frozen), with its adapters off (--use_peft)."""
    on_device(reward_model, device, args.offload_frozen)
    with lora.adapters_off(reward_model):  # --use_peft: R_psi is the critic's base
        scores = score(reward_fns, reward_model, rm_tokenizer, prompts, rollout.texts, rollout.completion_id_lists(),
                       columns, args, step, logs).to(device)
    on_device(reward_model, offload_device, args.offload_frozen)
    return scores


def sampler_gap(old_logprobs, rollout):
    """How far another engine's log-probs (--use_vllm: the rollout carries them) are from pi_old's on
    its samples (`sampling/*`, logged, not corrected); nothing for the trainer's own samples."""
    if rollout.sampling_logprobs is None:
        return {}
    return vllm_rollouts.gap_metrics(old_logprobs, rollout.sampling_logprobs, rollout.completion_mask)


def rollout_metrics(scores, kl, non_score_reward, values, returns, mask, truncated, reward_logs):
    """TRL's PPO metrics of a rollout: the score, the KL penalty, the critic's fit, the lengths,
    and what the reward functions log_metric."""
    lengths = mask.sum(1)
    return {"reward": scores.mean(), "reward_std": scores.double().std(),
            "non_score_reward": non_score_reward.sum(1).mean(), "rlhf_reward": (scores + non_score_reward.sum(1)).mean(),
            "kl": kl.sum(1).mean(), "explained_variance": explained_variance(values, returns, mask),
            "value": masked_mean(values, mask), "completions/mean_length": lengths.mean(),
            "completions/clipped_ratio": truncated.float().mean(),
            **{name: sum(v) / len(v) for name, v in reward_logs["metrics"].items()}}


# ============================================================================ main
def main():
    script = common.script_name()  # a fork (my_ppo.py) prints, and shows its progress, under its own name
    args = common.apply_defaults(common.parse_args(Args), EMBEDDED_DEFAULTS)
    rollout_batch = args.batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    if args.estimate_memory:
        print_memory_plan(args)
    validate(args)  # after the plan, which reads only config.json and exits
    parallel.init_distributed()  # under torchrun: join the process group; a no-op otherwise
    common.set_seed(args.seed + parallel.rank())  # rank-offset global RNG; the samples draw from sampling_kwargs' seed
    device = common.device()
    offload_device = torch.device("cpu") if args.offload_frozen else device

    # ---- data: prompts, plus any other columns for --reward_fn
    ds, eval_ds = data.prompt_data(args, "PPO")
    raw_prompts = list(ds["prompt"])  # lists, not datasets Columns: rows are read every step
    columns = {c: list(ds[c]) for c in ds.column_names if c != "prompt"}
    data.set_max_steps(args, len(ds), rollout_batch)  # --num_train_epochs: one step is one rollout batch
    common.print_step(args.batch_size * args.gradient_accumulation_steps * parallel.world_size(), 1, args.batch_size,
                      "none: TRL 1.16 has no PPO trainer", f"{rollout_batch} prompts a rollout, "
                      f"{args.num_ppo_epochs * args.num_mini_batches} optimizer steps on it")
    reward_fns = common.load_reward_fns(args.reward_fn, args.reward_weights) if args.reward_fn else None
    eval_fns = common.load_eval_reward_fns(args.eval_reward_fn)  # {name: fn}: scored on --eval_dataset, never trained on
    common.check_reward_datasets(reward_fns[0] if reward_fns else [], eval_fns.values(), ds, eval_ds, args)

    # ---- models: actor, reference, critic, reward (--use_peft: two bases with adapters, see the docstring)
    tokenizer, policy, ref_policy, critic, reward_model, rm_tokenizer, reward_mean = load_models(args, device, offload_device)
    prompts = [data.render_prompt(tokenizer, p) for p in raw_prompts]
    data.check_readable(tokenizer, prompts, args.model, args.dataset)
    truncated_counts = data.truncation_counts(tokenizer, prompts, None, args, script)  # + completions as sampled
    print(f"{script}: {len(prompts)} prompts from {data.dataset_name(args.dataset)}, rollout batch {rollout_batch}, "
          f"reward {'fn ' + args.reward_fn if args.reward_fn else 'model ' + args.reward_model} "
          f"(centred by {reward_mean:.3f}), critic from {args.model if args.reward_fn else args.reward_model}, device {device}")

    # ---- optimizer: one AdamW over actor and critic; resume; the sampler (rlhf/rollouts.py)
    optimizer = common.make_optimizer(torch.nn.ModuleDict({"policy": policy, "critic": critic}), args)
    updates_per_step = args.num_ppo_epochs * args.num_mini_batches
    sampler = rollouts.start(policy, tokenizer, args, args.max_completion_length)
    scheduler = common.make_scheduler(optimizer, dataclasses.replace(
        args, max_steps=args.max_steps * updates_per_step, warmup_steps=args.warmup_steps * updates_per_step))
    # --resume: policy weights, critic, optimizer (both models), scheduler and RNG; 0 if not resuming
    start_step = checkpoints.maybe_resume(args, policy, optimizer, scheduler, critic=critic)
    logger = tracking.MetricsLogger(args, start_step, [policy, critic])  # + each step's time, throughput and MFU
    frozen = {"reference model": None if ref_policy is policy else ref_policy,  # for memory.json
              "reward model": None if reward_model is critic else reward_model}

    # ---- loop
    pbar = tracking.progress(args, start_step, desc=script)
    final = {}  # the last step's reward and KL (and eval_* metrics), for summary.json
    for step in pbar:
        # 1. rollout: this rank's prompts of the global batch, sampled, truncated at the first stop token
        idx = data.rank_batch(len(prompts), rollout_batch, args.seed, step)
        prompt_ids, prompt_mask = data.encode_prompts(tokenizer, [prompts[i] for i in idx], args.max_prompt_length, device)
        rollout, sync_metrics = sample_rollout(sampler, policy, prompt_ids, prompt_mask, [raw_prompts[i] for i in idx], args, step)
        batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": rollout.completion_ids,
                 "completion_mask": rollout.completion_mask}  # (N, P), (N, C)
        truncated_counts["completions_truncated"] += int(rollout.truncated.sum())  # no EOS within the length
        mask = batch["completion_mask"].float()

        # 2. score and per-token rewards, all under no_grad
        with torch.no_grad():
            old_logprobs, values, ref_logprobs = rollout_logprobs_and_values(policy, critic, ref_policy, batch, args,
                                                                             device, offload_device)  # (N, C) each
            reward_logs = {"metrics": {}, "extra": {}}  # what a reward function logs (log_metric, log_extra)
            scores = score_rollout(reward_fns, reward_model, rm_tokenizer, [raw_prompts[i] for i in idx], rollout,
                                   {k: [v[i] for i in idx] for k, v in columns.items()}, args, step, reward_logs,
                                   device, offload_device) - reward_mean  # (N,): the centred score
            scores = torch.where(rollout.truncated, -args.missing_eos_penalty, scores)  # no EOS: a fixed penalty score
            common.check_finite("reward", scores, step + 1)
            rewards, kl, non_score_reward = per_token_rewards(scores, old_logprobs, ref_logprobs, mask, args.kl_coef)
            if args.whiten_rewards:
                rewards = masked_whiten(rewards, mask, shift_mean=False) * mask

            # 3. advantages: GAE, then whitened over the batch
            advantages, returns = gae(rewards, values, mask, args.gamma, args.lam)  # (N, C), (N, C)
            advantages = masked_whiten(advantages, mask) * mask
        batch.update(old_logprobs=old_logprobs, values=values, advantages=advantages, returns=returns)

        # 4. update: epochs over shuffled minibatches, micro-batches accumulate into one step
        stats = []
        mb_size = args.batch_size * args.gradient_accumulation_steps
        for epoch in range(args.num_ppo_epochs):
            perm = torch.randperm(rollout_batch, generator=torch.Generator().manual_seed(
                (args.seed * 100_003 + step) * 101 + epoch)).to(device)
            for start in range(0, rollout_batch, mb_size):
                micro_idx = [perm[m:m + args.batch_size] for m in range(start, start + mb_size, args.batch_size)]
                num_tokens = minibatch_tokens([batch["completion_mask"][i] for i in micro_idx])
                for mb_idx in tracking.within(micro_idx, f"epoch {epoch + 1} update"):
                    mb = slice_batch(batch, mb_idx)
                    mb_mask = mb["completion_mask"].float()
                    logprobs, entropy, mb_values = policy_and_values(policy, critic, mb, args.temperature)
                    pg_loss, pg_stats = policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], mb_mask,
                                                    args.cliprange, args.dual_clip_c, num_tokens)
                    vf_loss, vf_stats = value_loss(mb_values, mb["values"], mb["returns"], mb_mask, args.cliprange_value,
                                                   num_tokens)
                    loss = pg_loss + args.vf_coef * vf_loss  # this micro-batch's share of the minibatch's token mean
                    common.check_finite("loss", loss, step + 1)  # stop on NaN/inf before it reaches the weights
                    loss.backward()
                    stats.append({**pg_stats, **vf_stats, "loss": pg_stats["pg_loss"] + args.vf_coef * vf_stats["vf_loss"],
                                  "entropy": masked_mean(entropy.detach(), mb_mask)})
                memory.log_memory(args.output_dir, policy, optimizer, critic, frozen=frozen)  # memory.json, once
                grad_norm = common.optimizer_step(optimizer, args.max_grad_norm, step + 1)  # clip, NaN guard, step, bf16 rounding
                scheduler.step()

        # 5. log (means over the --logging_steps window), evaluate and save
        logger.update({**rollout_metrics(scores, kl, non_score_reward, values, returns, mask, rollout.truncated, reward_logs),
                       **tracking.mean_metrics(stats), "grad_norm": grad_norm,
                       **sampler_gap(old_logprobs, rollout), **sync_metrics}, num_tokens=int(batch["prompt_mask"].sum() + batch["completion_mask"].sum()))
        if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
            logger.log(step + 1, {"learning_rate": scheduler.get_last_lr()[0], "episode": (step + 1) * rollout_batch * parallel.world_size()}, pbar)
            tracking.log_completions(args, step + 1, [raw_prompts[i] for i in idx], rollout.texts,
                                     {"score": scores, "kl": kl.sum(1), **reward_logs["extra"]})
        if eval_ds is not None and args.eval_steps and (step + 1) % args.eval_steps == 0 and step + 1 < args.max_steps:
            eval_metrics = evaluate(policy, reward_model, rm_tokenizer, reward_fns, reward_mean, tokenizer, eval_ds, eval_fns,
                                    args, step + 1)
            logger.log_eval(step + 1, eval_metrics)
            final.update(eval_metrics)
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoints.save_checkpoint(policy, tokenizer, args, f"{args.output_dir}/checkpoint-{step + 1}",
                                        checkpoints.training_state(step + 1, optimizer, scheduler, critic=critic))
        final.update(final_reward=parallel.all_reduce(float(scores.mean())), final_kl=parallel.all_reduce(float(kl.sum(1).mean())))
        del batch, advantages, returns, rewards

    # ---- final save, then the final evaluation: an evaluation that fails never costs the trained model
    checkpoints.save_final(policy, tokenizer, args)
    if eval_ds is not None and args.max_steps > start_step:
        eval_metrics = evaluate(policy, reward_model, rm_tokenizer, reward_fns, reward_mean, tokenizer, eval_ds, eval_fns,
                                args, args.max_steps)
        logger.log_eval(args.max_steps, eval_metrics)
        final.update(eval_metrics)
    logger.close()
    finish(policy, ref_policy, critic, reward_model, optimizer, tokenizer, args, {**final, **truncated_counts},
           sampler, device, offload_device)


def finish(policy, ref_policy, critic, reward_model, optimizer, tokenizer, args, summary, sampler, device, offload_device):
    """The end of a run: the truncation count, the memory held, the embedded world's test gold
    score and KL, summary.json (then the output folder's lock goes), and the sampler stopped last."""
    script = common.script_name()
    if summary["completions_truncated"]:
        print(f"{script}: {summary['completions_truncated']} sampled completions reached --max_completion_length "
              f"{args.max_completion_length} without EOS")
    summary["memory_bytes"] = {"policy": memory.tensor_bytes(policy),
                               "ref_policy": 0 if ref_policy is policy else memory.tensor_bytes(ref_policy),
                               "critic": memory.tensor_bytes(critic),
                               "reward_model": memory.tensor_bytes(reward_model) if reward_model not in (None, critic) else 0,
                               "optimizer": memory.optimizer_state_bytes(optimizer), "peak": memory.peak_memory_bytes()}
    if args.dataset == common.EMBEDDED:
        summary.update(test_kl(policy, ref_policy, tokenizer, args, device, offload_device))
        summary.update(common.gold_eval(policy, tokenizer, args))
        print(f"{script}: test gold score {summary['gold_score']:.3f}, KL to the reference {summary['test_kl']:.3f} nats; "
              f"e.g. {summary['samples'][0]!r}")
    checkpoints.finish_run(args, summary)  # summary.json, then the lock goes
    # last: vLLM's shutdown destroys the default process group (vllm_rollouts.shutdown), after which
    # every rank would take itself for rank 0 (two summary.json writers) and collectives stop
    rollouts.stop(sampler)
    print(f"{script}: {checkpoints.saved_where(args)}")


@torch.no_grad()
def test_kl(policy, ref_policy, tokenizer, args, device, offload_device):
    """KL(pi_theta || pi_ref) per completion on the test prompts: the mean over samples
    y ~ pi_theta of sum_t log pi_theta(y_t) - log pi_ref(y_t) (unbiased, k1)."""
    test = common.embedded_world()["test"]
    prompts = [data.render_prompt(tokenizer, p) for p in test["prompt"]]
    ref_policy = on_device(ref_policy, device, args.offload_frozen)
    total = []
    for s in range(0, len(prompts), args.eval_batch_size):
        p_ids, p_mask = data.encode_prompts(tokenizer, prompts[s:s + args.eval_batch_size], args.max_prompt_length)
        p_ids, p_mask = p_ids.to(device), p_mask.to(device)
        c_ids, c_mask, _ = sampling.generate(policy, tokenizer, p_ids, p_mask, args.max_completion_length, temperature=args.temperature)
        lp = sampling.completion_logprobs(policy, p_ids, p_mask, c_ids, c_mask, args.temperature)
        with lora.adapters_off(ref_policy):
            ref_lp = sampling.completion_logprobs(ref_policy, p_ids, p_mask, c_ids, c_mask, args.temperature)
        total.append(((lp - ref_lp) * c_mask).sum(1).cpu())
    on_device(ref_policy, offload_device, args.offload_frozen)
    return {"test_kl": float(torch.cat(total).mean())}


if __name__ == "__main__":
    main()
