"""eval.py's reports: results.md's tables and the interval plots (win_rates.png, elo.png).

Read by whoever changes what eval.py prints; the statistics behind every number (bootstrap
CIs, Elo, pass@k) stay in eval.py.
"""

import numpy as np


def fmt_ci(value, lo, hi, digits=2):
    return f"{value:.{digits}f} ({lo:.{digits}f}, {hi:.{digits}f})"


def markdown_report(results, names, reference):
    """results.md: headline table (each method vs the first and vs the references) + every pair.
    With several runs in some method, each CI column is followed by the two-level one, and a
    table of the runs comes last. `reference`: the name of the dataset's references when they
    took part in the comparisons, else None."""
    has_reference = reference is not None
    s = results["settings"]
    anchor = names[0]
    by_pair = {(r["policy_a"], r["policy_b"]): r for r in results["pairwise"]}
    multi = any(len(p["runs"]) > 1 for p in results["policies"].values())

    def two(value, lo, hi, seed_lo, seed_hi, digits=2, star=False):
        """[prompt-only CI cell] (+ [two-level CI cell] with several runs per method)."""
        stars = [" *" if star and (lo > 0.5 or hi < 0.5) else "", " *" if star and (seed_lo > 0.5 or seed_hi < 0.5) else ""]
        cells = [fmt_ci(value, lo, hi, digits) + stars[0]]
        return cells + ([f"({seed_lo:.{digits}f}, {seed_hi:.{digits}f})" + stars[1]] if multi else [])

    def cell(a, b):
        r = by_pair.get((a, b))
        if r is None:
            return [""] * (1 + multi)
        return two(r["win_rate"], r["ci_low"], r["ci_high"], r["seed_ci_low"], r["seed_ci_high"], star=True)

    def heading(title):
        return [f"{title} (95% CI)"] + ([f"{title}: seeds + prompts CI"] if multi else [])

    kind = s["judge"].split(":")[0]
    kind = "gold" if kind == "reward_fn" else kind  # reward functions score as the gold judge does
    fn_score = "gold score" if s["reward_fn"] == "gold" else "accuracy (greedy)" if s["verifier"] else s["judge_name"]
    score_name = {"gold": fn_score, "rm": "reward"}.get(kind)  # llm, pairwise, http: no score, only preferences
    words = not s["verifier"]  # word counts say nothing about an exact check
    head = ["policy"] + (["runs"] if multi else []) + heading("Elo") + heading(f"win rate vs {anchor}")
    head += heading("win rate vs reference") if has_reference else []
    head += heading(score_name) if score_name else []
    head += ["mean words"] if words else []
    counts = "gold_counts" in results["policies"][anchor]  # the embedded gold judge: its terms per summary
    head += ["facts missed", "unsupported clauses"] if counts else []
    rows = []
    for name in names:
        e, p = results["elo"][name], results["policies"][name]
        row = [name] + ([str(len(p["runs"]))] if multi else [])
        if e.get("unbounded"):  # complete separation: the maximum-likelihood Elo is +-inf, no interval to give
            row += [f"{'>=' if e['unbounded'] > 0 else '<='} {e['elo']:.0f} (unbounded)"] + (["unbounded"] if multi else [])
        else:
            row += two(e["elo"], e["ci_low"], e["ci_high"], e["seed_ci_low"], e["seed_ci_high"], 0)
        row += cell(name, anchor) if name != anchor else ["-"] * (1 + multi)
        row += cell(name, reference) if has_reference else []
        row += two(p["score"], p["score_ci_low"], p["score_ci_high"], p["score_seed_ci_low"], p["score_seed_ci_high"], 3) if score_name else []
        rows.append(row + ([f"{p['mean_length']:.1f}"] if words else []) + _counts(p, counts))
    if has_reference:
        ref = results["reference"]
        row = [reference] + (["-"] if multi else []) + ["-"] * 3 * (1 + multi)
        row += two(ref["score"], ref["score_ci_low"], ref["score_ci_high"], ref["score_seed_ci_low"], ref["score_seed_ci_high"], 3) if score_name else []
        rows.append(row + ([f"{ref['mean_length']:.1f}"] if words else []) + _counts(ref, counts))
    ci_text = (f"95% CIs from {s['num_bootstrap']} paired bootstrap resamples of the prompts (seed {s['seed']})"
               if not multi else
               f"95% CIs from {s['num_bootstrap']} bootstrap resamples (seed {s['seed']}): the first resamples the prompts "
               "only (paired, the runs fixed: how sure we are about *these* runs), the second each method's runs, then the "
               "prompts (two-level: how sure we are about the *method*, over training seeds)")
    lines = [f"# eval: judge {s['judge_name']}", "",
             f"{s['num_prompts']} prompts from {s['dataset']}, {'sampled' if s['do_sample'] else 'greedy'}, "
             f"{s['max_completion_length']} new tokens at most; {ci_text}. Win rate: a's wins over b, ties count half"
             + (f" (a tie when the judge's P(a better), asked in both orders, is within {s['tie_margin']} of 0.5)"
                if kind in ("llm", "pairwise", "http") else "")
             + (", averaged over every pair of runs" if multi else "")
             + f"; * = the CI excludes 0.5. Elo: Bradley-Terry, 400 log10 odds, {anchor} = 1000.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if any(results["elo"][name].get("unbounded") for name in names):
        lines += ["", "Elo `>= x` / `<= x`: complete separation, the policy won (lost) every game against the policies on "
                  f"the other side of it (ties count half), so its Bradley-Terry Elo relative to {anchor} is unbounded; x is "
                  "the value under the prior's one virtual draw per pair, a bound, not an estimate, and no interval is given."]
    lines += ["", "All pairs:", "", "| policy a | policy b | wins | ties | losses | " + " | ".join(heading("win rate of a")) + " |",
              "|---|---|---|---|---|" + "---|" * (1 + multi)]
    lines += [f"| {r['policy_a']} | {r['policy_b']} | {r['wins']} | {r['ties']} | {r['losses']} | "
              + " | ".join(cell(r["policy_a"], r["policy_b"])) + " |" for r in results["pairwise"]]
    if multi:
        lines += ["", "Runs:", "", "| run | method | path | " + (f"{score_name} | " if score_name else "") + "mean words |",
                  "|---|---|---|" + ("---|" if score_name else "") + "---|"]
        lines += [f"| {run} | {r['method']} | {r['path']} | " + (f"{r['score']:.3f} | " if score_name else "")
                  + f"{r['mean_length']:.1f} |" for run, r in results["runs"].items()]
    if s.get("reward_fns"):  # several reward functions: each one's score and win rate beside their weighted sum
        fns = s["reward_fns"]
        lines += ["", f"Per reward function (its mean over the completions it scores, not None; win rate vs {anchor} by "
                  "that function alone, ties count half, a None a tie), 95% CIs from the same resamples:", "",
                  "| policy | " + " | ".join(c for f in fns for c in heading(f) + heading(f"{f}: win rate vs {anchor}")) + " |",
                  "|" + "---|" * (1 + 2 * len(fns) * (1 + multi))]
        for name in names + ([reference] if has_reference else []):
            p = results["reference"] if name == reference else results["policies"][name]
            row = [name]
            for f in fns:
                r = p["rewards"][f]
                row += two(r["score"], r["score_ci_low"], r["score_ci_high"], r["score_seed_ci_low"], r["score_seed_ci_high"], 3)
                w = by_pair.get((name, anchor), {}).get("rewards", {}).get(f)
                row += (two(w["win_rate"], w["ci_low"], w["ci_high"], w["seed_ci_low"], w["seed_ci_high"], star=True) if w
                        else ["-"] * (1 + multi))
            lines.append("| " + " | ".join(row) + " |")
    if s["num_samples"]:
        ks = [f"pass@{k}" for k in s["pass_k"]]
        lines += ["", (f"pass@k: {s['num_samples']} samples per prompt at temperature {s['temperature']} (top_p {s['top_p']}, "
                       f"top_k {s['top_k']}), unbiased estimator (Chen et al. 2021), 95% CIs from the same bootstrap."), "",
                  "| policy | accuracy (greedy) | " + " | ".join(ks) + " |", "|" + "---|" * (len(ks) + 2)]
        for name in names:
            p = results["policies"][name]
            lines.append(f"| {name} | {fmt_ci(p['score'], p['score_ci_low'], p['score_ci_high'], 3)} | " + " | ".join(
                fmt_ci(p["pass_at_k"][k]["value"], p["pass_at_k"][k]["ci_low"], p["pass_at_k"][k]["ci_high"], 3) for k in ks) + " |")
    if s["group_by"] and score_name:
        groups = list(results["policies"][anchor]["by_group"])
        lines += ["", f"{score_name} by {s['group_by']} (95% CI; prompts per group in brackets):", "",
                  "| policy | " + " | ".join(f"{s['group_by']} = {g} ({results['policies'][anchor]['by_group'][g]['n']})"
                                           for g in groups) + " |", "|" + "---|" * (len(groups) + 1)]
        for name in names + ([reference] if has_reference else []):
            by = (results["reference"] if name == reference else results["policies"][name])["by_group"]
            lines.append(f"| {name} | " + " | ".join(fmt_ci(by[g]["score"], by[g]["ci_low"], by[g]["ci_high"], 3) + (
                f" [seeds + prompts ({by[g]['seed_ci_low']:.3f}, {by[g]['seed_ci_high']:.3f})]" if len(
                    (results["policies"].get(name) or {}).get("runs", [])) > 1 else "") for g in groups) + " |")
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
