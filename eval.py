"""eval.py: compare policies by judged win rates with paired bootstrap CIs and Bradley-Terry Elo.

Every policy answers the same held-out prompts with the same sampling settings and seed; a judge
decides, prompt by prompt, which of two responses is better; the statistics say how sure we can
be. A point-estimate win rate on 200 prompts moves by +-0.07 from the prompts alone, so every
number here comes with a 95% confidence interval:

- pairwise win rate of policy a over policy b (ties count half), for every pair of policies and
  for every policy against the dataset's references when it has them; its CI is a *paired*
  bootstrap: resample prompts with replacement, the same indices for both policies (and for every
  pair), so the per-prompt pairing that makes the comparison sharp is kept; percentile
  intervals (Efron & Tibshirani 1993, Ch. 13);
- Bradley-Terry Elo of every policy (Bradley & Terry 1952): P(i beats j) = p_i / (p_i + p_j),
  fitted by maximum likelihood on the pairwise win matrix with Hunter's (2004) MM iteration,
  reported on FastChat's Chatbot Arena scale: Elo_i = 1000 + 400 log10(p_i / p_first), so the
  first policy is the anchor at 1000 and 400 points are 10:1 odds; CIs from the same bootstrap;
- per policy: mean judge score +- CI (judges that give scores) and mean length in words, because
  length is the usual confound of judged win rates.

Judges (--judge):
- `gold`: a reward function, higher wins: by default the embedded world's gold judge (which
  needs the `post` column, as in the embedded test split), or --reward_fn file.py:fn;
- `rm:PATH`: a reward model saved by reward.py, higher wins;
- `llm:MODEL`: a local causal LM asked which of two responses is better. It is asked in both
  orders and P("A") vs P("B") is read from its next-token logits; averaging the two orders
  cancels position bias (Zheng et al. 2023, MT-Bench): a judge that always says "A" gives 0.5.

Departures and choices:
- identical responses are a tie, whatever the judge (no judge call is made for them);
- Bradley-Terry gets one virtual drawn game per pair of policies (a weak prior), so a policy
  that wins or loses every game still gets a finite Elo; it shrinks Elo gaps a little (200
  prompts at a 70% win rate: by under 1 point, far inside the CI);
- the embedded world's test split is always the world of seed 0 (as in common.gold_eval), so
  --seed changes the sampling and the bootstrap, never the prompts;
- generations are cached in --cache_dir, keyed by the policy (path and weight files' size and
  modification time), the rendered prompts and the generation settings, so a re-run with
  another judge does not generate again.

Run:
    python eval.py runs/sft runs/ppo runs/dpo runs/grpo                   # gold judge -> runs/eval
    python eval.py runs/sft runs/dpo --judge rm:runs/reward --output_dir runs/eval_rm
    python eval.py runs/sft runs/dpo --judge llm:Qwen/Qwen2.5-7B-Instruct --dataset prompts.jsonl
"""

import functools
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

import common
import sampling
import world
from common import TrainArgs

REFERENCE = "reference"  # name of the dataset's references when they take part in comparisons
CI_LEVEL = 0.95
BT_PRIOR_GAMES = 1.0  # virtual drawn games per pair of policies (see the module docstring)
JUDGE_TEMPLATE = (
    "Which response answers the prompt better? Answer with one letter, A or B.\n\n"
    "Prompt:\n{prompt}\n\nResponse A:\n{a}\n\nResponse B:\n{b}\n\nThe better response is"
)


