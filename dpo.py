"""dpo.py: Direct Preference Optimization (Rafailov et al. 2023), offline and online. Recipes,
the embedded world's tuning and evidence: docs/dpo.md.

DPO trains the policy directly on preference pairs (x, y_w, y_l), with no reward model and no
value network. Its loss (Eq. 7) is a logistic loss on the difference of implicit rewards
r(x, y) = beta * log pi_theta(y|x) / pi_ref(y|x):

    L = -log sigmoid( beta * [ (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x)) ] )

where log pi(y|x) is the *sum* of the completion's per-token log-probs. --loss_type ipo
(Azar et al. 2023, Eq. 17) and robust (Chowdhury et al. 2024, Eq. 9), --label_smoothing
(conservative DPO) and --rpo_alpha (RPO's NLL on y_w, Pang et al. 2024) are in `dpo_loss`
and `chosen_nll`.

Memory (the design document's "over 50% less"): the reference is the initial policy, frozen.
Offline, its log-probs never change, so with --precompute_ref_logps (on by default) they are
computed once for the whole dataset before the first update, and training holds one model.

Online (iterative) DPO, --online (Guo et al. 2024; TRL's OnlineDPOTrainer): each step the current
policy samples two completions per prompt, a judge labels the better one (the gold judge on the
embedded world, --reward_model, or --reward_fn), and DPO trains on these fresh pairs.

Departures from the paper and from TRL:
- The reference log-probs are computed by the policy itself in eval mode before its first update
  (it *is* the reference then), so no second model is ever loaded; TRL loads a reference and
  drops it. (TRL's name: precompute_ref_log_probs.)
- `ipo` uses per-token mean log-probs, as TRL does (the paper leaves it open); `sigmoid` and
  `robust` use sums, as in the DPO paper.
- Online: pairs whose two samples get equal scores carry no preference; they are skipped and
  counted (`ties`), where TRL keeps them with an arbitrary label. The reference stays loaded
  (fresh samples need fresh reference log-probs), so online DPO holds two models.
- --eval_dataset holds preference pairs offline and online alike: the held-out loss, reward
  accuracy and margin against the reference (precomputed for it too).
- Defaults suit a pretrained model; the embedded world's tiny policy has its own, tuned to it
  (`embedded_defaults`, docs/dpo.md).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

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


@dataclass
class Args(SamplingArgs):
    # model and data
    max_prompt_length: int = field(default=512, metadata={"help": "Prompts are cut to their last this-many tokens."})
    max_completion_length: int = field(default=256, metadata={"help": "Chosen/rejected completions are cut to their first this-many tokens (EOS included)."})
    # generation (online only)
    max_new_tokens: int = field(default=64, metadata={"help": "Online: most tokens sampled per completion."})
    temperature: float = field(default=0.9, metadata={"help": "Online: sampling temperature of the two completions per prompt."})
    # algorithm
    beta: float = field(default=0.1, metadata={"help": "KL strength: the implicit reward is beta * log pi/ref (Eq. 7)."})
    loss_type: str = field(default="sigmoid", metadata={"help": "sigmoid (DPO, Eq. 7) | ipo (Azar et al. 2023) | robust (Chowdhury et al. 2024)."})
    label_smoothing: float = field(default=0.0, metadata={"help": "Assumed probability that a label is flipped: conservative DPO (sigmoid) or robust DPO; in [0, 0.5)."})
    rpo_alpha: float = field(default=0.0, metadata={"help": "Weight of an NLL loss on the chosen responses added to the DPO loss (RPO; TRL's rpo_alpha); 0: off."})
    precompute_ref_logps: bool = field(default=True, metadata={"help": "Offline: compute the reference log-probs once before training, so training holds one model."})
    online: bool = field(default=False, metadata={"help": "Online DPO: each step, sample two completions per prompt and label them with the judge (default output runs/dpo_online)."})
    reward_model: str = field(default="", metadata={"help": "Online judge: a reward model folder saved by reward.py."})
    reward_fn: str = field(default="", metadata={"help": "Online judge: comma-separated reward functions (gold, file.py:function, ...; TRL's contract: docs/usage.md)."})
    reward_weights: str = field(default="", metadata={"help": "Comma-separated weights, one per --reward_fn (default: all 1)."})
    # optimisation
    max_steps: int = field(default=250, metadata={"help": "Optimizer steps; offline cycles through the pairs as needed."})
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (TRL's DPOConfig)."})
    lr_scheduler_type: str = field(default="linear", metadata={"help": "Any transformers scheduler name."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up steps."})
    batch_size: int = field(default=8, metadata={"help": "Preference pairs (offline) or prompts (online) per micro-batch."})


def embedded_defaults(args):
    """The values tuned for the embedded world's tiny policy (common.apply_defaults; docs/dpo.md):
    online pairs are exact and on-policy, so they take a larger step than the annotators' noisy
    offline pairs; RPO's NLL term answers those noisy pairs, so other datasets train plain DPO."""
    rpo = not args.online and args.dataset == common.EMBEDDED
    return {"learning_rate": 3e-4 if args.online else 1e-5, "rpo_alpha": 1.0 if rpo else 0.0,
            "max_steps": 250 if args.online else 500, "max_new_tokens": 48, "temperature": 0.7, "batch_size": 32,
            "warmup_steps": 5}


