"""What a run reports: metrics.jsonl (one JSON object per logged step, means over the
--logging_steps window), the console and progress bar, an optional tracker (tensorboard, wandb),
and --log_completions' sample tables.
"""

import json
import os
import time

import torch
from tqdm.auto import tqdm

from rlhf import basics
from rlhf import checkpoints
from rlhf import data
from rlhf import parallel
from rlhf import throughput


class MetricsLogger:
    """metrics.jsonl (one JSON object per logged step, each with `step`), the console, and an
    optional tracker (tensorboard / wandb, imported only when --report_to asks for it).

    Every step, `update(metrics, num_tokens)` adds that step's metrics to the logging window;
    every --logging_steps, `log(step, metrics)` writes the window's mean (key by key, as TRL
    logs) plus `metrics` (values of that moment, e.g. the learning rate) and `num_tokens`, the
    tokens (prompt + completion) trained on since the start of the run, cumulative as in TRL.
    Each step also gets its time, throughput and MFU (rlhf/throughput.py), counted on the
    `trained` models (the policy first; a critic after it), whose trained forwards are watched.
    """

    def __init__(self, args, start_step=0, trained=None):
        throughput.watch(trained)
        os.makedirs(args.output_dir, exist_ok=True)
        self.path = os.path.join(args.output_dir, "metrics.jsonl")
        self.tracker = None
        self.window, self.num_tokens, self.num_tokens_before = [], 0, 0
        self.steps, self.first_step, self.max_steps = start_step, start_step + 1, getattr(args, "max_steps", 0)  # the time estimate
        if not parallel.is_main():  # under torchrun only rank 0 writes; the others only join the reduction in log()
            return
        checkpoints.claim_output_dir(args)
        kept = []
        if start_step and os.path.exists(self.path):  # resuming: keep the lines up to the checkpoint
            with open(self.path) as f:
                lines = f.readlines()
            for n, line in enumerate(lines, 1):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    if n == len(lines):  # torn by a kill or a full disk during the write: a step after the checkpoint
                        print(f"resume: dropped the torn last line of {self.path}.")
                        break
                    basics.fail(f"{self.path}, line {n}: not valid JSON; delete that line and resume again.")
                if row["step"] <= start_step:
                    kept.append(line)
        self.num_tokens_before = max([json.loads(line).get("num_tokens", 0) for line in kept] or [0])
        with open(self.path, "w") as f:
            f.writelines(kept)
        if args.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.tracker = SummaryWriter(args.output_dir)
        elif args.report_to == "wandb":
            import wandb

            self.tracker = wandb.init(config=vars(args), dir=args.output_dir)

    def update(self, metrics, num_tokens=0):
        """One step's metrics into the logging window; `num_tokens` this rank trained on in it.
        After the run's first step: how long the rest will take at its pace."""
        row = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) or torch.is_tensor(v)}
        self.window.append({**row, **throughput.step_metrics()})  # after the floats: the step's work is done
        self.num_tokens += int(num_tokens)
        self.steps += 1
        if self.steps == self.first_step and _RUN["start"] is not None and parallel.is_main():
            took, left = time.time() - _RUN["start"], self.max_steps - self.steps
            if left > 0:
                tqdm.write(f"{basics.script_name()}: step {self.steps} took {duration(took)}; the other {left} steps "
                           f"take about {duration(took * left)} at this pace (the first step also warms up).")

    def log(self, step, metrics=None, pbar=None):
        """Write the window's mean plus `metrics`, then start a new window. Under torchrun,
        numbers are averaged over ranks first (num_tokens summed): call it on every rank."""
        metrics = {**window_mean(self.window), **(metrics or {})}
        if self.num_tokens or self.num_tokens_before:
            metrics["num_tokens"] = self.num_tokens
        self.window = []
        self._write(step, metrics, pbar)

    def log_eval(self, step, metrics):
        """Held-out metrics (eval_*): their own line in metrics.jsonl, printed to the console."""
        metrics = self._write(step, metrics)
        if metrics is not None:
            tqdm.write(f"{basics.script_name()}: step {step}: " + ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))

    def _write(self, step, metrics, pbar=None):
        metrics = {k: (float(v) if torch.is_tensor(v) else v) for k, v in metrics.items()}
        if parallel.world_size() > 1:
            metrics = parallel.mean_over_ranks(metrics)  # ranks may hold different keys
            if "num_tokens" in metrics:  # a sum over ranks, not a mean
                metrics["num_tokens"] = round(metrics["num_tokens"] * parallel.world_size())
            if not parallel.is_main():
                return None
        if "num_tokens" in metrics:
            metrics["num_tokens"] += self.num_tokens_before
        with checkpoints.writing(self.path, checkpoints.kept(os.path.dirname(self.path))), open(self.path, "a") as f:
            f.write(json.dumps(basics.finite_json({"step": step, **metrics}), allow_nan=False) + "\n")  # NaN / inf as null
        if pbar is not None:
            shown = [k for k, v in metrics.items() if isinstance(v, float)][:4] + ["tokens_per_second", "mfu"]
            pbar.set_postfix({k.replace("tokens_per_second", "tok/s"): f"{metrics[k]:.3g}" for k in shown if k in metrics},
                             refresh=False)
        if self.tracker is not None and hasattr(self.tracker, "add_scalar"):
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tracker.add_scalar(k, v, step)
        elif self.tracker is not None:
            self.tracker.log(metrics, step=step)
        return metrics

    def close(self):
        if self.tracker is not None:
            self.tracker.close() if hasattr(self.tracker, "add_scalar") else self.tracker.finish()


