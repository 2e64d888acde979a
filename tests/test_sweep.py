"""sweep.py: the runs it starts (axes, --zip, fixed arguments), resuming, failures, and the
eval.py command it prints, on a stand-in script that only records its arguments."""

import json
import shlex

import pytest
from conftest import run_script

from rlhf.evaluation import policies

FAKE_SCRIPT = """import json, os, sys
args = sys.argv[1:]
out = args[args.index("--output_dir") + 1]
os.makedirs(out, exist_ok=True)
if "--crash" in args:
    sys.exit(3)
with open(os.path.join(out, "config.json"), "w") as f:  # a model folder, as eval.py's globs require
    json.dump({}, f)
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump({"argv": args}, f)
"""


@pytest.fixture
def fake(tmp_path):
    path = tmp_path / "fake_grpo.py"
    path.write_text(FAKE_SCRIPT)
    return path


def argv_of(run):
    return json.loads((run / "summary.json").read_text())["argv"]


def test_zip_runs_every_seed_of_every_setting_and_resumes(fake, tmp_path):
    out = tmp_path / "sweep"
    cmd = [str(fake), "--seeds", "0,1", "--num_generations", "4,16", "--batch_size", "16,4", "--zip",
           "--output_dir", str(out), "--", "--model", "runs/sft", "--reward_weights", "0,1"]
    proc = run_script("sweep.py", *cmd)
    runs = sorted(p.parent.relative_to(out).as_posix() for p in out.glob("*/*/summary.json"))
    assert runs == ["num_generations16-batch_size4/seed0", "num_generations16-batch_size4/seed1",
                    "num_generations4-batch_size16/seed0", "num_generations4-batch_size16/seed1"]
    assert argv_of(out / "num_generations16-batch_size4/seed1") == [
        "--num_generations", "16", "--batch_size", "4", "--model", "runs/sft", "--reward_weights", "0,1",
        "--seed", "1", "--output_dir", str(out / "num_generations16-batch_size4/seed1")]

    # the printed eval.py command names one method per setting, whose runs are its seeds
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("python eval.py ")
    methods = policies.parse_methods(shlex.split(line)[2:])
    assert [(name, len(paths)) for name, paths in methods] == [("num_generations4-batch_size16", 2),
                                                              ("num_generations16-batch_size4", 2)]

    # resumable: a second call finds every summary.json and starts nothing
    (out / "num_generations4-batch_size16/seed1/summary.json").unlink()
    proc = run_script("sweep.py", *cmd)
    assert proc.stdout.count("skipped") == 3 and proc.stdout.count("--output_dir") == 1


def test_without_zip_every_combination(fake, tmp_path):
    out = tmp_path / "sweep"
    run_script("sweep.py", str(fake), "--num_generations", "4,8", "--beta", "0,0.04", "--output_dir", str(out))
    assert sorted(p.parent.parent.name for p in out.glob("*/seed0/summary.json")) == [
        "num_generations4-beta0", "num_generations4-beta0.04", "num_generations8-beta0", "num_generations8-beta0.04"]
    # values that are paths give folder names eval.py accepts as method names
    run_script("sweep.py", str(fake), "--model", "runs/sft,Qwen/Qwen2.5-0.5B", "--output_dir", str(out / "models"))
    names = sorted(p.name for p in (out / "models").iterdir())  # '/' -> '_' plus a hash of the exact setting
    assert [n.rsplit("-", 1)[0] for n in names] == ["modelQwen_Qwen2.5-0.5B", "modelruns_sft"]
    run_script("sweep.py", str(fake), "--seeds", "4", "--zip", "--output_dir", str(out / "no_axes"))
    assert (out / "no_axes/fake_grpo/seed4/summary.json").exists()  # seeds alone, with or without --zip


def test_failures_are_loud(fake, tmp_path):
    out = tmp_path / "sweep"
    proc = run_script("sweep.py", str(fake), "--seeds", "0,1", "--output_dir", str(out), "--", "--crash", check=False)
    assert proc.returncode != 0 and "seed0 failed (exit code 3)" in proc.stderr and "run the same command again" in proc.stderr
    assert not (out / "fake_grpo/seed1").exists()  # stopped at the first failure
    proc = run_script("sweep.py", str(fake), "--num_generations", "4,8", "--batch_size", "16", "--zip", check=False)
    assert proc.returncode != 0 and "same number of values" in proc.stderr
    proc = run_script("sweep.py", str(fake), "--", "--seed", "3", check=False)
    assert proc.returncode != 0 and "the sweep sets it" in proc.stderr


def test_runs_are_named_and_checked_by_their_full_settings(fake, tmp_path):
    """#25: a re-run with other fixed arguments is not "finished, skipped"; two values that differ
    only in characters a folder name cannot hold get two folders; the eval command carries the
    dataset and the judge (#24)."""
    out = tmp_path / "sweep"
    base = [str(fake), "--output_dir", str(out)]
    run_script("sweep.py", *base, "--", "--max_steps", "2")
    proc = run_script("sweep.py", *base, "--", "--max_steps", "3", check=False)
    assert proc.returncode != 0 and "holds a finished run of other settings" in proc.stderr and "--max_steps 2" in proc.stderr
    assert "skipped" not in proc.stdout
    proc = run_script("sweep.py", *base, "--", "--max_steps", "2")
    assert "skipped" in proc.stdout  # the same settings: finished

    proc = run_script("sweep.py", str(fake), "--dataset", "D/a/b.jsonl,D/a_b.jsonl", "--output_dir", str(out / "d"),
                      "--", "--reward_fn", "r.py:f")
    runs = sorted(out.glob("d/*/seed0/summary.json"))
    assert len(runs) == 2 and sorted(argv_of(r.parent)[1] for r in runs) == ["D/a/b.jsonl", "D/a_b.jsonl"]
    assert "skipped" not in proc.stdout
    line = proc.stdout.strip().splitlines()[-1]
    assert line.endswith("--judge gold --reward_fn r.py:f")
    proc = run_script("sweep.py", str(fake), "--output_dir", str(out / "e"), "--", "--dataset", "x.jsonl",
                      "--eval_dataset", "y.jsonl")
    assert proc.stdout.strip().splitlines()[-1].endswith("--dataset y.jsonl")