def validate(args):
    """The checks main() needs before anything loads."""
    common.check_choice("--loss_type", args.loss_type, ["sigmoid", "ipo", "robust"])
    if not 0 <= args.label_smoothing < 0.5:
        common.fail(f"--label_smoothing must be in [0, 0.5), got {args.label_smoothing}.")
    if args.loss_type == "ipo" and args.label_smoothing:
        common.fail("--label_smoothing applies to --loss_type sigmoid or robust, not ipo.")
    if args.beta <= 0:
        common.fail(f"--beta must be positive, got {args.beta}.")
    if (args.reward_model or args.reward_fn) and not args.online:
        common.fail("--reward_model and --reward_fn label online samples; add --online.")
    sampling_flags = [f for f in ("top_p", "top_k", "min_p", "repetition_penalty", "log_completions") if common.passed(f)]
    if sampling_flags and not args.online:
        common.fail(f"--{', --'.join(sampling_flags)} shape or show online samples; add --online.")
    if args.reward_model and args.reward_fn:
        common.fail("pass one online judge: --reward_model or --reward_fn, not both.")
    if args.use_vllm:
        if not args.online:
            common.fail("--use_vllm samples online pairs; add --online (offline DPO samples nothing).")
        vllm_rollouts.check_args(args)
    return args


def print_memory_plan(args):
    """--estimate_memory: what DPO holds (the policy, a reference unless precomputed, online a judge)."""
    live_ref = args.online or not args.precompute_ref_logps
    memory.print_plan(args, reference=True if live_ref else "log-probs precomputed (--precompute_ref_logps)",
                      reward_models=[args.reward_model] if args.online else [],
                      reward_note="the --reward_fn judge" if args.online else "implicit in DPO",
                      train_sequences=2 * args.batch_size, train_prompts=args.batch_size,
                      generation_sequences=2 * args.batch_size if args.online else 0,
                      **dict(zip(["prompt_length", "completion_length"], memory.data_lengths(
                          args, "rl" if args.online else "prefs", args.max_new_tokens if args.online else "data"))))


