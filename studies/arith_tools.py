"""studies/arith_tools.py: the arithmetic world with a calculator tool (docs/worlds.md,
"Tools"): accuracy with and without the tool, the share of problems where the tool is
called, and the failure rate of the calls, per policy, with eval.py's CIs over the prompts and over
training seeds + prompts.

Every policy answers the test problems of embedded:arith_tools (400, the same problems as
embedded:arith's test split) greedily, twice:
- **with the tool**: the prompt lists the calculator (the chat template's `tools=`, as grpo.py
  --tools renders it) and tools.generate_with_tools runs the calls the policy writes, in
  sandbox.py, up to --max_tool_calling_iterations tool turns (training's setting), then the
  policy answers;
- **without**: the prompt lists no tool, one turn (sampling.sample_texts, as eval.py samples).
The strict verifier (world_arith.arith_strict) scores the last assistant turn. "Tool called": the
exchange holds at least one tool turn. Failure rate: the failed calls (a reply "error: ...")
over all calls, a ratio of totals, so its replicates are ratios of resampled totals. "Calls
without the tool": answers that write "<tool_call>" to a prompt that lists no tool.

Why a study script and not eval.py --tools: eval.py compares responses as texts (win rates,
Elo, a response cache keyed by text prompts); a multi-turn exchange with its tool turns, and
numbers per setting (with / without the tool), are this world's question, not every eval's.
The statistics are eval.py's own functions.

Run (make demo-tools):
    python studies/arith_tools.py sft=runs/sft_arith_tools 'grpo=runs/grpo_arith_tools/grpo/seed*' \
        --output_dir runs/eval_arith_tools
"""

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlhf import checkpoints  # noqa: E402
import common  # noqa: E402
from rlhf import data  # noqa: E402
import eval as evaluation  # noqa: E402
from rlhf.evaluation import policies  # noqa: E402
from rlhf import sampling  # noqa: E402
from rlhf import tools  # noqa: E402
from worlds import world_arith  # noqa: E402


@torch.no_grad()
def answer(path, ds, tool_list, args):
    """One policy's greedy answers to every problem, with the tool and without: per-problem arrays."""
    tokenizer = common.load_tokenizer(path)
    model = common.freeze(common.load_model(path, common.ModelArgs(model=path)))  # the defaults: fp32 on CPU
    convs, answers = list(ds["prompt"]), list(ds["answer"])
    schemas = [t.schema for t in tool_list]
    out = {"correct_tools": [], "calls": [], "failed": [], "correct_plain": [], "attempted_plain": []}
    for i in range(0, len(convs), args.batch_size):
        batch = convs[i:i + args.batch_size]
        # with the tool: listed in the prompt, its calls run in the sandbox, up to the training's limit of tool turns
        ids, mask = data.encode_prompts(tokenizer, [data.render_prompt(tokenizer, c, schemas) for c in batch])
        rollout = tools.generate_with_tools(model, tokenizer, ids, mask, batch, tool_list, args.max_tool_calling_iterations,
                                            args.max_completion_length, 1.0, 1, do_sample=False)
        out["correct_tools"] += world_arith.arith_strict(batch, rollout.messages, answers[i:i + len(batch)])
        replies = [[m["content"] for m in msgs if m["role"] == "tool"] for msgs in rollout.messages]
        out["calls"] += [len(r) for r in replies]
        out["failed"] += [sum(c.startswith("error:") for c in r) for r in replies]
        # without: no tool listed, one turn
        texts, _, _ = sampling.sample_texts(model, tokenizer, [data.render_prompt(tokenizer, c) for c in batch],
                                            args.max_completion_length, len(batch), do_sample=False)
        out["correct_plain"] += world_arith.arith_strict(batch, texts, answers[i:i + len(batch)])
        out["attempted_plain"] += [float("<tool_call>" in t) for t in texts]
    example = rollout.messages[0]
    return {k: np.asarray(v, float) for k, v in out.items()}, example


