"""Kill a run with SIGKILL in the middle of writing a checkpoint, resume it, and check that it ends
exactly where an uninterrupted run ends (CPU: bitwise, 8-bit optimizer states included).

The crash is made deterministic with the test hook RLHF_TEST_CRASH_WHILE_SAVING=checkpoint-<step>
(checkpoints.save_checkpoint SIGKILLs its own process after writing the weights of that checkpoint into
its temporary folder, before the rename): the steps logged after the last complete checkpoint and
the half-written folder must both be discarded on resume.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from safetensors.torch import load_file

from rlhf import checkpoints
from rlhf import throughput
import common
from rlhf import tracking


def _launch(*argv, env=None):
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc, returncode=0):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == returncode, f"exited {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    return out


def _metrics(folder):
    """metrics.jsonl without what the clock gives (step time, throughput, MFU): wall-clock differs between runs."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in throughput.TIMED} for line in f]


def _weights(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


def _prompts_and_length_reward(tmp_path, n, scale):
    """A prompt-only .jsonl of n prompts and a reward file whose `length` scores scale * len(completion)."""
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:"}) + "\n")
    rewards = tmp_path / "rewards.py"
    rewards.write_text(f"def length(prompts, completions, **kw):\n    return [{scale} * len(c) for c in completions]\n")
    return str(prompts), f"{rewards}:length"


def _full_and_crashed(tmp_path, argv, crash_at):
    """Run argv to the end in <tmp>/full, and again in <tmp>/crashed killed while saving checkpoint-<crash_at>."""
    full, crashed = str(tmp_path / "full"), str(tmp_path / "crashed")
    ref = _launch(*argv, "--output_dir", full)
    _finish(_launch(*argv, "--output_dir", crashed, env={"RLHF_TEST_CRASH_WHILE_SAVING": f"checkpoint-{crash_at}"}),
            -signal.SIGKILL)
    _finish(ref)
    return full, crashed


def test_sft_resumes_exactly_after_sigkill(tmp_path, tiny_qwen, sft_data):
    # --optim adamw_8bit (the default on CUDA, asked for here on a CPU): the 8-bit states must survive the round trip exactly
    argv = ["sft.py", "--model", tiny_qwen, "--dataset", sft_data, "--max_steps", "8", "--batch_size", "4",
            "--save_steps", "3", "--learning_rate", "3e-3", "--warmup_steps", "2", "--optim", "adamw_8bit"]
    full, crashed = str(tmp_path / "full"), str(tmp_path / "crashed")
    ref = _launch(*argv, "--output_dir", full)
    # --resume with no checkpoint yet starts from step 0 (so one command serves every relaunch)
    run = _launch(*argv, "--output_dir", crashed, "--resume", env={"RLHF_TEST_CRASH_WHILE_SAVING": "checkpoint-6"})
    out = _finish(run, -signal.SIGKILL)
    _finish(ref)
    assert "no checkpoint" in out
    assert {"checkpoint-3", "checkpoint-6.tmp", "metrics.jsonl"} <= set(os.listdir(crashed))
    assert not os.path.exists(os.path.join(crashed, "checkpoint-6"))
    assert [r["step"] for r in _metrics(crashed)] == [1, 2, 3, 4, 5, 6]  # steps 4-6 were lost with the crash

    out = _finish(_launch(*argv, "--output_dir", crashed, "--resume"))
    assert f"continuing from {crashed}/checkpoint-3 at step 3" in out
    assert _metrics(crashed) == _metrics(full)  # loss, grad_norm, learning_rate, num_tokens of every step
    assert [r["step"] for r in _metrics(crashed)] == list(range(1, 9))
    for name in ("", "checkpoint-6"):
        a, b = _weights(os.path.join(full, name)), _weights(os.path.join(crashed, name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not [n for n in os.listdir(crashed) if n.endswith(".tmp")]
    state = torch.load(os.path.join(crashed, "checkpoint-6", "trainer_state.pt"), weights_only=True)
    assert state["step"] == 6 and {"optimizer", "scheduler", "rng"} <= state.keys()
    assert any(t.dtype == torch.uint8 for t in _tensors(state["optimizer"]))  # the 8-bit AdamW states are in it


def _tensors(tree):
    if torch.is_tensor(tree):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)


def test_training_state_round_trips_optimizer_scheduler_and_rng(tmp_path, tiny_qwen):
    """--resume_from_checkpoint at the function level: weights, AdamW-8bit, scheduler, RNG."""
    import random
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    args = SimpleNamespace(learning_rate=1e-2, weight_decay=0.0, optim="adamw_8bit", lr_scheduler_type="linear",
                           warmup_steps=1, max_steps=10, output_dir=str(tmp_path), seed=0, resume=False)

    def make():
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen)
        optimizer = common.make_optimizer(model, args)
        return model, optimizer, common.make_scheduler(optimizer, args)

    def train(model, optimizer, scheduler, steps):
        for step in steps:
            ids = torch.randint(0, 50, (2, 6))  # draws from the global RNG: restored on resume
            model(input_ids=ids, labels=ids).loss.backward()
            common.optimizer_step(optimizer, 1.0)
            scheduler.step()

    torch.manual_seed(0)
    model, optimizer, scheduler = make()
    train(model, optimizer, scheduler, range(3))
    checkpoints.save_checkpoint(model, None, args, f"{tmp_path}/checkpoint-3", checkpoints.training_state(3, optimizer, scheduler))
    train(model, optimizer, scheduler, range(3, 5))
    draw = random.random()

    model2, optimizer2, scheduler2 = make()
    args.resume_from_checkpoint = f"{tmp_path}/checkpoint-3"
    assert checkpoints.maybe_resume(args, model2, optimizer2, scheduler2) == 3
    train(model2, optimizer2, scheduler2, range(3, 5))
    assert random.random() == draw
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert checkpoints.last_checkpoint(str(tmp_path)) == f"{tmp_path}/checkpoint-3"


def test_online_dpo_resumes_exactly_after_sigkill(tmp_path, tiny_qwen):
    """An RL script whose batches are *sampled*: exact resumption needs the RNG states too."""
    prompts, reward_fn = _prompts_and_length_reward(tmp_path, 16, 1.0)
    argv = ["dpo.py", "--model", tiny_qwen, "--dataset", prompts, "--online", "--reward_fn", reward_fn,
            "--max_steps", "5", "--batch_size", "4", "--max_new_tokens", "6", "--save_steps", "2",
            "--learning_rate", "1e-2", "--warmup_steps", "0"]
    full, crashed = _full_and_crashed(tmp_path, argv, 4)
    assert [r["step"] for r in _metrics(crashed)] == [1, 2, 3, 4]
    # --resume_from_checkpoint names the folder explicitly
    out = _finish(_launch(*argv, "--output_dir", crashed, "--resume_from_checkpoint", f"{crashed}/checkpoint-2"))
    assert "at step 2" in out
    assert _metrics(crashed) == _metrics(full)  # same samples, same judge scores, same losses
    a, b = _weights(full), _weights(crashed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_ppo_resumes_exactly_after_sigkill(tmp_path, tiny_qwen):
    """Four models' worth of state: policy weights, the critic, one optimizer over both, RNG."""
    prompts, reward_fn = _prompts_and_length_reward(tmp_path, 12, 0.1)
    argv = ["ppo.py", "--model", tiny_qwen, "--dataset", prompts, "--reward_fn", reward_fn,
            "--max_steps", "4", "--batch_size", "2", "--num_mini_batches", "2", "--max_completion_length", "5",
            "--save_steps", "2", "--learning_rate", "1e-2"]
    full, crashed = _full_and_crashed(tmp_path, argv, 4)
    assert [r["step"] for r in _metrics(crashed)] == [1, 2, 3, 4]
    out = _finish(_launch(*argv, "--output_dir", crashed, "--resume"))
    assert f"continuing from {crashed}/checkpoint-2 at step 2" in out
    assert _metrics(crashed) == _metrics(full)  # vf_loss: the critic too
    a, b = _weights(full), _weights(crashed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = torch.load(os.path.join(crashed, "checkpoint-4", "trainer_state.pt"), weights_only=True)
    assert state["step"] == 4 and "critic" in state


def test_reward_resumes_exactly_after_sigkill(tmp_path, tiny_qwen):
    from worlds import world

    prefs = tmp_path / "prefs.jsonl"
    with open(prefs, "w") as f:
        for row in world.build_world(0, sizes={"sft": 1, "prefs": 40, "contrast": 0, "rl": 1, "test": 1})["prefs"]:
            f.write(json.dumps({k: row[k] for k in ("prompt", "chosen", "rejected")}) + "\n")
    argv = ["reward.py", "--model", tiny_qwen, "--dataset", str(prefs), "--max_steps", "6", "--batch_size", "4",
            "--save_steps", "3", "--eval_steps", "0", "--learning_rate", "3e-3"]
    full, crashed = _full_and_crashed(tmp_path, argv, 6)
    out = _finish(_launch(*argv, "--output_dir", crashed, "--resume"))
    assert f"continuing from {crashed}/checkpoint-3 at step 3" in out
    assert _metrics(crashed) == _metrics(full)
    summaries = [json.load(open(os.path.join(folder, "summary.json"))) for folder in (crashed, full)]
    assert [{k: v for k, v in s.items() if k not in throughput.RUN_KEYS} for s in summaries] == \
           [{k: v for k, v in summaries[1].items() if k not in throughput.RUN_KEYS}] * 2  # the steps after the resume


def test_grpo_resumes_exactly_after_sigkill(tmp_path, tiny_qwen):
    prompts, reward_fn = _prompts_and_length_reward(tmp_path, 12, 0.1)
    argv = ["grpo.py", "--model", tiny_qwen, "--dataset", prompts, "--reward_fn", reward_fn,
            "--max_steps", "4", "--batch_size", "2", "--num_generations", "4", "--max_completion_length", "5",
            "--num_iterations", "2", "--save_steps", "2", "--learning_rate", "1e-2"]
    full, crashed = _full_and_crashed(tmp_path, argv, 4)
    out = _finish(_launch(*argv, "--output_dir", crashed, "--resume"))
    assert f"continuing from {crashed}/checkpoint-2 at step 2" in out
    assert _metrics(crashed) == _metrics(full)
    a, b = _weights(full), _weights(crashed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("optim", ["adamw", "adamw_8bit"])
def test_bf16_resume_ends_where_the_uninterrupted_run_ends(tmp_path, tiny_qwen, optim):
    """bf16 weights: the fp32 optimizer states keep their dtype through a checkpoint (torch's
    load_state_dict casts them to bf16 and the next step crashed), and the stochastic rounding
    after the resume draws the noise the uninterrupted run drew: bit-identical weights."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    args = SimpleNamespace(learning_rate=1e-3, weight_decay=0.0, optim=optim, lr_scheduler_type="linear",
                           warmup_steps=1, max_steps=10, output_dir=str(tmp_path), seed=3, resume=False)

    def make():
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.bfloat16)
        optimizer = common.make_optimizer(model, args)
        return model, optimizer, common.make_scheduler(optimizer, args)

    def train(model, optimizer, scheduler, steps):
        for step in steps:
            ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()
            common.optimizer_step(optimizer, 1.0)
            scheduler.step()

    model, optimizer, scheduler = make()
    train(model, optimizer, scheduler, range(2))
    checkpoints.save_checkpoint(model, None, args, f"{tmp_path}/checkpoint-2", checkpoints.training_state(2, optimizer, scheduler))
    torch.manual_seed(1)  # the global RNG must not matter: the rounding noise has its own generator
    train(model, optimizer, scheduler, range(2, 4))

    model2, optimizer2, scheduler2 = make()
    args.resume_from_checkpoint = f"{tmp_path}/checkpoint-2"
    torch.manual_seed(2)
    assert checkpoints.maybe_resume(args, model2, optimizer2, scheduler2) == 2
    train(model2, optimizer2, scheduler2, range(2, 4))
    assert all(v.dtype == torch.float32 for s in optimizer2.state.values() for k, v in s.items()
               if torch.is_tensor(v) and v.is_floating_point() and k not in ("absmax1", "absmax2", "qmap1", "qmap2"))
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name


def test_resume_checks_itself(tmp_path, tiny_qwen):
    """A new --learning_rate is honoured (the schedule keeps its step); a change that breaks equivalence
    is refused naming the flag and both values, unless --resume_allow_changes; a torn metrics line is dropped."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    args = SimpleNamespace(learning_rate=1e-2, weight_decay=0.0, optim="adamw", lr_scheduler_type="linear",
                           warmup_steps=0, max_steps=10, output_dir=str(tmp_path), seed=0, batch_size=4, dataset="a.jsonl",
                           resume=True, resume_from_checkpoint="", resume_allow_changes=False, report_to="none",
                           overwrite_output_dir=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen)

    def fresh(**changes):
        new = SimpleNamespace(**{**vars(args), **changes})
        optimizer = common.make_optimizer(model, new)
        return new, optimizer, common.make_scheduler(optimizer, new)

    _, optimizer, scheduler = fresh()
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    checkpoints.save_checkpoint(model, None, args, f"{tmp_path}/checkpoint-4", checkpoints.training_state(4, optimizer, scheduler))

    def error(**changes):
        with pytest.raises(SystemExit) as e:
            new, optimizer, scheduler = fresh(**changes)
            checkpoints.maybe_resume(new, model, optimizer, scheduler)
        return str(e.value)

    assert "--batch_size 8 differs from the 4 that" in error(batch_size=8) and "--resume_allow_changes" in error(batch_size=8)
    assert "--seed 1 differs from the 0" in error(seed=1)
    assert "--dataset 'b.jsonl' differs from the 'a.jsonl'" in error(dataset="b.jsonl")
    assert "--optim 'adamw_8bit' differs" in error(optim="adamw_8bit")
    assert "--max_steps 3 is below the step of" in error(max_steps=3)
    with open(f"{tmp_path}/checkpoint-4/args.json") as f:
        saved = json.load(f)
    with open(f"{tmp_path}/checkpoint-4/args.json", "w") as f:
        json.dump({**saved, "num_generations": 4}, f)  # as grpo.py writes it
    assert "was written by another script (its args.json has num_generations" in error()
    with open(f"{tmp_path}/checkpoint-4/args.json", "w") as f:
        json.dump(saved, f)
    new, optimizer2, scheduler2 = fresh(batch_size=8, resume_allow_changes=True)
    assert checkpoints.maybe_resume(new, model, optimizer2, scheduler2) == 4
    # the advice after a NaN: resume with a lower --learning_rate; lr(t) = new_lr * schedule(t), t kept
    new, optimizer2, scheduler2 = fresh(learning_rate=1e-3)
    assert checkpoints.maybe_resume(new, model, optimizer2, scheduler2) == 4
    assert scheduler2.get_last_lr()[0] == pytest.approx(1e-3 * 6 / 10) == optimizer2.param_groups[0]["lr"]
    optimizer2.step()
    scheduler2.step()
    assert scheduler2.get_last_lr()[0] == pytest.approx(1e-3 * 5 / 10)

    # metrics.jsonl torn by a kill during a write: the partial last line is dropped, not a JSONDecodeError
    with open(f"{tmp_path}/metrics.jsonl", "w") as f:
        f.write('{"step": 3}\n{"step": 4}\n{"step": 5, "lo')
    tracking.MetricsLogger(args, start_step=4)
    assert [r["step"] for r in _metrics(str(tmp_path))] == [3, 4]
    checkpoints._LOCK.close()