# ------------------------------------------------------------------------ the DPO loss
def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, loss_type="sigmoid",
             label_smoothing=0.0):
    """Per-pair losses and implicit rewards; all inputs (B,) sequence log-probs.

    Returns (losses, chosen_rewards, rejected_rewards), each (B,); rewards are detached.
    """
    # h = log pi/ref (y_w) - log pi/ref (y_l): the implicit reward margin divided by beta
    logits = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)  # (B,)
    eps = label_smoothing
    if loss_type == "sigmoid":
        # DPO, Rafailov et al. 2023, Eq. 7; with eps > 0 conservative DPO (cDPO, Mitchell 2023):
        # the expected loss when a label is flipped with probability eps
        losses = -(1 - eps) * F.logsigmoid(beta * logits) - eps * F.logsigmoid(-beta * logits)
    elif loss_type == "robust":
        # robust DPO, Chowdhury et al. 2024, Eq. 9: an unbiased estimate of the clean-label loss
        losses = (-(1 - eps) * F.logsigmoid(beta * logits) + eps * F.logsigmoid(-beta * logits)) / (1 - 2 * eps)
    elif loss_type == "ipo":
        # IPO, Azar et al. 2023, Eq. 17: regress the log-ratio margin onto 1 / (2 beta)
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps).detach()  # r(x, y_w), Eq. 5 up to log Z(x)
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


def chosen_nll(chosen_logps, chosen_mask, loss_type):
    """RPO's extra term (Pang et al. 2024, Iterative Reasoning Preference Optimization): the
    negative log-likelihood of the chosen responses per token, mean over pairs. DPO alone only
    widens the margin and can lower the likelihood of y_w too; this keeps raising it.
    `chosen_logps` are pair_logps' values (sums, or per-token means for ipo), `chosen_mask`
    (B, C) their completion mask."""
    per_token = chosen_logps if loss_type == "ipo" else chosen_logps / chosen_mask.sum(1).clamp(min=1)
    return -per_token.mean()


def pair_logps(model, batch, loss_type):
    """log pi(y|x) of chosen and rejected in one forward: a batch of prompts (B, P) and
    completions (2B, C) with the chosen ones first. Returns (chosen_logps, rejected_logps), each (B,).

    The rows go in as c_0, r_0, c_1, r_1, ..., so each prompt is encoded once for both of its
    responses (sampling.completion_logprobs shares it)."""
    B = batch["prompt_ids"].shape[0]
    pairs = torch.arange(2 * B, device=batch["completion_ids"].device).view(2, B).t().reshape(-1)  # (2B,): 0, B, 1, B+1, ...
    completion_ids, completion_mask = batch["completion_ids"][pairs], batch["completion_mask"][pairs]
    logprobs = sampling.completion_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                            completion_ids, completion_mask)  # (2B, C)
    logps = logprobs.sum(1)  # (2B,) sequence log-prob = sum of per-token log-probs
    if loss_type == "ipo":  # IPO on per-token means (see the module docstring)
        logps = logps / completion_mask.sum(1).clamp(min=1)
    logps = logps.view(B, 2)
    return logps[:, 0], logps[:, 1]


def encode_pairs(tokenizer, prompts, chosen, rejected, args, stop_ids):
    """Token ids and masks of a batch of rendered (prompt, chosen, rejected) texts, on the device;
    a completion ending in one of `stop_ids` (sampling.stop_token_ids) gets no extra EOS."""
    prompt_ids, prompt_mask = data.encode_prompts(tokenizer, prompts, args.max_prompt_length)  # (B, P)
    completion_ids, completion_mask = data.encode_completions(
        tokenizer, chosen + rejected, args.max_completion_length, stop_ids)  # (2B, C): chosen first
    dev = common.device()
    return {"prompt_ids": prompt_ids.to(dev), "prompt_mask": prompt_mask.to(dev),
            "completion_ids": completion_ids.to(dev), "completion_mask": completion_mask.to(dev)}


@torch.no_grad()
def precompute_ref_logps(model, tokenizer, prompts, chosen, rejected, args):
    """One pass of the (still untrained, hence reference) model over the dataset: (N, 2) of
    (ref_chosen_logps, ref_rejected_logps), kept on the CPU. With --use_peft: its base, adapters off."""
    was_training = model.training
    model.eval()  # the reference runs without dropout, as a frozen copy would
    out = []
    with lora.adapters_off(model):
        for i in range(0, len(prompts), args.eval_batch_size):
            s = slice(i, i + args.eval_batch_size)
            batch = encode_pairs(tokenizer, prompts[s], chosen[s], rejected[s], args, sampling.stop_token_ids(model, tokenizer))
            out.append(torch.stack(pair_logps(model, batch, args.loss_type), 1).cpu())  # (b, 2)
    model.train(was_training)
    return torch.cat(out)


