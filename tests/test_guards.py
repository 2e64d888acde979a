"""Guards against bad runs and out-of-range inputs: each one stops with a message a person can act
on (naming the step, flag, row or prompt), or counts and logs what it skipped or cut. Never a
crash deep in a stack.

Decisions (documented here and in the README):
- NaN/inf loss or reward: stop before the weights are updated, name the step, keep checkpoints.
- prompts (completions) longer than --max_prompt_length (--max_completion_length): cut, counted
  up front, printed, and written to summary.json as prompts_truncated (completions_truncated).
- an empty response in the data: a clear error naming the row; an empty *generated* response
  is a valid completion (EOS only) that rewards score like any other.
- a dataset smaller than one batch: allowed; batch_indices cycles, so a batch repeats examples
  (a note is printed).
- an unknown --loss_type / --parallel / --optim: an error at parse time, before anything loads.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_script

import common
import sampling
import world


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def _error(fn, *args, **kwargs):
    with pytest.raises(SystemExit) as e:
        fn(*args, **kwargs)
    return str(e.value)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("guards")
    sft = [{"prompt": f"POST: alice bought the bike {i} . TL;DR:", "completion": " alice bought bike ."}
           for i in range(12)]
    return {"sft": _write_jsonl(folder / "sft.jsonl", sft), "folder": folder}


# ------------------------------------------------------------------ NaN / inf
def test_nan_loss_stops_naming_the_step_and_keeps_the_last_checkpoint(tmp_path, tiny_qwen, data):
    out = str(tmp_path / "nan")
    # a learning rate of 1e30 sends the weights to ~1e30 at step 1; step 2's logits overflow
    proc = run_script("sft.py", "--model", tiny_qwen, "--dataset", data["sft"], "--output_dir", out, "--max_steps", "4",
                      "--batch_size", "4", "--save_steps", "1", "--learning_rate", "1e30", "--warmup_steps", "0",
                      "--optim", "adamw", "--max_grad_norm", "0", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "loss is NaN at step 2" in proc.stderr and "--resume" in proc.stderr
    assert os.path.exists(os.path.join(out, "checkpoint-1", "trainer_state.pt"))
    assert not os.path.exists(os.path.join(out, "checkpoint-2"))
    assert common.last_checkpoint(out) == os.path.join(out, "checkpoint-1")


def test_check_finite_names_what_and_when():
    common.check_finite("reward", torch.tensor([0.5, -1.0]), 3)  # finite: passes silently
    assert "reward is inf at step 7" in _error(common.check_finite, "reward", torch.tensor([0.5, float("inf")]), 7)
    assert "loss is NaN at step 1" in _error(common.check_finite, "loss", float("nan"), 1)


def test_nan_reward_from_a_reward_function_names_the_prompt():
    msg = _error(common.call_reward_fn, lambda prompts, completions: [1.0, float("nan")], ["p0", "the bad one"], ["a", "b"])
    assert "nan" in msg and "prompt 1" in msg and "the bad one" in msg


# ------------------------------------------------------------------ a raising reward function
def test_raising_reward_function_is_reported_with_its_prompt(tmp_path, tiny_llama):
    prompts = _write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"POST: bob sold the {w} . TL;DR:"}
                                                        for w in ("car", "bike", "house", "boat")])
    fn = tmp_path / "rewards.py"
    fn.write_text("def picky(prompts, completions, **kw):\n"
                  "    return [1 / ('bike' not in p) for p in prompts]\n")  # ZeroDivisionError on the bike
    proc = run_script("grpo.py", "--model", tiny_llama, "--dataset", prompts, "--reward_fn", f"{fn}:picky",
                      "--output_dir", str(tmp_path / "o"), "--max_steps", "1", "--batch_size", "4",
                      "--num_generations", "2", "--max_completion_length", "4", "--beta", "0", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "picky raised ZeroDivisionError" in proc.stderr and "bob sold the bike" in proc.stderr


# ------------------------------------------------------------------ out-of-range inputs
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, data):
    """One sft.py run on 3 examples with batch 8 and prompts longer than --max_prompt_length."""
    folder = tmp_path_factory.mktemp("tiny_run")
    rows = [{"prompt": "POST: alice bought the bike in the city last week . TL;DR:", "completion": " alice bought bike ."},
            {"prompt": "POST: bob sold car . TL;DR:", "completion": " bob sold car ."},
            {"prompt": "TL;DR:", "completion": " nothing ."}]
    model = folder / "model"
    tok = world.build_tokenizer()
    world.build_model(tok, hidden_size=64, num_layers=1).save_pretrained(model)
    tok.save_pretrained(model)
    prompt_lengths = [len(tok(r["prompt"])["input_ids"]) for r in rows]
    out = str(folder / "out")
    proc = run_script("sft.py", "--model", str(model), "--dataset", _write_jsonl(folder / "d.jsonl", rows),
                      "--output_dir", out, "--max_steps", "3", "--batch_size", "8", "--max_prompt_length", "5",
                      "--optim", "adamw")
    return {"proc": proc, "out": out, "too_long": sum(n > 5 for n in prompt_lengths)}


def test_long_prompts_are_cut_counted_and_logged(tiny_run):
    assert tiny_run["too_long"] == 2
    assert "2 prompts longer than --max_prompt_length 5" in tiny_run["proc"].stdout
    summary = json.load(open(os.path.join(tiny_run["out"], "summary.json")))
    assert summary["prompts_truncated"] == 2 and summary["completions_truncated"] == 0


def test_dataset_smaller_than_one_batch_cycles(tiny_run):
    assert "3 examples are fewer than one batch of 8" in tiny_run["proc"].stdout
    rows = [json.loads(line) for line in open(os.path.join(tiny_run["out"], "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss"] == r["loss"] for r in rows)
    idx = common.batch_indices(3, 8, seed=0, step=0)
    assert len(idx) == 8 and set(idx) == {0, 1, 2}  # every example, some twice


def test_empty_response_in_the_data_is_a_clear_error(tmp_path, tiny_qwen):
    bad = _write_jsonl(tmp_path / "empty.jsonl", [{"prompt": "POST: a . TL;DR:", "completion": " a ."},
                                                  {"prompt": "POST: b . TL;DR:", "completion": "  "}])
    proc = run_script("sft.py", "--model", tiny_qwen, "--dataset", bad, "--output_dir", str(tmp_path / "o"), check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "row 1, column 'completion'" in proc.stderr


def test_empty_generated_response_is_a_valid_completion(tiny_qwen):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen)
    ids, mask = common.encode_completions(tok, ["", " alice ."])
    assert ids[0, 0] == tok.eos_token_id and mask[0].tolist() == [1] + [0] * (mask.shape[1] - 1)  # EOS only
    p_ids, p_mask = common.encode_prompts(tok, ["POST: a . TL;DR:"] * 2)
    logprobs = sampling.completion_logprobs(model, p_ids, p_mask, ids, mask)
    assert torch.isfinite(logprobs).all() and (logprobs[0, 1:] == 0).all()
    assert sampling.decode_completions(tok, ids, mask, torch.tensor([False, False]))[0] == ""
    rewards = common.call_reward_fn(world.gold_reward, ["POST: alice bought the bike . TL;DR:"] * 2, ["", " alice ."])
    assert torch.isfinite(rewards).all()


def test_unknown_choices_fail_at_parse_time(tmp_path):
    env = {**os.environ, "TQDM_DISABLE": "1"}
    runs = {script: subprocess.Popen([sys.executable, script, *flag, "--output_dir", str(tmp_path / "o")], cwd=ROOT,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for script, flag in [("dpo.py", ["--loss_type", "hinge2"]), ("sft.py", ["--parallel", "zero3"]),
                                 ("grpo.py", ["--parallel", "fsdp2"])]}  # with the default --optim adamw_8bit
    expected = {"dpo.py": "--loss_type 'hinge2' is not one of: sigmoid", "sft.py": "--parallel 'zero3' is not one of: ddp, fsdp2",
                "grpo.py": "--parallel fsdp2 needs --optim adamw"}
    for script, proc in runs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 1 and expected[script] in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "o")  # nothing was loaded or written
    assert "--loss_type 'x' is not one of: a, b" in _error(common.check_choice, "--loss_type", "x", ["a", "b"])