def ratio_cis(num, den, plan):
    """sum(num) / sum(den) over runs and prompts (R, n), with the prompt-only and the two-level
    percentile CIs of the ratio of resampled totals (eval.py's resampled_totals)."""
    prompt_counts, run_counts, all_runs = plan
    if den.sum() == 0:
        return None
    value = float(num.sum() / den.sum())
    cis = []
    for runs in (all_runs, run_counts):
        n, d = (evaluation.resampled_totals(x, prompt_counts, runs) for x in (num, den))
        cis += evaluation.percentile_ci(np.where(d > 0, n / np.maximum(d, 1e-12), np.nan)[d > 0])
    return value, *map(float, cis)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("policies", nargs="+", help="NAME=PATTERN (eval.py's methods: a method's runs are its training seeds) or folders")
    parser.add_argument("--tools", default=world_arith.TOOL_FILE + ":add", help="The tool, as grpo.py --tools")
    parser.add_argument("--max_tool_calling_iterations", type=int, default=1, help="Tool turns per answer at most (training's)")
    parser.add_argument("--max_completion_length", type=int, default=96, help="Tokens per answer, tool turns included (training's)")
    parser.add_argument("--batch_size", type=int, default=100, help="Problems per generation batch")
    parser.add_argument("--num_prompts", type=int, default=0, help="The first this-many test problems (0: all)")
    parser.add_argument("--num_bootstrap", type=int, default=1000, help="Bootstrap resamples for every CI")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the bootstrap")
    parser.add_argument("--output_dir", default="runs/eval_arith_tools", help="results.json and results.md go here")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    methods = policies.parse_methods(args.policies)
    ds = common.arith_split(common.ARITH_TOOLS, "test")  # seed 0, as eval.py
    if args.num_prompts:
        ds = ds.select(range(min(args.num_prompts, len(ds))))
    tool_list = tools.load_tools(args.tools)
    carry = np.asarray(ds["carry_trap"], bool)
    results, start = {}, time.time()
    for name, paths in methods:
        runs = []
        for path in paths:
            t = time.time()
            per_problem, example = answer(path, ds, tool_list, args)
            runs.append(per_problem)
            print(f"arith_tools: {path}: accuracy {per_problem['correct_tools'].mean():.3f} with the tool, "
                  f"{per_problem['correct_plain'].mean():.3f} without; called on {(per_problem['calls'] > 0).mean():.3f} "
                  f"of the problems ({time.time() - t:.0f} s); e.g. {example}")
        stack = {k: np.stack([r[k] for r in runs]) for k in runs[0]}  # (R, n) each
        stack["called"] = (stack["calls"] > 0).astype(float)
        plan = evaluation.bootstrap_plan(len(ds), [len(paths)], args.num_bootstrap, args.seed)
        plan = (plan[0], [plan[1][0]], [plan[2][0]])

        def cis(values):
            value, lo, hi, seed_lo, seed_hi = evaluation.mean_cis(values, *plan)
            return {"value": value, "ci_low": lo, "ci_high": hi, "seed_ci_low": seed_lo, "seed_ci_high": seed_hi}

        def by_carry(values):  # eval.py's --group_by: each group with its own bootstrap over its prompts
            out = evaluation.group_stats(values, carry.tolist(), args.num_bootstrap, args.seed)
            return {k: {"value": v.pop("score"), **v} for k, v in out.items()}

        failure = ratio_cis(stack["failed"], stack["calls"], plan)
        called, correct_tools, correct_plain = (by_carry(stack[k]) for k in ("called", "correct_tools", "correct_plain"))
        results[name] = {
            "runs": paths,
            "accuracy_with_tool": cis(stack["correct_tools"]), "accuracy_without_tool": cis(stack["correct_plain"]),
            "tool_called": cis(stack["called"]),
            "tool_called_carry": called.get("True"), "tool_called_other": called.get("False"),
            "accuracy_with_tool_carry": correct_tools.get("True"), "accuracy_without_tool_carry": correct_plain.get("True"),
            "failure_rate": None if failure is None else dict(zip(["value", "ci_low", "ci_high", "seed_ci_low", "seed_ci_high"], failure)),
            "calls_without_tool": cis(stack["attempted_plain"]),
            "per_run": {k: stack[k].mean(1).tolist() for k in ("correct_tools", "correct_plain", "called")},
            "per_run_carry_right_with_tool": stack["correct_tools"][:, carry].sum(1).astype(int).tolist(),
            "calls": int(stack["calls"].sum()), "failed_calls": int(stack["failed"].sum()),
        }
    seconds = time.time() - start

    # ---- the table: mean (prompt-only CI) [seeds + prompts CI when a method has several runs]
    def cell(s, runs):
        if s is None:
            return "–"
        text = f"{s['value']:.3f} ({s['ci_low']:.3f}, {s['ci_high']:.3f})"
        return text + (f" [{s['seed_ci_low']:.3f}, {s['seed_ci_high']:.3f}]" if len(runs) > 1 else "")

    lines = [f"Test split of {common.ARITH_TOOLS}: {len(ds)} problems ({int(carry.sum())} with the carry trap), greedy, "
             f"--max_tool_calling_iterations {args.max_tool_calling_iterations}, --max_completion_length "
             f"{args.max_completion_length}; mean (95% CI over prompts) [95% CI over seeds + prompts]", "",
             "| policy | runs | accuracy with the tool | without | tool called (share of problems) | on carry problems | "
             "on the others | failure rate of calls | calls without the tool |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {len(r['runs'])} | " + " | ".join(cell(r[k], r["runs"]) for k in (
            "accuracy_with_tool", "accuracy_without_tool", "tool_called", "tool_called_carry", "tool_called_other",
            "failure_rate", "calls_without_tool")) + " |")
    lines += ["", "Per run (accuracy with the tool / without / tool called; carry problems right with the tool):", ""]
    for name, r in results.items():
        for k, path in enumerate(r["runs"]):
            lines.append(f"- {name} {path}: {r['per_run']['correct_tools'][k]:.3f} / {r['per_run']['correct_plain'][k]:.3f} / "
                         f"{r['per_run']['called'][k]:.3f}; {r['per_run_carry_right_with_tool'][k]} of {int(carry.sum())}")
    table = "\n".join(lines)
    print(table)
    os.makedirs(args.output_dir, exist_ok=True)
    checkpoints.write_json(os.path.join(args.output_dir, "results.json"), {"results": results, "seconds": seconds,
                                                                          "args": vars(args)})
    with open(os.path.join(args.output_dir, "results.md"), "w") as f:
        f.write(table + "\n")
    print(f"arith_tools: {seconds:.0f} s; wrote {args.output_dir}/results.md and results.json")


if __name__ == "__main__":
    main()