# ------------------------------------------------------------------------ online: sample and judge
def make_judge(args, world_data):
    """The online judge: fn(prompts, completions, completion_ids, columns, step) -> (N,) scores of the
    completion texts, rows in pairs (the two samples of a prompt). A reward function is called as
    TRL calls it (common.call_reward_fns); a None reward stops the run (a pair needs two scores)."""
    if args.reward_model:
        rm, rm_tokenizer = common.load_reward_model(args.reward_model, args)

        def judge(prompts, completions, completion_ids, columns, step=0):
            return sampling.score_texts(rm, rm_tokenizer, prompts, completions, args.eval_batch_size,
                                        args.max_prompt_length)

        return judge, rm
    if not args.reward_fn and not world_data:
        common.fail("--online on your own --dataset needs a judge: pass --reward_model PATH (from reward.py) "
                    "or --reward_fn file.py:function.")
    fns, weights = common.load_reward_fns(args.reward_fn or "gold", args.reward_weights)

    def judge(prompts, completions, completion_ids, columns, step=0):
        scores = common.call_reward_fns(fns, prompts, completions, completion_ids, columns, 2, step, args.max_steps)
        return common.weighted_rewards(scores, weights)

    return judge, None


def sample_pairs(model, tokenizer, prompts, columns, judge, args, position, sampler=None):
    """Two samples per prompt from the current policy, labelled by the judge.

    Returns the batch (prompt ids, completion ids with chosen first, masks) of the non-tied
    prompts, or None when every pair tied, the judge's metrics, and (prompts, texts, scores)
    of every sample for --log_completions.
    """
    texts = [data.render_prompt(tokenizer, p) for p in prompts]
    prompt_ids, prompt_mask = data.encode_prompts(tokenizer, texts, args.max_prompt_length, model.device)  # (B, P)
    # rows 2i and 2i+1 are the two samples of prompt i (rlhf/rollouts.py: plain or --use_vllm, the same contract)
    sampler = sampler or rollouts.Sampler(tokenizer, args, args.max_new_tokens)  # default: plain decoding
    rollout = rollouts.sample(sampler, model, prompt_ids, prompt_mask, prompts, 2, position)  # (2B, C)
    completion_ids, completion_mask, truncated = rollout.completion_ids, rollout.completion_mask, rollout.truncated
    texts = rollout.texts
    prompts2 = [p for p in prompts for _ in (0, 1)]  # each prompt's row, twice, to match the samples
    columns2 = {k: [x for x in v for _ in (0, 1)] for k, v in columns.items()}
    completions = sampling.reward_completions(prompts2, texts)  # TRL's form: text, or an assistant message
    scores = judge(prompts2, completions, sampling.completion_id_lists(completion_ids, completion_mask), columns2,
                   position[0]).view(-1, 2).t()  # (2, B): first and second samples
    common.check_finite("the judge's score", scores, position[0] + 1)  # a NaN would order the pair at random
    # label: the higher-scoring sample is chosen; equal scores carry no preference and are skipped
    keep = scores[0] != scores[1]  # (B,)
    first_wins = scores[0] > scores[1]
    first = 2 * torch.arange(len(prompts))  # row of each prompt's first sample
    chosen = torch.where(first_wins, first, first + 1)[keep]  # row of y_w
    rejected = torch.where(first_wins, first + 1, first)[keep]  # row of y_l
    metrics = {"objective/scores": scores.mean(),
               "objective/scores_margin": (scores.max(0).values - scores.min(0).values)[keep].mean() if keep.any() else 0.0,
               "val/contain_eos_token": 1 - truncated.float().mean(), "ties": int((~keep).sum())}
    samples = (prompts2, texts, scores.t().reshape(-1))  # scores back in the samples' order
    if not keep.any():
        return None, metrics, samples
    pick = torch.cat([chosen, rejected]).to(completion_ids.device)  # (2B',): chosen first
    keep = keep.to(prompt_ids.device)
    return {"prompt_ids": prompt_ids[keep], "prompt_mask": prompt_mask[keep],
            "completion_ids": completion_ids[pick], "completion_mask": completion_mask[pick]}, metrics, samples


