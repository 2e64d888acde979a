"""torchrun on the CPU (2 processes, gloo): 2 ranks x batch b must train exactly like 1 rank x
batch 2b (same losses, gradient norms and weights up to float reordering), with DDP-style
replication and with FSDP2 sharding -- the latter also killed mid-checkpoint and resumed."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from safetensors.torch import load_file


def _launch(argv, nproc=1, env=None):
    runner = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  "--nproc_per_node", str(nproc)]
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(runner + argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc, ok=True):
    out, err = proc.communicate(timeout=600)
    assert (proc.returncode == 0) == ok, f"exited {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
    return out


def _metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _assert_same_training(one, two, keys=("num_tokens", "loss"), weights_atol=1e-4):
    a, b = _metrics(one), _metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for k in keys:  # num_tokens: the two ranks together saw the same batch
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), k
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
    wa, wb = load_file(os.path.join(one, "model.safetensors")), load_file(os.path.join(two, "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=weights_atol, rtol=0)


def test_sft_two_ranks_match_one_rank_with_twice_the_batch(tmp_path, tiny_qwen, sft_data):
    argv = ["sft.py", "--model", tiny_qwen, "--dataset", sft_data, "--max_steps", "4", "--learning_rate", "1e-2",
            "--warmup_steps", "0", "--optim", "adamw", "--save_steps", "2"]
    one, ddp, fsdp = (str(tmp_path / n) for n in ("one", "ddp", "fsdp2"))
    runs = [_launch(argv + ["--batch_size", "8", "--output_dir", one]),
            _launch(argv + ["--batch_size", "4", "--output_dir", ddp, "--parallel", "ddp"], nproc=2),
            # FSDP2, killed while rank 0 writes checkpoint-4: resumed below from checkpoint-2
            _launch(argv + ["--batch_size", "4", "--output_dir", fsdp, "--parallel", "fsdp2"], nproc=2,
                    env={"RLHF_TEST_CRASH_WHILE_SAVING": "checkpoint-4"})]
    _finish(runs[0])
    out = _finish(runs[1])
    assert out.count("sft: saved to") == 1  # only rank 0 prints
    _assert_same_training(one, ddp)

    _finish(runs[2], ok=False)
    assert os.path.isdir(os.path.join(fsdp, "checkpoint-4.tmp")) and not os.path.exists(os.path.join(fsdp, "checkpoint-4"))
    out = _finish(_launch(argv + ["--batch_size", "4", "--output_dir", fsdp, "--parallel", "fsdp2", "--resume"], nproc=2))
    assert "continuing from" in out and "checkpoint-2 at step 2" in out
    _assert_same_training(one, fsdp)
    ckpt = load_file(os.path.join(fsdp, "checkpoint-4", "model.safetensors"))  # gathered, full-size weights
    ref = load_file(os.path.join(one, "checkpoint-4", "model.safetensors"))
    assert all(ckpt[k].shape == ref[k].shape for k in ref)



def test_dpo_two_ranks_match_one_rank_with_twice_the_batch(tmp_path, tiny_qwen):
    data = tmp_path / "prefs.jsonl"
    with open(data, "w") as f:
        for i in range(24):
            f.write(json.dumps({"prompt": f"POST: bob sold the car {i % 5} . TL;DR:", "chosen": " bob sold car ." + " now" * (i % 3),
                                "rejected": " alice" + " bike" * (i % 4) + " ."}) + "\n")
    argv = ["dpo.py", "--model", tiny_qwen, "--dataset", str(data), "--max_steps", "4", "--learning_rate", "1e-2",
            "--warmup_steps", "0", "--optim", "adamw"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    runs = [_launch(argv + ["--batch_size", "8", "--output_dir", one]),
            _launch(argv + ["--batch_size", "4", "--output_dir", two], nproc=2)]
    for run in runs:
        _finish(run)
    _assert_same_training(one, two, keys=("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"))


def test_grpo_runs_under_torchrun(tmp_path, tiny_qwen):
    """grpo.py under 2 CPU ranks: each rank samples its own prompts, rank 0 logs and saves once."""
    out = str(tmp_path / "grpo")
    _finish(_launch(["grpo.py", "--model", tiny_qwen, "--max_steps", "2", "--batch_size", "2", "--num_generations", "4",
                     "--max_completion_length", "8", "--save_steps", "2", "--eval_batch_size", "200",
                     "--output_dir", out], nproc=2))
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2]  # one line per step, not one per rank
    assert rows[0]["kl"] == pytest.approx(0, abs=1e-6) and rows[0]["clip_ratio"] == 0
    assert os.path.exists(os.path.join(out, "checkpoint-2", "trainer_state.pt"))
    assert json.load(open(os.path.join(out, "summary.json")))["gold_score"] <= 1
