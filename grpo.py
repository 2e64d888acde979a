"""grpo.py: Group Relative Policy Optimization, critic-free RL from verifiable or learned rewards
(Shao et al. 2024, DeepSeekMath, Sec. 4.1). Rewards, tools, recipes and evidence: docs/grpo.md.

For every prompt x the policy samples a group of G completions y_1..y_G and scores them. The
group is the baseline, so no value network is trained or held in memory. Every token of y_i
gets the advantage A_i, and the policy minimises a clipped surrogate plus a k3 KL to pi_ref:

    A_i  = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)                     (DeepSeekMath Sec. 4.1.2)
    r_t  = pi(y_t | x, y_<t) / pi_old(y_t | x, y_<t)
    s_t  = min(r_t A, clip(r_t, 1 - epsilon, 1 + epsilon_high) A)             (PPO Eq. 7; DAPO Sec. 3.1)
    s_t  = max(s_t, c A)  where A < 0                                           (dual clip, Ye et al. 2020)
    kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                           (DeepSeekMath Eq. 4)
    l_t  = -(s_t - beta kl_t), summed over the model's own tokens and normalised by --loss_type:
        grpo     1/G sum_i 1/|y_i| sum_t l_t                                    (DeepSeekMath Eq. 3)
        dr_grpo  sum_i sum_t l_t / (G * max_completion_length)                  (Liu et al. 2025)
        dapo     sum_i sum_t l_t / (tokens of the optimizer batch)              (Yu et al. 2025, Sec. 3.3)
        bnpo     sum_i sum_t l_t / (tokens of the micro-batch), mean over micro-batches (TRL)
        cispo    l_t = -sg(min(r_t, 1 + epsilon_high)) A log pi(y_t) + beta kl_t, dapo's normaliser
                 (MiniMax-M1, 2025: the IS weight is clipped, never the token's gradient)

--advantage_estimator changes the baseline of A_i (the KL stays in the loss, as above):
    rloo          A_i = r_i - 1/(G-1) sum_{j != i} r_j                           (Ahmadian et al. 2024, RLOO)
    reinforce_pp  A_i = (r_i - mu) / sqrt(var + 1e-8), mu and var over the batch's tokens   (Hu 2025, REINFORCE++)

GSPO (--importance_sampling_level sequence, Zheng et al. 2025) replaces r_t by one ratio per
completion, exp(1/|y_i| sum_t (logp_t - old_logp_t)); sequence_sum drops the 1/|y_i| (TRL's RLOOTrainer).

Departures from the paper and from TRL:
- --loss_type grpo (the paper's per-sequence mean) is the default; TRL's is dapo.
- The dual clip (off in TRL) is on, as in the design document. With --num_iterations 1 the
  ratio is exactly 1, so no clip binds; pi_old is the first update's own forward, detached.
- --scale_rewards auto: none for dr_grpo, batch with a --reward_model (a converged group's
  reward-model noise must not become full-size advantages), group otherwise.
- A reward function may return None (TRL's contract); a completion no function applies to gets
  reward NaN, is left out of its group's mean and std, and gets A = 0.
- --reward_model scores are centred by its training mean (logged rewards read like PPO's).
- When another engine samples (--use_vllm), each token's loss is weighted by TRL's truncated or
  masked importance ratio pi_old / pi_sampler (`sampler_correction`). TRL's default bias
  correction of the KL by that ratio is not applied.
- --dynamic_sampling (DAPO Sec. 3.2) replaces groups whose rewards tie, at most --max_resample extra rollouts.
- Tool replies (--tools) are read, never trained on: every sum over t runs over the model's own
  tokens (completion_mask), and so do the KL, the entropy and the token counts.
- Defaults: TRL's step for a pretrained model (docs/trl.md lists what differs); the embedded
  world's tiny policy has its own (EMBEDDED_DEFAULTS: at temperature 1.0 it collapses).
"""

import os
import time
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
from rlhf import tools
from rlhf import tracking
from rlhf import vllm_rollouts
from common import SamplingArgs

ADV_EPS = 1e-4  # eps of the group normalisation (TRL's value); a group with std 0 gets A = 0
# what the embedded world's tiny policy needs instead of the pretrained defaults (see the docstring)
EMBEDDED_DEFAULTS = {"learning_rate": 5e-5, "temperature": 0.7, "max_completion_length": 32, "batch_size": 8,
                     "gradient_accumulation_steps": 1}