@torch.no_grad()
def evaluate(model, ref_model, eval_ref, tokenizer, eval_texts, args, stop_ids):
    """--eval_dataset: the DPO loss, reward accuracy and margin on held-out pairs (dropout off),
    encoded as training encodes its pairs (the same `stop_ids`: sampling.stop_token_ids).
    The reference log-probs come from `eval_ref` (precomputed, (N, 2)) or from `ref_model`."""
    prompts, chosen, rejected = eval_texts
    was_training = model.training
    model.eval()
    out = []
    for i in range(0, len(prompts), args.eval_batch_size):
        s = slice(i, i + args.eval_batch_size)
        batch = encode_pairs(tokenizer, prompts[s], chosen[s], rejected[s], args, stop_ids)
        # the precomputed cache, or the frozen reference (--use_peft: the policy, adapters off), as in training
        ref_chosen_logps, ref_rejected_logps = reference_logps(eval_ref, ref_model, s, batch, args)
        chosen_logps, rejected_logps = pair_logps(model, batch, args.loss_type)
        out.append(torch.stack(dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                                        args.beta, args.loss_type, args.label_smoothing), 1).cpu())  # (b, 3)
    model.train(was_training)
    losses, chosen_rewards, rejected_rewards = torch.cat(out).unbind(1)
    return {"eval_loss": float(losses.mean()), "eval_rewards/chosen": float(chosen_rewards.mean()),
            "eval_rewards/rejected": float(rejected_rewards.mean()),
            "eval_rewards/accuracies": float((chosen_rewards > rejected_rewards).float().mean()),
            "eval_rewards/margins": float((chosen_rewards - rejected_rewards).mean())}


def render_triples(tokenizer, triples):
    """(prompt, chosen, rejected) rows -> three lists of texts, through the chat template."""
    return ([data.render_prompt(tokenizer, p) for p, _, _ in triples],
            [data.render_completion(tokenizer, p, c) for p, c, _ in triples],
            [data.render_completion(tokenizer, p, r) for p, _, r in triples])


# ------------------------------------------------------------------------ one step's pieces
def training_examples(args, tokenizer, stop_ids):
    """What training reads, and the truncation counts: offline the rendered (prompt, chosen,
    rejected) texts of the preference pairs; online the prompts and their other columns (the
    judge's)."""
    script = common.script_name()
    ds = data.training_data(args, "rl" if args.online else "prefs")
    if args.online:
        data.require_columns(ds, ["prompt"], args.dataset, "Online DPO samples completions for prompts.")
        data.check_text(ds, ["prompt"], args.dataset)
        prompts = list(ds["prompt"])
        columns = {k: list(ds[k]) for k in ds.column_names if k not in ("prompt", "completion", "chosen", "rejected")}
        data.check_readable(tokenizer, [data.render_prompt(tokenizer, p) for p in prompts[:16]], args.model, args.dataset)
        truncated = data.truncation_counts(tokenizer, [data.render_prompt(tokenizer, p) for p in prompts], None, args, script)
        return {"prompts": prompts, "columns": columns}, truncated
    prompts, chosen, rejected = render_triples(tokenizer, data.preference_triples(ds, args.dataset))
    data.check_readable(tokenizer, [p + c for p, c in zip(prompts, chosen)], args.model, args.dataset)
    truncated = data.truncation_counts(tokenizer, prompts, chosen + rejected, args, script, stop_ids)
    return {"prompts": prompts, "chosen": chosen, "rejected": rejected}, truncated