@dataclass
class Args(TrainArgs):
    # model and data
    policies: list[str] = field(default_factory=list, metadata={"help": "Policy folders or Hub ids to compare (also accepted as bare arguments: python eval.py runs/sft runs/dpo). The first is the Elo anchor."})
    model: str = field(default="", metadata={"help": "Unused: pass the policies as arguments (python eval.py runs/sft runs/dpo)."})
    dataset_split: str = field(default="test", metadata={"help": "Split of --dataset to evaluate on (Hub datasets and folders)."})
    prompt_column: str = field(default="prompt", metadata={"help": "Column of --dataset holding the prompts (text or {role, content} messages)."})
    reference_column: str = field(default="reference", metadata={"help": "Column of reference responses, compared against when present ('' to ignore)."})
    num_prompts: int = field(default=0, metadata={"help": "Evaluate on the first this-many prompts (0: all)."})
    cache_dir: str = field(default="runs/eval_cache", metadata={"help": "Where generations are cached (a re-run with another judge reuses them)."})
    # generation
    max_completion_length: int = field(default=48, metadata={"help": "Tokens generated per response (48, as in common.gold_eval)."})
    do_sample: bool = field(default=False, metadata={"help": "Sample instead of greedy decoding (seeded with --seed, the same for every policy)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (with --do_sample)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold (with --do_sample)."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling (with --do_sample; 0: off)."})
    # judge and statistics
    judge: str = field(default="gold", metadata={"help": "gold (--reward_fn, default the embedded gold judge) | rm:PATH (reward model from reward.py) | llm:MODEL (local causal LM, asked in both orders)."})
    reward_fn: str = field(default="gold", metadata={"help": "With --judge gold: 'gold' (the embedded world's judge) or file.py:function, called as fn(prompts, completions, **columns)."})
    num_bootstrap: int = field(default=1000, metadata={"help": "Bootstrap resamples of the prompts for every confidence interval."})


# ============================================================================ statistics
def outcomes_from_scores(score_a, score_b):
    """Per-prompt result of a against b: 1 win, 0.5 tie, 0 loss (higher score wins): (n,)."""
    return (np.sign(np.asarray(score_a, float) - np.asarray(score_b, float)) + 1) / 2


def bootstrap_indices(n, num_bootstrap, seed):
    """Prompt indices of each bootstrap resample, shared by every statistic: (B, n)."""
    return np.random.default_rng(seed).integers(0, n, size=(num_bootstrap, n))


def percentile_ci(samples, level=CI_LEVEL):
    """Percentile bootstrap interval over the first axis."""
    lo, hi = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2], axis=0)
    return lo, hi


def mean_ci(values, idx):
    """Mean of per-prompt values and its paired-bootstrap CI (resampled prompts idx (B, n))."""
    values = np.asarray(values, float)
    lo, hi = percentile_ci(values[idx].mean(1))  # (B,) resampled means
    return float(values.mean()), float(lo), float(hi)


def win_rate_stats(outcomes, idx):
    """Win rate of a over b from per-prompt outcomes (n,) with its CI and significance flag."""
    outcomes = np.asarray(outcomes, float)
    win_rate, lo, hi = mean_ci(outcomes, idx)
    return {"win_rate": win_rate, "ci_low": lo, "ci_high": hi, "significant": bool(lo > 0.5 or hi < 0.5),
            "n": len(outcomes), "wins": int((outcomes == 1).sum()), "ties": int((outcomes == 0.5).sum()),
            "losses": int((outcomes == 0).sum())}


def win_matrix(outcomes, k):
    """wins[..., i, j]: games i won against j, ties counting half to each: (..., k, k).

    outcomes: {(i, j): array (..., n)} of i's results against j, one entry per pair."""
    first = next(iter(outcomes.values()))
    wins = np.zeros(first.shape[:-1] + (k, k))
    for (i, j), o in outcomes.items():
        wins[..., i, j] += o.sum(-1)
        wins[..., j, i] += (1 - o).sum(-1)
    return wins


def bradley_terry_elo(wins, prior_games=BT_PRIOR_GAMES, max_iter=100_000, tol=1e-10):
    """Bradley-Terry maximum likelihood on a win matrix (..., k, k), as Elo (..., k) anchored
    at 1000 on player 0 (FastChat's scale: 400 log10 odds).

    Model: P(i beats j) = p_i / (p_i + p_j) (Bradley & Terry 1952). MM update (Hunter 2004):
    p_i <- W_i / sum_j n_ij / (p_i + p_j), with W_i the wins of i and n_ij the
    games between i and j; each step raises the likelihood, and a tie is half a win to each
    side. `prior_games` virtual draws per pair keep every p_i finite and positive.
    """
    k = wins.shape[-1]
    wins = wins + prior_games / 2 * (1 - np.eye(k))  # virtual draws: half a win each way
    games = wins + np.swapaxes(wins, -1, -2)  # n_ij, (..., k, k), zero diagonal
    total_wins = wins.sum(-1)  # W_i, (..., k)
    p = np.ones(wins.shape[:-1])
    for _ in range(max_iter):
        new = total_wins / (games / (p[..., :, None] + p[..., None, :])).sum(-1)
        new = new / np.exp(np.log(new).mean(-1, keepdims=True))  # fix the scale: geometric mean 1
        done = np.abs(np.log(new) - np.log(p)).max() < tol
        p = new
        if done:
            break
    return 1000 + 400 * np.log10(p / p[..., :1])


