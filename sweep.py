"""sweep.py: train one recipe over seeds and settings, one run folder per combination, then print
the eval.py command that compares the settings as methods (runs of one setting = its seeds).

    python sweep.py SCRIPT [--seeds 0,1,2] [--FLAG v1,v2,...]... [--zip] [--output_dir DIR] [-- FIXED...]

- every `--FLAG v1,v2` before `--` is an axis of the sweep (a single value is a constant);
  without --zip every combination of the axes is run, with --zip the i-th values of all axes go
  together (equal-length lists), e.g. an equal budget of completions per GRPO step;
- everything after `--` is passed to every run unchanged (commas and all: --reward_weights 0,1);
- run folders are DIR/<setting>/seed<S> (<setting> = the axes' flags and values, e.g.
  num_generations4-batch_size16; the script's name when there are no axes; a value with a '/'
  gets '_' and a hash of the exact setting), and each run gets `--seed S --output_dir <folder>`;
- resumable: a finished run (summary.json, which every script writes last) is skipped when its
  sweep.json (written by the sweep after the run succeeded: the script and every argument) says
  it ran with exactly these settings; a finished run of other settings (other fixed arguments
  after `--`, say) stops the sweep with both commands. Re-running the same command after a crash
  or Ctrl-C trains only what is missing; an unfinished run starts again from step 0.

Runs are sequential, in this process's environment (set OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES
as for one run). Any script that takes --seed and --output_dir and writes summary.json works:
sft.py, reward.py, ppo.py, dpo.py, grpo.py, or your fork of one.

Run:
    python sweep.py grpo.py --seeds 0,1,2 --num_generations 4,8,16                       # 9 runs
    python sweep.py grpo.py --seeds 0,1,2 --num_generations 4,8,16 --batch_size 16,8,4 --zip \\
        --output_dir runs/group_size -- --model runs/sft --max_steps 80                   # docs/studies.md
    python sweep.py my_grpo.py --seeds 0,1,2 -- --model runs/sft                         # a fork
"""

import hashlib
import itertools
import json
import os
import re
import shlex
import subprocess
import sys


def fail(message):
    sys.exit(f"sweep: error: {message}")


def parse(argv):
    """argv -> (script, seeds, axes [(flag, [values])], zip, output_dir, fixed arguments)."""
    if not argv or argv[0].startswith("-"):
        fail("usage: python sweep.py SCRIPT [--seeds 0,1,2] [--FLAG v1,v2]... [--zip] [--output_dir DIR] [-- FIXED...]")
    script, rest = argv[0], argv[1:]
    fixed = rest[rest.index("--") + 1:] if "--" in rest else []
    rest = rest[:rest.index("--")] if "--" in rest else rest
    if not os.path.isfile(script):
        fail(f"{script}: no such script.")
    seeds, axes, zipped, output_dir = ["0"], [], False, os.path.join("runs", "sweep", os.path.splitext(os.path.basename(script))[0])
    i = 0
    while i < len(rest):
        flag = rest[i]
        if flag == "--zip":
            zipped, i = True, i + 1
            continue
        if not flag.startswith("--") or i + 1 >= len(rest) or rest[i + 1].startswith("--"):
            fail(f"{flag!r}: expected --FLAG v1,v2,... before '--' (put fixed arguments after '--').")
        values = rest[i + 1].split(",")
        if flag == "--seeds":
            seeds = values
        elif flag == "--output_dir":
            output_dir = rest[i + 1]
        elif flag == "--seed":
            fail("--seed: the sweep sets it for every run; use --seeds 0,1,2.")
        else:
            axes.append((flag, values))
        i += 2
    def name(arg):  # --flag, --flag=value and --flag-with-dashes name one flag
        return arg.split("=")[0].replace("-", "_")

    swept = {name(flag) for flag, _ in axes}
    for arg in fixed:
        if name(arg) in ("__seed", "__output_dir"):
            fail(f"{arg} after '--': the sweep sets it for every run (--seeds, and --output_dir before '--').")
        if arg.startswith("--") and name(arg) in swept:  # the script takes the last value: every setting would run alike
            fail(f"{arg.split('=')[0]} is an axis of the sweep and is repeated after '--', where it would override the "
                 "swept values in every run: pass it on one side only.")
    if zipped and len({len(v) for _, v in axes}) > 1:
        fail("--zip needs the same number of values on every axis: " + ", ".join(f"{f} has {len(v)}" for f, v in axes))
    return script, seeds, axes, zipped, output_dir, fixed