@dataclass
class Args(SamplingArgs):
    # model and data
    max_prompt_length: int = field(default=512, metadata={"help": "Prompts are cut to their last this-many tokens."})
    # rewards (docs/grpo.md lists the built-in ones and the reward-function contract)
    reward_fn: str = field(default="", metadata={"help": "Comma-separated reward functions: gold, arith_strict, arith_lenient, exec_tests, exec_tests_strict, ifeval_strict, or file.py:function (TRL's contract). Default: gold without --reward_model."})
    reward_model: str = field(default="", metadata={"help": "Comma-separated folders of reward models saved by reward.py."})
    reward_weights: str = field(default="", metadata={"help": "Comma-separated weights, --reward_fn ones first, then --reward_model (default: all 1)."})
    eval_reward_fn: str = field(default="", metadata={"help": "Reward functions that score the --eval_dataset completions but are never trained on (e.g. gold beside a --reward_model)."})
    # generation
    num_generations: int = field(default=8, metadata={"help": "G: completions sampled per prompt (at least 2)."})
    max_completion_length: int = field(default=256, metadata={"help": "Completions stop at a stop token or this many tokens."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; log-probs are computed at the same temperature."})
    # tools (rlhf/tools.py): the model may call these functions mid-answer; only its own tokens are trained
    tools: str = field(default="", metadata={"help": "Comma-separated file.py:function tools the model may call (conversational prompts; each call runs in the sandbox)."})
    max_tool_calling_iterations: int | None = field(default=None, metadata={"help": "Tool turns per completion at most (default: until a turn makes no call or the length is reached)."})
    # algorithm
    beta: float = field(default=0.04, metadata={"help": "Weight of the k3 KL to the reference; 0 never loads the reference model."})
    epsilon: float = field(default=0.2, metadata={"help": "Clip range: the ratio is clipped below at 1 - epsilon."})
    epsilon_high: float = field(default=0.0, metadata={"help": "Upper clip 1 + epsilon_high (DAPO clip-higher, e.g. 0.28); 0: same as --epsilon."})
    dual_clip_c: float = field(default=3.0, metadata={"help": "Dual clip c > 1: for A < 0 the objective is bounded below by c*A; 0 disables."})
    num_iterations: int = field(default=1, metadata={"help": "Optimizer steps per rollout (mu); 1 is on-policy."})
    loss_type: str = field(default="grpo", metadata={"help": "grpo | dr_grpo | dapo | bnpo | cispo (the docstring's normalisers)."})
    importance_sampling_level: str = field(default="token", metadata={"help": "token: one ratio per token (GRPO) | sequence: one per completion, from the mean of its token log-ratios (GSPO) | sequence_sum: from their sum (TRL's RLOOTrainer)."})
    advantage_estimator: str = field(default="grpo", metadata={"help": "grpo: the group's mean (and std) | rloo: the mean of the other G-1 (TRL's RLOOTrainer) | reinforce_pp: the batch's token-weighted moments (REINFORCE++, OpenRLHF's reinforce); the docstring's equations."})
    scale_rewards: str = field(default="auto", metadata={"help": "group | batch | none: divide advantages by the group's or the batch's reward std, or not; auto: none for dr_grpo, batch with a --reward_model, else group."})
    vllm_importance_sampling_correction: bool = field(default=True, metadata={"help": "With --use_vllm: weight each token's loss by the truncated or masked ratio pi_train / pi_vLLM (TRL's)."})
    vllm_importance_sampling_mode: str = field(default="sequence_mask", metadata={"help": "token_truncate | token_mask | sequence_truncate | sequence_mask (TRL's modes and default)."})
    vllm_importance_sampling_cap: float = field(default=3.0, metadata={"help": "The cap C of --vllm_importance_sampling_mode (TRL's default)."})
    dynamic_sampling: bool = field(default=False, metadata={"help": "DAPO's dynamic sampling: drop groups whose rewards all tie and sample fresh prompts until each micro-batch holds --batch_size groups with a reward spread."})
    max_resample: int = field(default=4, metadata={"help": "With --dynamic_sampling: extra rollouts of --batch_size prompts per micro-batch at most; past it, tied groups fill the rest."})
    mask_truncated_completions: bool = field(default=False, metadata={"help": "Completions without EOS contribute no loss (their rewards still shape the group baseline)."})
    # optimisation
    max_steps: int = field(default=150, metadata={"help": "Optimizer steps (a new rollout every --num_iterations steps)."})
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate."})
    batch_size: int = field(default=1, metadata={"help": "Prompts per micro-batch, each with --num_generations completions."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step (TRL's step: 1 prompt x 8 completions)."})
    eval_batch_size: int = field(default=200, metadata={"help": "Prompts per generation batch when scoring the test split."})


def validate(args):
    """The checks main() needs before anything loads, and the values `auto` resolves to."""
    common.check_choice("--loss_type", args.loss_type, ["grpo", "dr_grpo", "dapo", "bnpo", "cispo"])
    common.check_choice("--importance_sampling_level", args.importance_sampling_level, ["token", "sequence", "sequence_sum"])
    common.check_choice("--scale_rewards", args.scale_rewards, ["auto", "group", "batch", "none"])
    common.check_choice("--advantage_estimator", args.advantage_estimator, ["grpo", "rloo", "reinforce_pp"])
    scales = {"rloo": ["auto", "none", "batch"], "reinforce_pp": ["auto"]}.get(args.advantage_estimator)
    if scales and args.scale_rewards not in scales:
        common.fail(f"--scale_rewards {args.scale_rewards} with --advantage_estimator {args.advantage_estimator}: "
                    f"pass one of {scales} (rloo: none, or batch = TRL's normalize_advantages; reinforce_pp whitens "
                    "over the batch itself).")
    common.check_choice("--vllm_importance_sampling_mode", args.vllm_importance_sampling_mode,
                        ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
    if args.use_vllm:
        vllm_rollouts.check_args(args)
        if args.tools:
            common.fail("--tools samples with the project's own decoding loop (tools.py); --use_vllm does not run tool "
                        "calls: drop one of the two.")
    if args.scale_rewards == "auto" and args.advantage_estimator != "grpo":
        args.scale_rewards = "none"  # RLOO unscaled (TRL's default); REINFORCE++ whitens in its estimator
    if args.scale_rewards == "auto":
        # a reward model's within-group noise must not be scaled up to full-size advantages (docstring)
        args.scale_rewards = "none" if args.loss_type == "dr_grpo" else "batch" if args.reward_model else "group"
    if args.num_generations < 2:
        common.fail(f"--num_generations {args.num_generations}: GRPO needs at least 2 completions per prompt, "
                    "since each is judged against the others of its group (with 1, every advantage is 0).")
    if args.dual_clip_c and args.dual_clip_c <= 1:
        common.fail(f"--dual_clip_c {args.dual_clip_c}: must be > 1 (or 0 to disable).")
    if args.max_resample < 0:
        common.fail(f"--max_resample {args.max_resample}: must be >= 0 (extra rollouts per micro-batch).")
    if args.num_iterations < 1 or args.beta < 0 or args.epsilon <= 0 or args.temperature <= 0:
        common.fail("--num_iterations must be >= 1, --beta >= 0, --epsilon and --temperature > 0.")
    if args.max_tool_calling_iterations is not None and args.max_tool_calling_iterations < 0:
        common.fail(f"--max_tool_calling_iterations {args.max_tool_calling_iterations}: must be >= 0 (or unset: no limit).")
    if args.save_steps and args.save_steps % args.num_iterations:
        common.fail(f"--save_steps {args.save_steps} must be a multiple of --num_iterations {args.num_iterations}, "
                    "so a checkpoint never falls inside a rollout's reuse.")
    script, B, G = common.script_name(), args.batch_size, args.num_generations
    if common.passed("batch_size") and parallel.is_main():  # a config ported from TRL means other things (docs/trl.md)
        print(f"{script}: note: a micro-batch here is --batch_size {B} prompts x --num_generations {G} = {B * G} "
              f"completions, which is TRL's per_device_train_batch_size {B * G}.")
    if args.loss_type == "cispo" and args.epsilon_high >= 1 and parallel.is_main():
        print(f"{script}: note: cispo caps the IS weight at 1 + --epsilon_high = {1 + args.epsilon_high:g} "
              f"(TRL caps it at epsilon_high itself: pass {args.epsilon_high - 1:g} for TRL's {args.epsilon_high:g}).")
    return args


def print_memory_plan(args):
    """--estimate_memory: what GRPO holds (the policy, a reference unless beta == 0, reward models)."""
    memory.print_plan(args, reference=True if args.beta else "--beta 0",
                      reward_models=args.reward_model.split(","), reward_note="reward function(s) only",
                      train_sequences=args.batch_size * args.num_generations, train_prompts=args.batch_size,
                      generation_sequences=args.batch_size * args.num_generations,
                      **dict(zip(["prompt_length", "completion_length"],
                                 memory.data_lengths(args, "rl", args.max_completion_length))))


# ============================================================================ advantages
def nanstd(x, dim=None, keepdim=False):
    """torch.std (unbiased) of the values that are not NaN (TRL's nanstd): the rewards of
    completions no reward function applied to are left out."""
    dims = dim if dim is not None else tuple(range(x.dim()))
    count = (~x.isnan()).sum(dims, keepdim=True)
    # squared in float64: float32's squares overflow past |r| ~ 1e19 (rewards 0 and 1e20: std inf, every A = 0)
    x64 = x.double()
    var = ((x64 - x64.nanmean(dims, keepdim=True)) ** 2).nansum(dims, keepdim=True) / (count - 1)
    std = var.sqrt().to(x.dtype)
    return std if keepdim else std.squeeze(dims)


def group_advantages(rewards, num_generations, scale_rewards="group", batch_std=None):
    """A_i = (r_i - mean_group) / (std + eps) for rewards laid out in groups of G consecutive
    completions: (N,) -> (N,). A group whose rewards are all equal gets A = 0 (no gradient).
    `batch_std`: the reward std of the whole batch (default: of these rewards). A NaN reward (no
    reward function applied) is left out of the mean and std, and its advantage is 0 (TRL)."""
    grouped = rewards.double().view(-1, num_generations)  # (B, G); float64: sums of rewards near 1e38 overflow float32
    advantages = grouped - grouped.nanmean(1, keepdim=True)
    if scale_rewards == "group":  # DeepSeekMath: each group's own std (unbiased, as torch.std)
        advantages = advantages / (nanstd(grouped, 1, keepdim=True) + ADV_EPS)
    elif scale_rewards == "batch":  # one std for the whole batch: keeps easy groups' small gaps small
        advantages = advantages / ((nanstd(rewards) if batch_std is None else batch_std) + ADV_EPS)
    return advantages.reshape(-1).nan_to_num(0.0).to(rewards.dtype)  # (N,)


def rloo_advantages(rewards, num_generations):
    """RLOO's leave-one-out baseline (Ahmadian et al. 2024, Sec. 3.2; TRL's RLOOTrainer):

        A_i = r_i - 1/(G-1) sum_{j != i} r_j

    for rewards in groups of G consecutive completions, (N,) -> (N,). It equals G/(G-1) times
    GRPO's unscaled A_i: each sample's baseline leaves it out, so the estimate is unbiased. A NaN
    reward is left out of its siblings' baselines and gets A = 0; so does a group's only scorable
    completion (0/0, as TRL)."""
    grouped = rewards.double().view(-1, num_generations)  # (B, G)
    scorable = (~grouped.isnan()).sum(1, keepdim=True)  # (B, 1)
    baseline = (grouped.nansum(1, keepdim=True) - grouped) / (scorable - 1)  # (B, G): mean of the others
    return (grouped - baseline).reshape(-1).nan_to_num(0.0).to(rewards.dtype)  # (N,)


def reinforce_pp_advantages(rewards, lengths):
    """REINFORCE++'s global normalisation (Hu 2025, Eq. 9-10; OpenRLHF's --advantage_estimator
    reinforce with the KL in the loss): every token of y_i has the return r_i (gamma 1, no
    per-token KL reward), and the returns are whitened over every completion token of the batch:

        mu = sum_i |y_i| r_i / T,   var = sum_i |y_i| (r_i - mu)^2 / T,   T = sum_i |y_i|
        A_i = (r_i - mu) / sqrt(var + 1e-8)

    rewards, lengths (|y_i|, the trained tokens): (N,) -> (N,). No group baseline: the batch is
    the baseline. A NaN reward is left out of mu and var and gets A = 0."""
    r = rewards.double()
    w = lengths.double() * (~r.isnan())  # (N,): a token weight per completion
    T = w.sum().clamp(min=1)
    mu = (w * r.nan_to_num(0.0)).sum() / T
    var = (w * (r - mu).nan_to_num(0.0) ** 2).sum() / T
    return ((r - mu) * torch.rsqrt(var + 1e-8)).nan_to_num(0.0).to(rewards.dtype)  # (N,)


def batch_advantages(rewards, num_generations, scale_rewards, estimator="grpo", lengths=None):
    """The advantages of the micro-batches of one optimizer step (a list of (N_i,) rewards -> a
    list of (N_i,) advantages) under --advantage_estimator; `lengths`, the trained tokens of each
    completion (a list of (N_i,)), weigh REINFORCE++'s moments. What is batch-wide (--scale_rewards
    batch's std, RLOO's --scale_rewards batch = TRL's normalize_advantages, REINFORCE++'s token
    moments) spans every reward of the step on every rank (TRL: the whole generation batch)."""
    G, sizes = num_generations, [len(r) for r in rewards]
    if estimator == "grpo":
        batch_std = nanstd(parallel.all_gather(torch.cat(rewards)))
        return [group_advantages(r, G, scale_rewards, batch_std) for r in rewards]
    everything = parallel.all_gather(torch.cat(rewards))  # (N_all,): every rank's rows in rank order
    here = parallel.rank() * len(everything) // parallel.world_size() + torch.arange(sum(sizes))  # this rank's rows
    if estimator == "rloo":
        advantages = rloo_advantages(everything, G)
        if scale_rewards == "batch":  # TRL's normalize_advantages: the scorable advantages to mean 0, std 1
            scored = advantages[~everything.isnan()]
            advantages = ((advantages - scored.mean()) / (nanstd(scored) + ADV_EPS)).masked_fill(everything.isnan(), 0.0)
    else:
        advantages = reinforce_pp_advantages(everything, parallel.all_gather(torch.cat(lengths).to(everything.dtype)))
    return list(advantages[here].split(sizes))


def batch_normalisers(completion_masks):
    """grpo_loss's normalisers for the micro-batches of one optimizer step on this rank: this
    rank's sequence count, and the token count of every micro-batch on every rank divided by the
    number of ranks -- optimizer_step averages the ranks' gradients, so dapo's loss is then the
    token mean of the global batch (TRL: the global count), as one process computes it."""
    num_sequences = sum(m.shape[0] for m in completion_masks)
    num_tokens = parallel.all_reduce(sum(m.sum() for m in completion_masks).float())
    return num_sequences, num_tokens.clamp(min=1 / parallel.world_size())


# ============================================================================ the sampler-trainer gap
def importance_sampling_weights(old_logprobs, sampling_logprobs, completion_mask, mode, cap):
    """TRL's correction for a sampler whose numerics differ from the trainer's (Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training"): the tokens were
    drawn from pi_vLLM, the loss assumes pi_old, so each token's loss is weighted by

        rho_t = pi_old(y_t) / pi_vLLM(y_t) = exp(old_logp_t - vllm_logp_t)        (token_*)
        rho_i = exp( sum_t (old_logp_t - vllm_logp_t) ), for every token of y_i   (sequence_*)
        w = min(rho, C)  (*_truncate, truncated IS)      w = rho if rho <= C else 0  (*_mask)

    (N, C) log-probs and mask -> (N, C) or (N, 1) weights, without gradient."""
    log_rho = (old_logprobs - sampling_logprobs) * completion_mask  # (N, C)
    if mode.startswith("sequence"):
        log_rho = log_rho.sum(1, keepdim=True)  # (N, 1)
    rho = torch.exp(log_rho)
    return torch.clamp(rho, max=cap) if mode.endswith("truncate") else rho.masked_fill(rho > cap, 0.0)


def sampler_correction(mb, args):
    """The importance weights of a micro-batch (`micro_batch`) another engine sampled (it holds the
    engine's own log-probs: --use_vllm), against its pi_old, and the gap's metrics
    (vllm_rollouts.gap_metrics); the weights are None with --no_vllm_importance_sampling_correction
    (the gap is still logged). The trainer's own samples need no correction: (None, {})."""
    old_logprobs, sampling_logprobs, completion_mask = mb["old_logprobs"], mb["sampling_logprobs"], mb["completion_mask"]
    if sampling_logprobs is None:
        return None, {}
    is_weights = importance_sampling_weights(old_logprobs, sampling_logprobs, completion_mask,
                                             args.vllm_importance_sampling_mode, args.vllm_importance_sampling_cap)
    gap = vllm_rollouts.gap_metrics(old_logprobs, sampling_logprobs, completion_mask, is_weights)
    return (is_weights if args.vllm_importance_sampling_correction else None), gap


# ============================================================================ loss
def masked_mean(x, mask):
    """The mean of x over the tokens where mask is 1."""
    mask = mask.float()
    return (x.float() * mask).sum() / mask.sum().clamp(min=1)


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, completion_mask, args,
              num_sequences=None, num_tokens=None, is_weights=None):
    """The GRPO objective (module docstring) for a micro-batch, and its metrics.

    logprobs, old_logprobs, ref_logprobs (None when beta == 0), completion_mask: (N, C);
    advantages: (N,). `num_sequences` / `num_tokens` are the normalisers of the whole
    optimizer batch (default: this micro-batch), so gradient accumulation sums exactly.
    `is_weights`: --use_vllm's importance-sampling weights, (N, C) or (N, 1), or None.
    """
    mask = completion_mask.float()
    num_sequences = num_sequences or mask.shape[0]
    num_tokens = num_tokens or mask.sum().clamp(min=1)
    adv = advantages[:, None]  # (N, 1): every token of y_i gets A_i

    # the importance ratio: per token (GRPO), or per completion (GSPO, Zheng et al. 2025)
    epsilon_high = args.epsilon_high or args.epsilon
    log_ratio = logprobs - old_logprobs  # (N, C)
    level = getattr(args, "importance_sampling_level", "token")
    if level == "sequence":
        # s_i = exp(1/|y_i| sum_t log_ratio_t): the geometric mean of the token ratios, for every token
        log_ratio = ((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1))  # (N, 1)
    elif level == "sequence_sum":  # s_i = pi(y_i | x) / pi_old(y_i | x), the sequence's own ratio (TRL's RLOOTrainer)
        log_ratio = (log_ratio * mask).sum(1, keepdim=True)  # (N, 1)
    ratio = torch.exp(log_ratio)  # (N, C), or (N, 1) for GSPO
    if args.loss_type == "cispo":
        # CISPO (MiniMax-M1, 2025): the clipped IS weight, detached, times log pi; every token keeps its gradient
        per_token_loss = -torch.clamp(ratio, max=1 + epsilon_high).detach() * adv * logprobs  # (N, C)
    else:
        # clipped surrogate with clip-higher (PPO Eq. 7; DAPO Sec. 3.1)
        surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - args.epsilon, 1 + epsilon_high) * adv)
        # dual clip (Ye et al. 2020): for A < 0 a huge ratio would give an unbounded loss; cap it at c*A
        if args.dual_clip_c:
            surrogate = torch.where(adv < 0, torch.max(surrogate, args.dual_clip_c * adv), surrogate)
        per_token_loss = -surrogate  # (N, C)
    if is_weights is not None:  # samples from vLLM: l_t * w_t (importance_sampling_weights), as TRL, before the KL
        per_token_loss = per_token_loss * is_weights

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
    elif args.loss_type == "bnpo":  # TRL's bnpo: a token mean per micro-batch, averaged over micro-batches
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1) * (mask.shape[0] / num_sequences)
    else:  # dapo (Yu et al. 2025, Sec. 3.3) and cispo: every token of the optimizer batch weighs the same
        loss = (per_token_loss * mask).sum() / num_tokens

    # metrics: fractions of tokens where each clip binds (TRL's clip_ratio/*), mean KL
    with torch.no_grad():
        low = (ratio < 1 - args.epsilon) & (adv < 0)
        high = (ratio > 1 + epsilon_high) & (adv > 0)
        if args.loss_type == "cispo":  # the weight is capped whatever the sign of A; nothing else clips
            low, high = torch.zeros_like(low), ratio > 1 + epsilon_high
        dual = (ratio > args.dual_clip_c) & (adv < 0) if args.dual_clip_c and args.loss_type != "cispo" else torch.zeros_like(low)
        metrics = {"clip_ratio": masked_mean(low | high, mask), "clip_ratio/low_mean": masked_mean(low, mask),
                   "clip_ratio/high_mean": masked_mean(high, mask), "clip_ratio/dual_mean": masked_mean(dual, mask)}
        if kl is not None:
            metrics["kl"] = masked_mean(kl, mask)
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
                        "(called by keyword as TRL calls it: fn(completions, **kwargs) -> list[float]), --reward_model PATH, or on "
                        f"{common.ARITH} a verifier: --reward_fn arith_strict (or arith_lenient); on a dataset with "
                        "a `tests` column (e.g. embedded:code) the execution verifier: --reward_fn exec_tests.")
        specs = ["gold"]
    rewards = []
    for spec in specs:
        fn = common.load_reward_fn(spec)
        rewards.append({"name": "gold" if spec == "gold" else fn.__name__, "fn": fn})
    for path in paths:
        model, tokenizer = common.load_reward_model(path, args)
        rewards.append({"name": os.path.basename(path.rstrip("/")), "model": model, "tokenizer": tokenizer})
    names = [r["name"] for r in rewards]
    common.check_reward_names(names, "--reward_fn / --reward_model", ",".join(specs + paths))
    # weights: r = sum_k w_k r_k, before the group normalisation (as TRL's reward_weights)
    return rewards, common.parse_reward_weights(args.reward_weights, names)


@torch.no_grad()
def score(rewards, prompts, texts, completion_ids, columns, args, group_size=1, step=0, logs=None, completions=None):
    """Rewards of each source for N completions in groups of G: (N, K), NaN where a reward
    function returned None. `prompts` are the dataset's prompts (text or conversations), `texts`
    the decoded completions, `completion_ids` their token ids, `columns` the other dataset columns,
    `logs` what the functions log (log_metric, log_extra); `completions`: the messages of a
    tool-using exchange (assistant and tool turns) instead of the texts."""
    if completions is None:
        completions = sampling.reward_completions(prompts, texts)  # TRL's form: text, or an assistant message
    # the reward functions first, all in one call (async ones run concurrently), as load_rewards orders them
    fns = [r["fn"] for r in rewards if "fn" in r]
    out = [common.call_reward_fns(fns, prompts, completions, completion_ids, columns, group_size, step, args.max_steps,
                                  logs, every_row=False)]
    for r in rewards:
        if "model" in r:  # a reward model reads the text through its own tokenizer and chat template
            scores = sampling.score_texts(r["model"], r["tokenizer"], prompts, completions, args.eval_batch_size,
                                          args.max_prompt_length)
            out.append((scores - getattr(r["model"].config, "reward_mean", 0.0))[:, None])  # reward.py's training mean
    return torch.cat(out, 1)  # (N, K)


@torch.no_grad()
def evaluate(model, tokenizer, eval_ds, rewards, weights, eval_fns, args, step=0):
    """--eval_dataset: the mean reward (under this run's weighted rewards) of one greedy
    completion per held-out prompt, and each source's mean; and the mean of each --eval_reward_fn
    function (`eval_fns`, {name: fn}) on the same completions, which eval_reward leaves out."""
    raw = eval_ds["prompt"]
    prompts = [data.render_prompt(tokenizer, p) for p in raw]
    texts, _, completion_ids = sampling.sample_texts(model, tokenizer, prompts, args.max_completion_length,
                                                     args.eval_batch_size, do_sample=False)
    columns = {c: list(eval_ds[c]) for c in eval_ds.column_names if c != "prompt"}  # lists, not `datasets` Columns
    per_source = score(rewards, raw, texts, completion_ids, columns, args, step=step)  # (N, K)
    # --eval_reward_fn: the same completions, called as the training rewards are (no second generation)
    held_out = common.call_reward_fns(list(eval_fns.values()), raw, sampling.reward_completions(raw, texts), completion_ids,
                                      columns, step=step, max_steps=args.max_steps, every_row=False)  # (N, K_eval)
    # the means over the completions each reward applies to (TRL's nanmean)
    return {"eval_reward": float(common.weighted_rewards(per_source, weights).nanmean()),
            **{f"eval_rewards/{r['name']}/mean": float(per_source[:, k].nanmean()) for k, r in enumerate(rewards)},
            **{f"eval_rewards/{name}/mean": float(held_out[:, k].nanmean()) for k, name in enumerate(eval_fns)}}


# ============================================================================ one rollout's pieces
def check_rewards(reward, num_generations, step):
    """A NaN reward means that no reward function applied: it is left out of the baseline and gets
    A = 0 (TRL), and the run says so; any other non-finite reward stops the run."""
    unscorable = reward.isnan()
    if unscorable.any():
        i, G = int(unscorable.nonzero()[0]), num_generations
        print(f"{common.script_name()}: warning: every reward function returned None for completion {i % G} of "
              f"prompt {i // G} ({int(unscorable.sum())} such completions this batch): advantage 0, as TRL.")
    common.check_finite("reward", reward[~unscorable], step + 1)


def rollout_metrics(rollout, reward, rewards_per_source, reward_names, reward_logs, num_generations):
    """TRL's metrics of one micro-batch's rollout: means over the completions each reward applies
    to (TRL's nanmean), what the reward functions log_metric, lengths in the model's own tokens, and
    the tool calls per completion and the share of them that failed where tools ran."""
    group_std = nanstd(reward.view(-1, num_generations), 1)  # (B,)
    lengths = rollout.completion_mask.sum(1).float()
    metrics = {"reward": reward.nanmean(), "reward_std": group_std.nanmean(),
               "frac_reward_zero_std": torch.isclose(group_std, torch.zeros_like(group_std)).float().mean(),
               **{f"rewards/{n}/mean": rewards_per_source[:, k].nanmean() for k, n in enumerate(reward_names)},
               **{f"rewards/{n}/std": nanstd(rewards_per_source[:, k]) for k, n in enumerate(reward_names)},
               **{name: sum(v) / len(v) for name, v in reward_logs["metrics"].items()},  # log_metric
               "completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
               "completions/max_length": lengths.max(), "completions/clipped_ratio": rollout.truncated.float().mean()}
    if rollout.tool_calls is not None:
        calls = torch.tensor([rollout.tool_calls, rollout.tool_failures], dtype=torch.float)
        metrics.update({"tools/call_frequency": calls[0] / len(rollout.texts),
                        "tools/failure_frequency": calls[1] / calls[0].clamp(min=1)})
    return metrics


@torch.no_grad()
def reference_logprobs(ref_model, prompt_ids, prompt_mask, rollout, temperature):
    """log pi_ref of the sampled tokens in the context the policy read (with --use_peft: the policy
    with its adapters off); None without a reference (beta == 0)."""
    if ref_model is None:
        return None
    with lora.adapters_off(ref_model):
        return sampling.completion_logprobs(ref_model, prompt_ids, prompt_mask, rollout.completion_ids,
                                            rollout.attention_mask, temperature)


def micro_batch(scored, ref_model, args):
    """What the update reads of one micro-batch's rollout (sample_and_score): prompts, completions,
    the masks of what the model read and of what is trained (`trained_mask`), the reward (to become
    advantages), the reference's log-probs, and the sampler's own log-probs where another engine
    sampled (`sampler_correction`); pi_old's come with the first update."""
    rollout, prompt_ids, prompt_mask = scored["rollout"], scored["prompt_ids"], scored["prompt_mask"]
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": rollout.completion_ids,
            "attention_mask": rollout.attention_mask, "completion_mask": trained_mask(rollout, args),
            "reward": scored["reward"], "old_logprobs": None, "sampling_logprobs": rollout.sampling_logprobs,
            "ref_logprobs": reference_logprobs(ref_model, prompt_ids, prompt_mask, rollout, args.temperature)}