def expected_wins(elo_a, elo_b):
    """P(a beats b) on the Elo scale: 1 / (1 + 10^((Elo_b - Elo_a) / 400))."""
    return 1 / (1 + 10 ** ((elo_b - elo_a) / 400))


# ============================================================================ the LLM judge
def answer_token_ids(tokenizer, letter):
    """Token ids that spell the answer `letter` as one token (with and without a leading space)."""
    ids = set()
    for text in (letter, " " + letter):
        toks = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(toks) == 1 and toks[0] != tokenizer.unk_token_id:
            ids.add(toks[0])
    return sorted(ids)


def prompt_text(prompt):
    """A prompt as plain text for the judge to read (conversations as 'role: content' lines)."""
    if isinstance(prompt, str):
        return prompt.strip()
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def judge_input(tokenizer, prompt, a, b):
    """The judge's question, through its chat template when it has one."""
    text = JUDGE_TEMPLATE.format(prompt=prompt_text(prompt), a=a.strip(), b=b.strip())
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return text


@torch.no_grad()
def prob_first_better(model, tokenizer, prompts, firsts, seconds, batch_size=16):
    """P("A") / (P("A") + P("B")) at the judge's next token, shown `firsts` as A: (n,)."""
    a_ids, b_ids = answer_token_ids(tokenizer, "A"), answer_token_ids(tokenizer, "B")
    if not a_ids or not b_ids:
        common.fail("the --judge llm model's tokenizer has no single token for 'A' or 'B'; use a judge model "
                    "whose vocabulary spells them (any instruction-tuned LM does).")
    texts = [judge_input(tokenizer, p, a, b) for p, a, b in zip(prompts, firsts, seconds)]
    head = model.get_output_embeddings()
    probs = []
    for i in range(0, len(texts), batch_size):
        ids, mask = common.encode_prompts(tokenizer, texts[i:i + batch_size])  # left padded
        ids, mask = ids.to(model.device), mask.to(model.device)
        hidden = sampling.backbone(model)(input_ids=ids, attention_mask=mask, position_ids=sampling.position_ids(mask),
                                        use_cache=False).last_hidden_state[:, -1]  # (b, H) at the last token
        logits = head(hidden).float()  # (b, V): only the next token's logits, never (b, T, V)
        log_a = torch.logsumexp(logits[:, a_ids], -1)  # (b,) all spellings of "A"
        log_b = torch.logsumexp(logits[:, b_ids], -1)
        probs.append(torch.sigmoid(log_a - log_b).cpu())  # = P(A) / (P(A) + P(B))
    return torch.cat(probs).double().numpy()


def llm_judge(model, tokenizer, prompts, responses_a, responses_b, batch_size=16):
    """P(a is better than b) per prompt, asked in both orders and averaged: (n,).

    Order 1 shows a as "A"; order 2 shows b as "A", where a wins by the judge saying "B". A
    judge with a position bias adds it to one order and takes it from the other, so the mean
    cancels it: a judge that always says "A" gives exactly 0.5.
    """
    a_first = prob_first_better(model, tokenizer, prompts, responses_a, responses_b, batch_size)
    b_first = prob_first_better(model, tokenizer, prompts, responses_b, responses_a, batch_size)
    return (a_first + (1 - b_first)) / 2


# ============================================================================ policies and judges
def policy_names(paths):
    """Each policy's name: its folder's basename, with as many parent folders as make it unique
    (runs/a/checkpoint-100 vs runs/b/checkpoint-100), then numbered if still equal (the same path twice)."""
    parts = [os.path.normpath(p).split(os.sep) for p in paths]
    names = []
    for i, p in enumerate(parts):
        depth = 1
        while depth < len(p) and any(q != p and q[-depth:] == p[-depth:] for q in parts):
            depth += 1
        names.append("/".join(p[-depth:]))
    taken, out = {REFERENCE}, []
    for name in names:
        unique, n = name, 1
        while unique in taken:
            n += 1
            unique = f"{name}-{n}"
        taken.add(unique)
        out.append(unique)
    return out