def folder_name(script, flags, setting):
    """A setting's folder (and eval.py method) name: its flags and values, e.g.
    num_generations4-batch_size16. Where a value holds characters a folder name cannot (a path's
    '/'), they become '_' and a hash of the exact setting follows, so two settings never share a folder."""
    raw = "-".join(f"{f.lstrip('-')}{v}" for f, v in zip(flags, setting)) or os.path.splitext(os.path.basename(script))[0]
    name = re.sub(r"[^A-Za-z0-9._+-]", "_", raw)
    if name != raw:
        name += "-" + hashlib.sha256(json.dumps([flags, list(setting)]).encode()).hexdigest()[:8]
    return name


def check_finished(run, record):
    """Whether `run` holds a finished run (summary.json) of exactly these settings (its sweep.json,
    written after the run succeeded); a finished run of other settings stops the sweep."""
    if not os.path.exists(os.path.join(run, "summary.json")):
        return False
    try:
        with open(os.path.join(run, "sweep.json")) as f:
            recorded = json.load(f)
    except FileNotFoundError:
        fail(f"{run} holds a finished run that this sweep did not record (no sweep.json), so its settings are unknown: "
             "delete the folder to train it here, or pass another --output_dir.")
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{run}/sweep.json cannot be read ({e}); delete the folder to train it again.")
    if recorded != record:
        old, new = recorded.get("argv", []), record["argv"]
        fail(f"{run} holds a finished run of other settings (it ran {recorded.get('script')} {' '.join(old)}; this sweep "
             f"asks for {record['script']} {' '.join(new)}); pass another --output_dir, or delete the folder to train it again.")
    return True


def eval_command(output_dir, methods, fixed):
    """The eval.py command comparing the settings: the held-out data (--eval_dataset, else the
    training --dataset) and the judge the runs trained with (--reward_fn, --reward_model), when fixed."""
    value = {fixed[i]: fixed[i + 1] for i in range(len(fixed) - 1) if fixed[i].startswith("--")}
    flags = []
    if value.get("--eval_dataset") or value.get("--dataset"):
        flags += ["--dataset", value.get("--eval_dataset") or value["--dataset"]]
    if value.get("--reward_fn"):
        flags += ["--judge", "gold", "--reward_fn", value["--reward_fn"]]
    elif value.get("--reward_model"):
        flags += ["--judge", f"rm:{value['--reward_model']}"]
    return ("python eval.py " + " ".join(f"'{name}={os.path.join(output_dir, name, 'seed*')}'" for name in methods)
            + "".join(f" {shlex.quote(x)}" for x in flags))


def main():
    script, seeds, axes, zipped, output_dir, fixed = parse(sys.argv[1:])
    flags = [flag for flag, _ in axes]
    values = [v for _, v in axes]
    settings = list(zip(*values)) if zipped and axes else list(itertools.product(*values))  # [()] without axes
    names = [folder_name(script, flags, setting) for setting in settings]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        fail(f"two settings give the folder {twice}: pass each value of an axis once.")
    methods = {}  # setting name -> its run folders
    for name, setting in zip(names, settings):
        for seed in seeds:
            run = os.path.join(output_dir, name, f"seed{seed}")
            methods.setdefault(name, []).append(run)
            argv = [*[x for f, v in zip(flags, setting) for x in (f, v)], *fixed, "--seed", seed, "--output_dir", run]
            record = {"script": script, "argv": argv}  # the full settings of this run
            if check_finished(run, record):
                print(f"sweep: {run} is finished (summary.json, same settings), skipped")
                continue
            cmd = [sys.executable, script, *argv]
            print("sweep: " + " ".join(cmd[1:]), flush=True)
            code = subprocess.run(cmd, check=False).returncode  # a failure stops the sweep below, loudly
            if code != 0:
                fail(f"{run} failed (exit code {code}); fix it and run the same command again: finished runs are skipped.")
            with open(os.path.join(run, "sweep.json"), "w") as f:
                json.dump(record, f, indent=2)
    # the comparison: eval.py reads NAME=PATTERN as one method whose runs are the matching folders
    print("sweep: done. Compare the settings (add a baseline, e.g. sft=runs/sft):\n" + eval_command(output_dir, methods, fixed))


if __name__ == "__main__":
    main()