def trained_mask(rollout, args):
    """The tokens the loss is taken over: the model's own (never tool replies); with
    --mask_truncated_completions none of a completion without EOS, whose reward judged an
    unfinished text (its reward still shapes the group's baseline)."""
    if args.mask_truncated_completions:
        return rollout.completion_mask * (~rollout.truncated[:, None]).long()
    return rollout.completion_mask


def log_completions(args, step, scored, advantages, raw_prompts, reward_names):
    """--log_completions: a micro-batch's (sample_and_score) prompts, completions, each reward, the
    weighted reward, the advantage and the reward functions' log_extra columns."""
    if not args.log_completions:
        return
    per_source = scored["rewards_per_source"]
    tracking.log_completions(args, step, [raw_prompts[i] for i in scored["group"]], scored["rollout"].texts, {
        **{n: per_source[:, k] for k, n in enumerate(reward_names)}, "reward": scored["reward"],
        "advantage": advantages, **scored["reward_logs"]["extra"]})


def sample_and_score(sampler, model, world, idx, step, micro):
    """Steps 1 and 2 for the prompts `idx` (dataset rows): G completions of each through the run's
    sampler (rlhf/rollouts.py), seeded by (step, micro), then every reward source and the weighted
    sum. Returns the prompts' ids and mask (B, P), the Rollout (B*G rows, groups consecutive), each
    row's prompt index, the rewards (B*G, K) and (B*G,), what the reward functions logged, and how
    many completions had no EOS."""
    args, G, tokenizer, raw = world["args"], world["args"].num_generations, world["tokenizer"], world["raw_prompts"]
    prompt_ids, prompt_mask = data.encode_prompts(tokenizer, [world["prompts"][i] for i in idx], args.max_prompt_length,
                                                  world["device"])
    # (B*G, C): every pass reads each prompt once for its G samples
    rollout = rollouts.sample(sampler, model, prompt_ids, prompt_mask, [raw[i] for i in idx], G, (step, micro))
    group = [i for i in idx for _ in range(G)]
    reward_logs = {"metrics": {}, "extra": {}}  # what the reward functions log_metric / log_extra
    rewards_per_source = score(world["rewards"], [raw[i] for i in group], rollout.texts, rollout.completion_id_lists(),
                               {c: [v[i] for i in group] for c, v in world["columns"].items()},
                               args, G, step, reward_logs, rollout.messages)  # (N, K), NaN where a function returned None
    reward = common.weighted_rewards(rewards_per_source, world["weights"])  # (N,): sum over the rewards that apply
    check_rewards(reward, G, step)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "rollout": rollout, "group": group,
            "rewards_per_source": rewards_per_source, "reward": reward, "reward_logs": reward_logs,
            "num_truncated": int(rollout.truncated.sum())}