@functools.lru_cache(maxsize=None)
def weights_fingerprint(path):
    """What identifies a policy's weights: a SHA-256 of the content of the folder's model files
    (weights swapped in place with the same size and mtime still change it), computed once per
    policy and run; for a Hub id, the commit of its cached snapshot."""
    if os.path.isdir(path):
        digest = hashlib.sha256()
        for f in sorted(os.listdir(path)):
            if f.endswith((".safetensors", ".json", ".jinja", ".model")) and os.path.isfile(os.path.join(path, f)):
                digest.update(f.encode() + b"\0")
                with open(os.path.join(path, f), "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 24), b""):
                        digest.update(block)
        return digest.hexdigest()
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(path, "config.json")
    return os.path.basename(os.path.dirname(found)) if isinstance(found, str) else "not cached"


def generation_settings(args):
    """Everything besides the policy and the prompts that can change a generation."""
    return {"max_completion_length": args.max_completion_length, "do_sample": args.do_sample,
            "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
            "eval_batch_size": args.eval_batch_size, "dtype": args.dtype, "attn_implementation": args.attn_implementation}


def cache_file(path, prompts, args):
    key = json.dumps([os.path.abspath(path) if os.path.isdir(path) else path, weights_fingerprint(path),
                      prompts, generation_settings(args)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(os.path.normpath(path)))
    return os.path.join(args.cache_dir, f"{readable}-{digest}.json")


def generate_responses(path, name, raw_prompts, args):
    """The policy's responses to every prompt (from the cache when this exact run was done)."""
    tokenizer = common.load_tokenizer(path, args.trust_remote_code)
    prompts = [common.render_prompt(tokenizer, p) for p in raw_prompts]
    cached = cache_file(path, prompts, args)
    if os.path.exists(cached):
        with open(cached) as f:
            out = json.load(f)
        print(f"eval: {name}: {len(prompts)} responses from the cache {cached}")
        return out["responses"], out["truncated"]
    model = common.freeze(common.load_model(path, args))
    common.set_seed(args.seed)  # every policy samples from the same seed
    knobs = dict(do_sample=args.do_sample, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    responses, truncated = sampling.sample_texts(model, tokenizer, prompts, args.max_completion_length,
                                               args.eval_batch_size, **knobs)
    del model
    cached = cache_file(path, prompts, args)  # a Hub model's snapshot is known now that it is loaded
    common.write_json(cached, {"policy": path, "settings": generation_settings(args), "responses": responses,
                               "truncated": truncated})
    print(f"eval: {name}: generated {len(prompts)} responses (cached in {cached})")
    return responses, truncated


def parse_judge(spec):
    """--judge -> (kind, argument)."""
    kind, _, arg = spec.partition(":")
    if kind == "gold" and not arg:
        return kind, None
    if kind in ("rm", "llm") and arg:
        return kind, arg
    common.fail(f"--judge {spec!r}: expected gold, rm:PATH (a reward model from reward.py) or llm:MODEL (a causal LM).")


def judge_scores(kind, arg, responses, raw_prompts, columns, args):
    """Score-based judges: {name: (n,) scores} for every policy and the references."""
    if kind == "gold":
        fn = common.load_reward_fn(args.reward_fn)
        return {name: common.call_reward_fn(fn, raw_prompts, texts, columns).double().numpy()
                for name, texts in responses.items()}
    model, tokenizer = common.load_reward_model(arg, args)
    prompts = [common.render_prompt(tokenizer, p) for p in raw_prompts]
    return {name: sampling.reward_model_scores(model, tokenizer, prompts, texts, args.eval_batch_size).double().numpy()
            for name, texts in responses.items()}


# ============================================================================ reports
def fmt_ci(value, lo, hi, digits=2):
    return f"{value:.{digits}f} ({lo:.{digits}f}, {hi:.{digits}f})"


def markdown_report(results, names, has_reference):
    """results.md: headline table (each policy vs the first and vs the references) + every pair."""
    s = results["settings"]
    anchor = names[0]
    by_pair = {(r["policy_a"], r["policy_b"]): r for r in results["pairwise"]}

    def cell(a, b):
        r = by_pair.get((a, b))
        return "" if r is None else fmt_ci(r["win_rate"], r["ci_low"], r["ci_high"]) + (" *" if r["significant"] else "")

    score_name = {"gold": "gold score" if s["reward_fn"] == "gold" else "reward", "rm": "reward", "llm": None}[s["judge"].split(":")[0]]
    head = ["policy", "Elo (95% CI)", f"win rate vs {anchor} (95% CI)"]
    head += ["win rate vs reference (95% CI)"] if has_reference else []
    head += [f"{score_name} (95% CI)"] if score_name else []
    head += ["mean words"]
    counts = "gold_counts" in results["policies"][anchor]  # the embedded gold judge: its terms per summary
    head += ["facts missed", "unsupported clauses"] if counts else []
    rows = []
    for name in names:
        e, p = results["elo"][name], results["policies"][name]
        row = [name, fmt_ci(e["elo"], e["ci_low"], e["ci_high"], 0), cell(name, anchor) if name != anchor else "-"]
        row += [cell(name, REFERENCE)] if has_reference else []
        row += [fmt_ci(p["score"], p["score_ci_low"], p["score_ci_high"], 3)] if score_name else []
        rows.append(row + [f"{p['mean_length']:.1f}"] + _counts(p, counts))
    if has_reference:
        ref = results["reference"]
        row = [REFERENCE, "-", "-", "-"] + ([fmt_ci(ref["score"], ref["score_ci_low"], ref["score_ci_high"], 3)] if score_name else [])
        rows.append(row + [f"{ref['mean_length']:.1f}"] + _counts(ref, counts))
    lines = [f"# eval: judge {s['judge']}" + (f" ({s['reward_fn']})" if s["judge"] == "gold" else ""), "",
             f"{s['num_prompts']} prompts from {s['dataset']}, {'sampled' if s['do_sample'] else 'greedy'}, "
             f"{s['max_completion_length']} new tokens at most; 95% CIs from {s['num_bootstrap']} paired bootstrap "
             f"resamples of the prompts (seed {s['seed']}). Win rate: a's wins over b, ties count half; "
             f"* = the CI excludes 0.5. Elo: Bradley-Terry, 400 log10 odds, {anchor} = 1000.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "All pairs:", "", "| policy a | policy b | wins | ties | losses | win rate of a (95% CI) |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['policy_a']} | {r['policy_b']} | {r['wins']} | {r['ties']} | {r['losses']} | "
              f"{cell(r['policy_a'], r['policy_b'])} |" for r in results["pairwise"]]
    return "\n".join(lines) + "\n"


def _counts(policy, show):
    return [f"{policy['gold_counts']['missed']:.2f}", f"{policy['gold_counts']['unsupported']:.2f}"] if show else []


def plot_intervals(path, labels, values, lows, highs, xlabel, line, title, xlim=None):
    """One point per row with its CI as an error bar, and a vertical reference line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values, lows, highs = np.asarray(values), np.asarray(lows), np.asarray(highs)
    y = np.arange(len(labels))[::-1]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.45 * len(labels)))
    ax.errorbar(values, y, xerr=[values - lows, highs - values], fmt="o", capsize=4, color="tab:blue")
    ax.axvline(line, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(y, labels)
    ax.set_ylim(-0.7, len(labels) - 0.3)
    ax.set_xlabel(xlabel)
    if xlim:
        ax.set_xlim(*xlim)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ============================================================================ main
def main():
    # policies come first as bare arguments; HfArgumentParser parses --flags only
    argv = sys.argv[1:]
    n_bare = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    sys.argv[1:] = (["--policies", *argv[:n_bare]] if n_bare else []) + argv[n_bare:]
    args = common.parse_args(Args)
    if args.model:
        common.fail("eval.py takes the policies as arguments: python eval.py runs/sft runs/dpo [--flags].")
    if not args.policies:
        common.fail("no policies to compare: python eval.py runs/sft runs/ppo runs/dpo runs/grpo [--flags].")
    if args.num_bootstrap < 1 or args.num_prompts < 0:
        common.fail("--num_bootstrap must be at least 1 and --num_prompts at least 0.")
    kind, judge_arg = parse_judge(args.judge)
    if kind == "gold" and args.reward_fn != "gold":
        common.load_reward_fn(args.reward_fn)  # fail now, not after generating
    for path in args.policies + ([judge_arg] if kind in ("rm", "llm") else []):  # fail now, not after generating
        common.check_model_source(path)
        if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
            common.fail(f"{path} holds no model (no config.json): run the script that writes it first "
                        "(sft.py, reward.py, ppo.py, dpo.py or grpo.py).")

    # ---- data: prompts, optional references, and the other columns for reward functions
    if args.dataset == common.EMBEDDED:
        ds = common.embedded_world()["test"]  # seed 0, as common.gold_eval
        split = "test split"
    else:
        ds = common.load_data(args.dataset, args.dataset_split)
        split = f"split {args.dataset_split}" if not os.path.isfile(args.dataset) else "file"
    common.require_columns(ds, [args.prompt_column], args.dataset, "Pass --prompt_column.")
    if args.num_prompts:
        ds = ds.select(range(min(args.num_prompts, len(ds))))
    common.check_text(ds, [args.prompt_column], args.dataset)
    raw_prompts = ds[args.prompt_column]
    columns = {c: ds[c] for c in ds.column_names if c != args.prompt_column}
    has_reference = bool(args.reference_column) and args.reference_column in ds.column_names
    if args.reference_column not in ("", "reference") and not has_reference:
        common.require_columns(ds, [args.reference_column], args.dataset, "Pass --reference_column '' to compare without references.")
    if has_reference:
        common.check_text(ds, [args.reference_column], args.dataset)
    if kind == "gold" and args.reward_fn == "gold" and "post" not in columns:
        common.fail(f"--judge gold with the embedded gold judge needs a 'post' column, which {common.dataset_name(args.dataset)} "
                    "lacks; pass --reward_fn file.py:fn, --judge rm:PATH or --judge llm:MODEL.")
    if len(args.policies) < 2 and not has_reference:
        common.fail("nothing to compare: pass two or more policies, or a dataset with a --reference_column.")
    n = len(raw_prompts)
    print(f"eval: {len(args.policies)} policies on {n} prompts of {common.dataset_name(args.dataset)} ({split}), judge {args.judge}")

    # ---- generate: the same prompts, settings and seed for every policy
    names = policy_names(args.policies)
    responses, truncated = {}, {}
    for path, name in zip(args.policies, names):
        responses[name], truncated[name] = generate_responses(path, name, raw_prompts, args)
    if has_reference:
        # written as sampling.decode_completions writes the policies' responses: " " + stripped text
        responses[REFERENCE] = [" " + (r if isinstance(r, str) else r[-1]["content"]).strip() for r in ds[args.reference_column]]

    # ---- pairs: every pair of policies (the later one as a), then each policy vs the references
    pairs = [(names[j], names[i]) for i in range(len(names)) for j in range(i + 1, len(names))]
    pairs += [(name, REFERENCE) for name in names] if has_reference else []

    # ---- judge: per-prompt outcome of a against b (1 win, 0.5 tie, 0 loss)
    scores, outcomes, extra = None, {}, {}
    if kind in ("gold", "rm"):
        scores = judge_scores(kind, judge_arg, responses, raw_prompts, columns, args)
        for a, b in pairs:
            outcomes[a, b] = outcomes_from_scores(scores[a], scores[b])
            extra[a, b] = [{"score_a": float(x), "score_b": float(y)} for x, y in zip(scores[a], scores[b])]
    else:
        tokenizer = common.load_tokenizer(judge_arg, args.trust_remote_code)
        model = common.freeze(common.load_model(judge_arg, args))
        for a, b in pairs:
            prob = np.full(n, 0.5)
            todo = [i for i in range(n) if responses[a][i] != responses[b][i]]  # identical: a tie, no call
            if todo:
                prob[todo] = llm_judge(model, tokenizer, [raw_prompts[i] for i in todo], [responses[a][i] for i in todo],
                                       [responses[b][i] for i in todo], args.eval_batch_size)
            outcomes[a, b] = outcomes_from_scores(prob, 0.5)
            extra[a, b] = [{"prob_a": float(p)} for p in prob]
        del model
    for a, b in pairs:  # identical responses tie, whatever the judge
        same = np.array([x == y for x, y in zip(responses[a], responses[b])])
        outcomes[a, b] = np.where(same, 0.5, outcomes[a, b])

    # ---- statistics: one set of bootstrap resamples of the prompts for every number
    idx = bootstrap_indices(n, args.num_bootstrap, args.seed)  # (B, n)
    pairwise = [{"policy_a": a, "policy_b": b, **win_rate_stats(outcomes[a, b], idx)} for a, b in pairs]
    k = len(names)
    if k > 1:
        policy_outcomes = {(names.index(a), names.index(b)): outcomes[a, b] for a, b in pairs if b != REFERENCE}
        elo = bradley_terry_elo(win_matrix(policy_outcomes, k))  # (k,)
        boot_elo = bradley_terry_elo(win_matrix({p: o[idx] for p, o in policy_outcomes.items()}, k))  # (B, k)
        elo_lo, elo_hi = percentile_ci(boot_elo)
    else:
        elo, elo_lo, elo_hi = np.full(1, 1000.0), np.full(1, 1000.0), np.full(1, 1000.0)

    def describe(name):
        row = {}
        if scores is not None:
            row["score"], row["score_ci_low"], row["score_ci_high"] = mean_ci(scores[name], idx)
        row["mean_length"] = float(np.mean([len(t.split()) for t in responses[name]]))  # words
        if kind == "gold" and args.reward_fn == "gold":  # the embedded judge's terms: what went wrong, per summary
            counts = [world.gold_counts(post, t) for post, t in zip(columns["post"], responses[name])]
            row["gold_counts"] = {k: float(np.mean([c[k] for c in counts])) for k in ("missed", "unsupported", "repeated", "excess")}
        return row

    results = {
        "settings": {"judge": args.judge, "reward_fn": args.reward_fn, "dataset": common.dataset_name(args.dataset),
                     "num_prompts": n, "num_bootstrap": args.num_bootstrap, **generation_settings(args)},
        "pairwise": pairwise,
        "elo": {name: {"elo": float(elo[i]), "ci_low": float(elo_lo[i]), "ci_high": float(elo_hi[i])}
                for i, name in enumerate(names)},
        "policies": {name: {"path": path, **describe(name), "truncated_frac": float(np.mean(truncated[name]))}
                     for path, name in zip(args.policies, names)},
    }
    if has_reference:
        results["reference"] = describe(REFERENCE)

    # ---- save: results.json, results.md, judgments.jsonl, generations.jsonl, plots
    out = args.output_dir
    os.makedirs(out, exist_ok=True)
    common.write_json(os.path.join(out, "results.json"), results)
    report = markdown_report(results, names, has_reference)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(report)
    with open(os.path.join(out, "judgments.jsonl"), "w") as f:
        for a, b in pairs:
            for i in range(n):
                winner = {1.0: "a", 0.5: "tie", 0.0: "b"}[float(outcomes[a, b][i])]
                f.write(json.dumps({"prompt_id": i, "policy_a": a, "policy_b": b, "winner": winner, **extra[a, b][i]}) + "\n")
    with open(os.path.join(out, "generations.jsonl"), "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt_id": i, "prompt": raw_prompts[i], "responses": {k_: v[i] for k_, v in responses.items()}}) + "\n")
    plot_intervals(os.path.join(out, "win_rates.png"), [f"{r['policy_a']} vs {r['policy_b']}" for r in pairwise],
                   [r["win_rate"] for r in pairwise], [r["ci_low"] for r in pairwise], [r["ci_high"] for r in pairwise],
                   "win rate of the first over the second (95% CI)", 0.5, f"Pairwise win rates, judge {args.judge}",
                   xlim=(-0.03, 1.03))
    plot_intervals(os.path.join(out, "elo.png"), names, elo, elo_lo, elo_hi,
                   f"Bradley-Terry Elo (95% CI), {names[0]} = 1000", 1000, f"Elo, judge {args.judge}")
    print(f"eval: saved results.json, results.md, judgments.jsonl, generations.jsonl, win_rates.png, elo.png to {out}\n")
    print(report)


if __name__ == "__main__":
    main()