def training_pairs(examples, idx, position, model, tokenizer, judge, sampler, args, stop_ids):
    """A micro-batch of pairs: the dataset's rows `idx` (offline), or two fresh samples of each of
    its prompts labelled by the judge (online, `sample_pairs`). Returns the batch (None when every
    online pair tied), the judge's metrics, the samples for --log_completions and how many sampled
    completions had no EOS."""
    if "chosen" in examples:
        pick = {k: [examples[k][i] for i in idx] for k in ("prompts", "chosen", "rejected")}
        return encode_pairs(tokenizer, pick["prompts"], pick["chosen"], pick["rejected"], args, stop_ids), {}, None, 0
    batch, stats, samples = sample_pairs(model, tokenizer, [examples["prompts"][i] for i in idx],
                                         {k: [v[i] for i in idx] for k, v in examples["columns"].items()}, judge, args,
                                         position, sampler)
    return batch, stats, samples, round((1 - float(stats["val/contain_eos_token"])) * 2 * len(idx))


@torch.no_grad()
def reference_logps(ref_cache, ref_model, idx, batch, args):
    """(ref_chosen_logps, ref_rejected_logps), each (B,): from the precomputed cache, or a forward
    of the frozen reference (with --use_peft: the policy with its adapters off)."""
    if ref_cache is not None:
        return ref_cache[idx].to(common.device()).unbind(1)
    with lora.adapters_off(ref_model):
        return pair_logps(ref_model, batch, args.loss_type)


def step_metrics(rows):
    """The means of one step's micro-batches; online, the judge's metrics count the micro-batches
    whose pairs all tied too, and `ties` is the sum over every rank."""
    trained = [r for r in rows if "loss" in r]
    metrics = tracking.mean_metrics(trained) if trained else {}
    if "ties" in rows[-1]:
        judge_keys = [k for k in rows[-1] if k == "ties" or k.startswith(("objective/", "val/"))]
        metrics.update(tracking.mean_metrics([{k: r[k] for k in judge_keys} for r in rows]))
        metrics["ties"] = int(parallel.all_reduce(sum(r["ties"] for r in rows), "sum"))  # over all ranks
    return metrics