def tied_groups(reward, num_generations):
    """(B,) True for each group whose rewards are all equal (NaNs aside): its advantages are all 0,
    so it carries no policy gradient, only the KL term (DAPO Sec. 3.2)."""
    grouped = reward.view(-1, num_generations)  # (B, G)
    spread = grouped.nan_to_num(float("-inf")).amax(1) - grouped.nan_to_num(float("inf")).amin(1)
    return ~(spread > 0)  # a group with < 2 scorable rewards counts as tied


def refill_tied_groups(scored, sampler, model, world, step, micro):
    """DAPO's dynamic sampling (Yu et al. 2025, Sec. 3.2) with --dynamic_sampling: the groups of a
    sample_and_score result whose rewards all tie are dropped, and fresh prompts are sampled and
    scored, B at a time (at most --max_resample times), until the micro-batch holds B groups with
    a reward spread again. Past the bound, dropped groups fill the rest (they train the KL only),
    so every micro-batch keeps B*G rows. Returns the refilled result and its metrics:
    dynamic_sampling/{dropped_groups, refilled_groups, resamples, unfilled_groups}. Without the
    flag: the result unchanged, no metrics."""
    args, G = world["args"], world["args"].num_generations
    if not args.dynamic_sampling:
        return scored, {}
    B, parts = args.batch_size, [scored]
    keep, tied = [], []  # (part, group) pairs
    for k in range(args.max_resample + 1):
        if k:  # fresh prompts: another data order, a sampling seed past the step's micro-batches
            idx = data.rank_batch(len(world["prompts"]), B, args.seed + k,
                                  (step // args.num_iterations) * args.gradient_accumulation_steps + micro)
            parts.append(sample_and_score(sampler, model, world, idx, step, micro + k * args.gradient_accumulation_steps))
        for g, is_tied in enumerate(tied_groups(parts[-1]["reward"], G).tolist()):
            (tied if is_tied else keep).append((k, g))
        # every rank samples as often as the one that needs the most (generation is lockstep under ddp/fsdp2)
        if parallel.all_reduce(float(len(keep) < B), "sum") == 0:
            break
    metrics = {"dynamic_sampling/dropped_groups": len(tied), "dynamic_sampling/resamples": len(parts) - 1,
               "dynamic_sampling/refilled_groups": sum(k > 0 for k, _ in keep[:B]),
               "dynamic_sampling/unfilled_groups": max(B - len(keep), 0)}
    return take_groups(parts, sorted((keep + tied)[:B]), G, world["tokenizer"].pad_token_id), metrics


def take_groups(parts, chosen, num_generations, pad_token_id):
    """One sample_and_score result made of the groups `chosen` ((part, group) pairs, sorted) of
    several: prompts left-padded and completions right-padded to the longest."""
    G = num_generations
    width = max(p["prompt_ids"].shape[1] for p in parts)
    by_part = [[g for k, g in chosen if k == part] for part in range(len(parts))]
    rows = [[g * G + j for g in groups for j in range(G)] for groups in by_part]  # each part's rows, groups consecutive

    def gather(name, value=None):  # the chosen rows (or prompts, with value: left-padded to `width`) of every part
        if value is None:
            return torch.cat([p[name][r] for p, r in zip(parts, rows)])
        return torch.cat([torch.nn.functional.pad(p[name][g], (width - p[name].shape[1], 0), value=value)
                          for p, g in zip(parts, by_part)])

    def listed(values_of):  # the chosen rows of a per-row list of every part
        return [values_of(p)[i] for p, r in zip(parts, rows) for i in r]

    logs = [p["reward_logs"] for p in parts]
    extra = {c: listed(lambda p: p["reward_logs"]["extra"][c]) for c in logs[0]["extra"]
             if all(len(log["extra"].get(c, ())) == len(p["group"]) for log, p in zip(logs, parts))}
    return {"prompt_ids": gather("prompt_ids", pad_token_id), "prompt_mask": gather("prompt_mask", 0),
            "rollout": rollouts.concat([rollouts.take_rows(p["rollout"], r) for p, r in zip(parts, rows) if r], pad_token_id),
            "group": listed(lambda p: p["group"]), "rewards_per_source": gather("rewards_per_source"),
            "reward": gather("reward"),
            "reward_logs": {"metrics": {n: [v for log in logs for v in log["metrics"].get(n, [])] for n in logs[0]["metrics"]},
                            "extra": extra},
            "num_truncated": sum(p["num_truncated"] for p in parts)}

# ============================================================================ main
def main():
    script = common.script_name()  # a fork (my_grpo.py) prints, and shows its progress, under its own name
    args = common.apply_defaults(common.parse_args(Args), EMBEDDED_DEFAULTS)
    if args.estimate_memory:
        print_memory_plan(args)
    validate(args)  # after the plan, which reads only config.json and exits
    G = args.num_generations  # completions per prompt; rows i*G..(i+1)*G-1 are prompt i's group
    parallel.init_distributed()  # under torchrun: join the process group (only rank 0 prints); a no-op otherwise
    common.set_seed(args.seed + parallel.rank())  # rank-offset global RNG; the samples draw from sampling_kwargs' seed
    device = common.device()

    # ---- data: prompt-only rows (TRL's format); every other column goes to the reward functions
    ds, eval_ds = data.prompt_data(args, "GRPO")
    extra_columns = [c for c in ds.column_names if c != "prompt"]
    tool_list = tools.load_tools_for_prompts(args.tools, ds["prompt"], args.dataset)  # --tools: schemas go to every prompt
    schemas = [t.schema for t in tool_list] or None
    # --num_train_epochs: each rollout of batch_size prompts (per micro-batch) serves num_iterations steps
    data.set_max_steps(args, len(ds) * args.num_iterations,
                       args.batch_size * args.gradient_accumulation_steps * parallel.world_size())
    common.print_step(args.batch_size * args.gradient_accumulation_steps * parallel.world_size(), G, args.batch_size * G,
                      f"per_device_train_batch_size={args.batch_size * G}, num_generations={G}, "
                      f"gradient_accumulation_steps={args.gradient_accumulation_steps}")

    # ---- models: policy (LoRA adapters on a frozen base with --use_peft), reference (only if beta > 0), rewards
    tokenizer = common.load_tokenizer(args.model, args.trust_remote_code)
    data.check_renders_tools(tokenizer, ds["prompt"][0], schemas, "--tools")  # never run without the schemas, silently
    model = common.load_model(args.model, args, adapters=True)
    common.disable_dropout(model).train()  # dropout off by zeroing it (TRL's disable_dropout), training mode
    model = parallel.distribute(model, args)  # --parallel ddp | fsdp2 under torchrun
    # the KL anchor: the starting policy, frozen (with --use_peft: the policy's base, adapters off)
    ref_model = common.reference_of(model, args) if args.beta else None
    rewards, weights = load_rewards(args)
    reward_names = [r["name"] for r in rewards]
    eval_fns = common.load_eval_reward_fns(args.eval_reward_fn, reward_names)  # {name: fn}, scored, never trained on
    common.check_reward_datasets([r["fn"] for r in rewards if "fn" in r], eval_fns.values(), ds, eval_ds, args)
    raw_prompts = list(ds["prompt"])  # what reward functions see: text or conversations (a list: read every step)
    prompts = [data.render_prompt(tokenizer, p, schemas) for p in raw_prompts]  # what the policy sees
    data.check_readable(tokenizer, prompts, args.model, args.dataset)
    column_values = {c: list(ds[c]) for c in extra_columns}
    # what sampling and scoring a batch of prompt indices reads (sample_and_score)
    world = {"tokenizer": tokenizer, "prompts": prompts, "raw_prompts": raw_prompts, "columns": column_values,
             "rewards": rewards, "weights": weights, "args": args, "device": device}
    truncated_counts = data.truncation_counts(tokenizer, prompts, None, args, script)  # + completions as sampled
    print(f"{script}: {len(ds)} prompts from {data.dataset_name(args.dataset)}, rewards {reward_names} "
          f"(weights {[round(w, 6) for w in weights.tolist()]}, --scale_rewards {args.scale_rewards}), "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{args.batch_size} x {G} completions per micro-batch, device {device}")

    # ---- optimizer, resume, and the sampler (plain, --use_vllm or --tools: rlhf/rollouts.py)
    optimizer = common.make_optimizer(model, args)
    scheduler = common.make_scheduler(optimizer, args)
    start_step = checkpoints.maybe_resume(args, model, optimizer, scheduler)  # --resume: 0 if not resuming
    logger = tracking.MetricsLogger(args, start_step, model)  # + each step's time, throughput and MFU
    sampler = rollouts.start(model, tokenizer, args, args.max_completion_length, tool_list)
    frozen = {"reference model": None if ref_model is model else ref_model,  # for memory.json
              "reward model": [r["model"] for r in rewards if "model" in r]}

    # ---- loop
    start = time.time()
    pbar = tracking.progress(args, start_step, desc=script)
    eval_metrics = {}  # the last --eval_dataset evaluation, for summary.json
    for step in pbar:
        # 1. rollout: a fresh batch every num_iterations steps, reused (off-policy) in between
        if step % args.num_iterations == 0:
            batches, metrics_per_micro = [], []
            sync_metrics = rollouts.load_weights(sampler, model)  # the sampler samples with the current weights
            for micro in tracking.within(range(args.gradient_accumulation_steps), "sampling"):
                # this rank's prompts of the global batch; the rollout's number is the position in the data
                idx = data.rank_batch(len(ds), args.batch_size, args.seed,
                                      (step // args.num_iterations) * args.gradient_accumulation_steps + micro)
                # 1-2. G completions of each prompt (rows i*G..(i+1)*G-1), scored by every reward source, weighted
                s = sample_and_score(sampler, model, world, idx, step, micro)
                # DAPO's dynamic sampling (--dynamic_sampling): groups whose rewards all tie give way to fresh prompts'
                s, refill_metrics = refill_tied_groups(s, sampler, model, world, step, micro)
                truncated_counts["completions_truncated"] += s["num_truncated"]  # no EOS within the length
                metrics_per_micro.append({**rollout_metrics(s["rollout"], s["reward"], s["rewards_per_source"], reward_names,
                                                            s["reward_logs"], G), **refill_metrics})

                # 3. the reference's log-probs (the sampling policy's come with the first update)
                batches.append(micro_batch(s, ref_model, args))
            rollouts.release(sampler)  # the sampler frees what it holds for the update, where it can
            # 4. group-relative advantages and the loss's normalisers, over every micro-batch on every rank
            advantages = batch_advantages([b.pop("reward") for b in batches], G, args.scale_rewards, args.advantage_estimator,
                                          [b["completion_mask"].sum(1) for b in batches])
            for b, a in zip(batches, advantages):
                b["advantages"] = a.to(device)  # (N,)
            num_sequences, num_tokens = batch_normalisers([b["completion_mask"] for b in batches])
            rollout_tokens = sum(int(b["prompt_mask"].sum()) * G + int(b["completion_mask"].sum()) for b in batches)

        # 5. update: one optimizer step over the rollout's micro-batches
        step_metrics = []
        for mb in tracking.within(batches, "update"):
            # log pi(y_t | x, y_<t) in the full context the model read; the loss weighs them by completion_mask
            logprobs, entropy = sampling.completion_logprobs(model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                                             mb["attention_mask"], args.temperature, with_entropy=True)
            # the first update of a rollout runs on the weights that sampled it: pi_old == pi, ratio exactly 1
            if mb["old_logprobs"] is None:
                mb["old_logprobs"] = logprobs.detach()
                mb["is_weights"], mb["gap"] = sampler_correction(mb, args)
            loss, metrics = grpo_loss(logprobs, mb["old_logprobs"], mb["ref_logprobs"], mb["advantages"],
                                      mb["completion_mask"], args, num_sequences, num_tokens, mb["is_weights"])
            common.check_finite("loss", loss, step + 1)  # stop before a NaN reaches the weights
            if loss.requires_grad:  # False only when every completion is masked (all truncated)
                loss.backward()
            metrics.update(loss=loss.detach(), entropy=masked_mean(entropy, mb["completion_mask"]), **mb["gap"])
            step_metrics.append(metrics)
            del logprobs, entropy, loss
        memory.log_memory(args.output_dir, model, optimizer, frozen=frozen)  # memory.json, once, at the first full step
        grad_norm = common.optimizer_step(optimizer, args.max_grad_norm, step + 1)  # clip, NaN guard, step, bf16 rounding
        scheduler.step()

        # 6. log (means over the --logging_steps window), evaluate and save
        metrics = tracking.mean_metrics(step_metrics)
        metrics["loss"] *= len(step_metrics)  # micro-batch losses are parts of one sum
        logger.update({**tracking.mean_metrics(metrics_per_micro), **metrics, **sync_metrics, "grad_norm": grad_norm},
                      num_tokens=rollout_tokens)  # prompt + completion tokens trained on in this step
        if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
            logger.log(step + 1, {"learning_rate": scheduler.get_last_lr()[0]}, pbar)
            log_completions(args, step + 1, s, batches[-1]["advantages"], raw_prompts, reward_names)  # the last micro-batch
        if eval_ds is not None and args.eval_steps and (step + 1) % args.eval_steps == 0 and step + 1 < args.max_steps:
            eval_metrics = evaluate(model, tokenizer, eval_ds, rewards, weights, eval_fns, args, step + 1)
            logger.log_eval(step + 1, eval_metrics)
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoints.save_checkpoint(model, tokenizer, args, f"{args.output_dir}/checkpoint-{step + 1}",
                                        checkpoints.training_state(step + 1, optimizer, scheduler))
    train_seconds = time.time() - start

    # ---- final save, then the final evaluation: an evaluation that fails never costs the trained model
    checkpoints.save_final(model, tokenizer, args)
    if eval_ds is not None and args.max_steps > start_step:
        eval_metrics = evaluate(model, tokenizer, eval_ds, rewards, weights, eval_fns, args, args.max_steps)
        logger.log_eval(args.max_steps, eval_metrics)
    logger.close()
    truncated_counts["completions_truncated"] = round(parallel.all_reduce(float(truncated_counts["completions_truncated"]), "sum"))
    summary = {"train_seconds": train_seconds, "seconds_per_step": train_seconds / max(args.max_steps - start_step, 1),
               **(tracking.mean_metrics(metrics_per_micro) if args.max_steps > start_step else {}), **eval_metrics,
               **truncated_counts}
    finish(model, tokenizer, args, summary, sampler, train_seconds)


def finish(model, tokenizer, args, summary, sampler, train_seconds):
    """The end of a run: the truncation count, the embedded world's test gold score, summary.json
    (then the output folder's lock goes), and the sampler stopped last."""
    script = common.script_name()
    if summary["completions_truncated"]:
        print(f"{script}: {summary['completions_truncated']} sampled completions reached --max_completion_length "
              f"{args.max_completion_length} without EOS")
    if args.dataset == common.EMBEDDED:
        ev = common.gold_eval(model, tokenizer, args)
        summary.update(ev)
        print(f"{script}: test gold score {ev['gold_score']:.3f}; e.g. {ev['samples'][0]!r}")
    checkpoints.finish_run(args, summary)  # summary.json, then the lock goes
    # last: vLLM's shutdown destroys the default process group (vllm_rollouts.shutdown), after which
    # every rank would take itself for rank 0 (two summary.json writers) and collectives stop
    rollouts.stop(sampler)
    print(f"{script}: {train_seconds:.0f} s of training; {checkpoints.saved_where(args)}")


if __name__ == "__main__":
    main()