def divergence(output_dir, factor=100.0):
    """A run whose logged loss rose `factor`-fold above its first logged value and stays there, or
    blew up and then sits on a zero gradient norm (destroyed weights that nothing moves any more,
    while the loss may look normal again), is not a success: {"diverged": sentence} for
    summary.json (checkpoints.finish_run then exits non-zero), else {}. For losses that start
    positive and fall (sft.py, reward.py, dpo.py)."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not parallel.is_main() or not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [r for r in (json.loads(line) for line in f if line.strip()) if isinstance(r.get("loss"), (int, float))]
    if len(rows) < 2 or not rows[0]["loss"] > 0:
        return {}
    first, peak, last = rows[0], max(rows, key=lambda r: r["loss"]), rows[-1]
    grad_norm = last.get("grad_norm", 1.0)
    if last["loss"] > factor * first["loss"] or (peak["loss"] > factor * first["loss"] and grad_norm < 1e-12):
        return {"diverged": f"the loss rose from {first['loss']:.3g} (step {first['step']}) to {peak['loss']:.3g} (step "
                            f"{peak['step']}) and ends at {last['loss']:.3g} with grad_norm {grad_norm:.3g}: the run "
                            "diverged and its weights are likely destroyed; rerun with a lower --learning_rate."}
    return {}


def window_mean(rows):
    """Key-by-key mean of metric dicts, each key over the rows that have it."""
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: sum(r[k] for r in rows if k in r) / sum(k in r for r in rows) for k in keys}


def log_completions(args, step, prompts, completions, rewards):
    """--log_completions: a table of the first --num_completions_to_print (prompt, completion,
    rewards) on the console; every row appended to <output_dir>/completions.jsonl. `rewards` is
    {name: one value per completion} (a reward: NaN where no reward function applied, written as
    null; or a reward function's log_extra column, as it gave it); prompts are the dataset's (text or messages).
    Nothing without --log_completions."""
    if not getattr(args, "log_completions", False) or not parallel.is_main():
        return

    def value(v, i):
        x = v[i] if i < len(v) else None
        if isinstance(x, torch.Tensor) or isinstance(x, float):
            x = float(x)
            return None if x != x else x
        return x

    rows = [{"step": step, "prompt": p, "completion": c, **{k: value(v, i) for k, v in rewards.items()}}
            for i, (p, c) in enumerate(zip(prompts, completions))]
    with open(os.path.join(args.output_dir, "completions.jsonl"), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)

    def cell(x, width, tail=False):  # one line; a prompt shows its end, a completion its start
        text = " ".join((x[-1]["content"] if data.is_conversational(x) else str(x)).split())
        if len(text) > width:
            text = "..." + text[3 - width:] if tail else text[:width - 3] + "..."
        return text.ljust(width)

    names = list(rewards)
    header = f"{'prompt (end)':<40} | {'completion':<50} | " + " | ".join(f"{n[:12]:>12}" for n in names)
    lines = [f"{basics.script_name()}: completions at step {step}", header, "-" * len(header)]
    for r in rows[:args.num_completions_to_print]:
        lines.append(f"{cell(r['prompt'], 40, tail=True)} | {cell(r['completion'], 50)} | "
                     + " | ".join(f"{r[n]:>12.4g}" if isinstance(r[n], (int, float)) else f"{str(r[n])[:12]:>12}" for n in names))
    tqdm.write("\n".join(lines))


_RUN = {"bar": None, "start": None}  # the training loop's progress bar and when it started (`within`, the time estimate)


def progress(args, start=0, desc=None):
    """The training loop's steps, shown as a progress bar; each step's clock starts as it is handed out."""
    bar = tqdm(_timed(range(start, args.max_steps)), initial=start, total=args.max_steps, desc=desc,
               dynamic_ncols=True, disable=os.environ.get("TQDM_DISABLE") == "1" or not parallel.is_main())
    _RUN.update(bar=bar, start=time.time())
    return bar


def _timed(steps):
    for step in steps:
        throughput.start_step()
        yield step


def within(items, what):
    """The items of one step (its micro-batches, say), each shown beside the progress bar as
    `what i/n` while the step runs, so that a step of minutes shows what it is doing."""
    items, bar = list(items), _RUN["bar"]
    for i, item in enumerate(items):
        if bar is not None and not bar.disable:  # redrawn at most every mininterval (a log file stays short)
            bar.set_postfix_str(f"{what} {i + 1}/{len(items)}", refresh=time.time() - bar.last_print_t >= bar.mininterval)
        yield item


def duration(seconds):
    """12 s, 4 min 10 s, 2 h 05 min."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def mean_metrics(rows):
    """Average a list of metric dicts (e.g. over minibatches) key by key."""
    return {k: sum(float(r[k]) for r in rows) / len(rows) for k in rows[0]}