# ------------------------------------------------------------------------ main
def main():
    script = common.script_name()  # a fork (my_dpo.py) prints, and shows its progress, under its own name
    args = common.parse_args(Args, default_output_dir=lambda a: f"runs/{common.script_name()}_online" if a.online else "")
    args = common.apply_defaults(args, embedded_defaults(args))
    if args.estimate_memory:
        print_memory_plan(args)
    validate(args)  # after the plan, which reads only config.json and exits
    parallel.init_distributed()  # under torchrun: join the process group; a no-op otherwise
    common.set_seed(args.seed + parallel.rank())  # rank-offset global RNG; the samples draw from sampling_kwargs' seed
    device = common.device()
    embedded = args.dataset == common.EMBEDDED

    # ---- model and tokenizer (the policy starts as the reference; --use_peft: LoRA adapters on a frozen base)
    tokenizer = common.load_tokenizer(args.model, args.trust_remote_code)
    model = common.load_model(args.model, args, adapters=True)
    common.disable_dropout(model).train()  # dropout off by zeroing it (TRL's disable_dropout), training mode
    stop_ids = sampling.stop_token_ids(model, tokenizer)  # a completion already ending in one gets no extra EOS
    model = parallel.distribute(model, args)  # --parallel ddp | fsdp2 under torchrun

    # ---- data: rendered (prompt, chosen, rejected) texts offline; prompts (and their columns) online
    examples, truncated = training_examples(args, tokenizer, stop_ids)
    n_examples = len(examples["prompts"])
    eval_ds = data.eval_data(args)  # held-out preference pairs, online too
    eval_texts = render_triples(tokenizer, data.preference_triples(eval_ds, args.eval_dataset)) if eval_ds is not None else None
    data.set_max_steps(args, n_examples, args.batch_size * args.gradient_accumulation_steps * parallel.world_size())
    common.print_step(args.batch_size * args.gradient_accumulation_steps * parallel.world_size(), 2, 2 * args.batch_size,
                      f"per_device_train_batch_size={args.batch_size}, gradient_accumulation_steps={args.gradient_accumulation_steps}",
                      "" if args.online else "a pair's two responses")
    print(f"{script}: {n_examples} {'prompts' if args.online else 'preference pairs'} from "
          f"{data.dataset_name(args.dataset)}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"loss {args.loss_type}, beta {args.beta}, device {device}")

    # ---- the reference: precomputed log-probs (offline, one model), a frozen copy (two models), or
    # with --use_peft the policy's own base with its adapters off (one model); online, the judge
    ref_model, ref_cache, eval_ref, judge, judge_model = None, None, None, None, None
    if not args.online and args.precompute_ref_logps:
        ref_cache = precompute_ref_logps(model, tokenizer, examples["prompts"], examples["chosen"], examples["rejected"], args)
        if eval_texts:
            eval_ref = precompute_ref_logps(model, tokenizer, *eval_texts, args)  # (N_eval, 2)
    else:
        ref_model = common.reference_of(model, args)
    if args.online:
        judge, judge_model = make_judge(args, embedded)
    init = {}
    if embedded:
        init["init_gold_score"] = common.gold_eval(model, tokenizer, args)["gold_score"]
        print(f"{script}: gold score before training {init['init_gold_score']:.3f}")

    # ---- optimizer, resume, and the sampler of online pairs (rlhf/rollouts.py)
    optimizer = common.make_optimizer(model, args)
    scheduler = common.make_scheduler(optimizer, args)
    start_step = checkpoints.maybe_resume(args, model, optimizer, scheduler)  # --resume: 0 if not resuming
    logger = tracking.MetricsLogger(args, start_step, model)  # + each step's time, throughput and MFU
    sampler = rollouts.start(model, tokenizer, args, args.max_new_tokens)
    held = models_held(model, ref_model, judge_model)
    frozen = {"reference model": ref_model if held["models_alive"] == 2 else None, "reward model": judge_model}

    # ---- loop
    pbar = tracking.progress(args, start_step, desc=script)
    final, eval_metrics = {}, {}  # the last step's training loss and accuracy, the last evaluation
    for step in pbar:
        rows, num_tokens = [], 0
        sync_metrics = rollouts.load_weights(sampler, model)  # online: the sampler samples with the current weights
        for micro in tracking.within(range(args.gradient_accumulation_steps), "micro-batch"):
            # 1. the batch: dataset pairs (offline) or fresh samples labelled by the judge (online); this
            # rank's slice of the global micro-batch, whose number is the position in the data
            idx = data.rank_batch(n_examples, args.batch_size, args.seed, step * args.gradient_accumulation_steps + micro)
            batch, stats, samples, n_truncated = training_pairs(examples, idx, (step, micro), model, tokenizer, judge,
                                                                sampler, args, stop_ids)
            truncated["completions_truncated"] += n_truncated
            if batch is None:  # every pair tied: nothing to learn from this micro-batch
                rows.append(stats)
                continue
            # 2. reference log-probs: from the cache, or a forward of the frozen reference
            ref_chosen_logps, ref_rejected_logps = reference_logps(ref_cache, ref_model, idx, batch, args)  # (B,), (B,)
            # 3. policy log-probs and the DPO loss (Eq. 7), mean over pairs
            chosen_logps, rejected_logps = pair_logps(model, batch, args.loss_type)  # (B,), (B,)
            losses, chosen_rewards, rejected_rewards = dpo_loss(
                chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                args.beta, args.loss_type, args.label_smoothing)
            loss = losses.mean()
            nll = None
            if args.rpo_alpha:  # RPO: DPO + alpha * NLL of the chosen responses
                nll = chosen_nll(chosen_logps, batch["completion_mask"][:chosen_logps.shape[0]], args.loss_type)  # chosen rows first
                loss = loss + args.rpo_alpha * nll
            common.check_finite("loss", loss, step + 1)  # stop on NaN/inf before it reaches the weights
            (loss / args.gradient_accumulation_steps).backward()
            num_tokens += 2 * int(batch["prompt_mask"].sum()) + int(batch["completion_mask"].sum())
            rows.append({"loss": loss.detach(), "rewards/chosen": chosen_rewards.mean(),
                         "rewards/rejected": rejected_rewards.mean(),
                         "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
                         "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
                         "logps/chosen": chosen_logps.detach().mean(), "logps/rejected": rejected_logps.detach().mean(),
                         **({"nll_loss": nll.detach()} if nll is not None else {}), **stats})
        rollouts.release(sampler)  # online: the sampler frees what it holds for the optimizer step, where it can
        memory.log_memory(args.output_dir, model, optimizer, frozen=frozen)  # memory.json, once, at the first full step
        grad_norm = common.optimizer_step(optimizer, args.max_grad_norm, step + 1)  # clip, NaN guard, step, bf16 rounding
        scheduler.step()

        # 4. log (means over the --logging_steps window), evaluate and save
        metrics = step_metrics(rows)
        final = {f"final_{k}": float(metrics[k]) for k in ("loss", "rewards/accuracies", "rewards/margins") if k in metrics}
        logger.update({**metrics, **sync_metrics, "grad_norm": grad_norm}, num_tokens=num_tokens)
        if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
            logger.log(step + 1, {"learning_rate": scheduler.get_last_lr()[0]}, pbar)
            if samples is not None:  # online: the last micro-batch's samples and scores (--log_completions)
                tracking.log_completions(args, step + 1, samples[0], samples[1], {"score": samples[2]})
        if eval_texts and ((args.eval_steps and (step + 1) % args.eval_steps == 0) or step + 1 == args.max_steps):
            eval_metrics = evaluate(model, ref_model, eval_ref, tokenizer, eval_texts, args, stop_ids)
            logger.log_eval(step + 1, eval_metrics)
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoints.save_checkpoint(model, tokenizer, args, f"{args.output_dir}/checkpoint-{step + 1}",
                                        checkpoints.training_state(step + 1, optimizer, scheduler))

    # ---- final save and evaluation
    logger.close()
    checkpoints.save_final(model, tokenizer, args)
    truncated["completions_truncated"] = round(parallel.all_reduce(float(truncated["completions_truncated"]), "sum")) \
        if args.online else truncated["completions_truncated"]  # sampled on every rank
    summary = {**init, **held, "peak_memory_bytes": memory.peak_memory_bytes(), **final, **eval_metrics, **truncated}
    if args.online and summary["completions_truncated"]:
        print(f"{script}: {summary['completions_truncated']} sampled completions reached --max_new_tokens without EOS")
    common.end_run(model, tokenizer, args, summary, sampler, "before: {init_gold_score:.3f}")


def models_held(model, ref_model, judge_model):
    """What training holds, printed and kept for summary.json: one model with the reference
    precomputed (or the policy's own base with --use_peft), two with a frozen copy, and a judge."""
    separate_ref = ref_model is not None and ref_model is not model
    held = {"models_alive": 1 + separate_ref, "model_bytes": memory.tensor_bytes(model)
            + (memory.tensor_bytes(ref_model) if separate_ref else 0),
            "judge_bytes": memory.tensor_bytes(judge_model) if judge_model is not None else 0}
    print(f"{common.script_name()}: training holds {held['models_alive']} model(s), {held['model_bytes'] / 2**20:.1f} MiB "
          "of weights" + (f" (+ {held['judge_bytes'] / 2**20:.1f} MiB reward model)" if judge_model is not None else ""))
    return held


if __name__ == "__main__":
    main()
