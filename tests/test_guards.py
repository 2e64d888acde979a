"""Guards against bad runs and out-of-range inputs: each one stops with a message a person can act
on (naming the step, flag, row or prompt), or counts and logs what it skipped or cut. Never a
crash deep in a stack.

Decisions (documented here and in the README):
- NaN/inf loss, reward or gradient norm: stop before the optimizer touches the weights, name the
  step, keep checkpoints; a checkpoint holding a NaN/inf weight is never written nor resumed from.
- chosen == rejected: kept (zero gradient) and counted in a printed note, not refused.
- an --output_dir holding another run: refused unless --resume or --overwrite_output_dir.
- prompts (completions) longer than --max_prompt_length (--max_completion_length): cut, counted
  up front, printed, and written to summary.json as prompts_truncated (completions_truncated).
- an empty response in the data: a clear error naming the row; an empty *generated* response
  is a valid completion (EOS only) that rewards score like any other.
- a dataset smaller than one batch: allowed; batch_indices cycles, so a batch repeats examples
  (a note is printed).
- an unknown --loss_type / --parallel / --optim / --lr_scheduler_type, a flag out of its range, an
  unknown flag (with our name for a TRL flag): an error at parse time, before anything loads.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import run_script

from rlhf import checkpoints
import common
from rlhf import data
from rlhf import sampling
from worlds import world


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
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("guards")
    sft = [{"prompt": f"POST: alice bought the bike {i} . TL;DR:", "completion": " alice bought bike ."}
           for i in range(12)]
    return {"sft": _write_jsonl(folder / "sft.jsonl", sft), "folder": folder}


# ------------------------------------------------------------------ NaN / inf
def test_nan_loss_stops_naming_the_step_and_keeps_the_last_checkpoint(tmp_path, tiny_qwen, files):
    out = str(tmp_path / "nan")
    # a learning rate of 1e30 sends the weights to ~1e30 at step 1; step 2's logits overflow
    proc = run_script("sft.py", "--model", tiny_qwen, "--dataset", files["sft"], "--output_dir", out, "--max_steps", "4",
                      "--batch_size", "4", "--save_steps", "1", "--learning_rate", "1e30", "--warmup_steps", "0",
                      "--optim", "adamw", "--max_grad_norm", "0", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "loss is NaN at step 2" in proc.stderr and "--resume" in proc.stderr
    assert os.path.exists(os.path.join(out, "checkpoint-1", "trainer_state.pt"))
    assert not os.path.exists(os.path.join(out, "checkpoint-2"))
    assert checkpoints.last_checkpoint(out) == os.path.join(out, "checkpoint-1")


def test_check_finite_names_what_and_when():
    common.check_finite("reward", torch.tensor([0.5, -1.0]), 3)  # finite: passes silently
    assert "reward is inf at step 7" in _error(common.check_finite, "reward", torch.tensor([0.5, float("inf")]), 7)
    assert "loss is NaN at step 1" in _error(common.check_finite, "loss", float("nan"), 1)


def test_nan_reward_from_a_reward_function_names_the_prompt():
    msg = _error(common.call_reward_fns, [lambda prompts, completions, **kw: [1.0, float("nan")]], ["p0", "the bad one"], ["a", "b"])
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
def tiny_run(tmp_path_factory):
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
    idx = data.batch_indices(3, 8, seed=0, step=0)
    assert len(idx) == 8 and set(idx) == {0, 1, 2}  # every example, some twice


def test_empty_response_in_the_data_is_a_clear_error(tmp_path, tiny_qwen, monkeypatch, capsys):
    import sft
    from conftest import main_error

    bad = _write_jsonl(tmp_path / "empty.jsonl", [{"prompt": "POST: a . TL;DR:", "completion": " a ."},
                                                  {"prompt": "POST: b . TL;DR:", "completion": "  "}])
    message = main_error(sft, ["--model", tiny_qwen, "--dataset", bad, "--output_dir", str(tmp_path / "o")], monkeypatch, capsys)
    assert "row 1, column 'completion'" in message


def test_empty_generated_response_is_a_valid_completion(tiny_qwen):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen)
    ids, mask = data.encode_completions(tok, ["", " alice ."])
    assert ids[0, 0] == tok.eos_token_id and mask[0].tolist() == [1] + [0] * (mask.shape[1] - 1)  # EOS only
    p_ids, p_mask = data.encode_prompts(tok, ["POST: a . TL;DR:"] * 2)
    logprobs = sampling.completion_logprobs(model, p_ids, p_mask, ids, mask)
    assert torch.isfinite(logprobs).all() and (logprobs[0, 1:] == 0).all()
    assert sampling.decode_completions(tok, ids, mask, torch.tensor([False, False]))[0] == ""
    rewards = common.call_reward_fns([world.gold_reward], ["POST: alice bought the bike . TL;DR:"] * 2, ["", " alice ."])
    assert torch.isfinite(rewards).all()


def test_unknown_choices_fail_at_parse_time(tmp_path, monkeypatch, capsys):
    import importlib

    from conftest import main_error

    finished = tmp_path / "finished"  # another run's final model and checkpoint: refused without --resume/--overwrite_output_dir
    (finished / "checkpoint-4").mkdir(parents=True)
    (finished / "config.json").write_text("{}")
    (finished / "metrics.jsonl").write_text('{"step": 4}\n')
    out = ["--output_dir", str(tmp_path / "o")]
    cases = [("dpo", ["--loss_type", "hinge2", *out], "--loss_type 'hinge2' is not one of: sigmoid"),
             ("sft", ["--parallel", "zero3", *out], "--parallel 'zero3' is not one of: ddp, fsdp2"),
             ("grpo", ["--parallel", "fsdp2", "--optim", "adamw_8bit", *out], "--parallel fsdp2 needs --optim adamw"),  # --optim auto picks adamw
             ("ppo", ["--output_dir", str(finished)],
              f"--output_dir {finished} holds another run's model and checkpoints (checkpoint-4, config.json)")]
    for script, argv, expected in cases:
        message = main_error(importlib.import_module(script), argv, monkeypatch, capsys)
        assert expected in message and "Traceback" not in message
    assert not os.path.exists(tmp_path / "o")  # nothing was loaded or written
    assert sorted(os.listdir(finished)) == ["checkpoint-4", "config.json", "metrics.jsonl"]
    assert (finished / "metrics.jsonl").read_text() == '{"step": 4}\n'
    assert "--loss_type 'x' is not one of: a, b" in _error(common.check_choice, "--loss_type", "x", ["a", "b"])


# ------------------------------------------------------------------ what changes the weights (#18)
def test_nan_gradient_stops_before_the_optimizer_touches_the_weights():
    # a finite loss can have NaN gradients (sft.py --learning_rate 1e3 did, and saved an all-NaN checkpoint)
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    model.weight.grad[0, 0] = float("nan")
    assert "the gradient norm is NaN at step 5" in _error(common.optimizer_step, optimizer, 1.0, 5)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_no_checkpoint_holds_a_nan_weight_and_none_is_resumed(tmp_path, tiny_qwen):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    args = SimpleNamespace(learning_rate=1e-2, weight_decay=0.0, optim="adamw", lr_scheduler_type="constant",
                           warmup_steps=0, max_steps=10, output_dir=str(tmp_path), seed=0, resume=True,
                           resume_from_checkpoint="")
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen)
    optimizer = common.make_optimizer(model, args)
    scheduler = common.make_scheduler(optimizer, args)
    checkpoints.save_checkpoint(model, None, args, f"{tmp_path}/checkpoint-1", checkpoints.training_state(1, optimizer, scheduler))
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    msg = _error(checkpoints.save_checkpoint, model, None, args, f"{tmp_path}/checkpoint-2", checkpoints.training_state(2, optimizer, scheduler))
    assert "model.norm.weight holds NaN/inf; not saving" in msg and not os.path.exists(f"{tmp_path}/checkpoint-2")
    # one written before this guard existed: --resume refuses it and offers the previous one
    checkpoints._save_folder(model, None, args, f"{tmp_path}/checkpoint-2", checkpoints.training_state(2, optimizer, scheduler), None)
    msg = _error(checkpoints.maybe_resume, args, model, optimizer, scheduler)
    assert "checkpoint-2: the weight model.norm.weight holds NaN/inf" in msg
    assert f"--resume_from_checkpoint {tmp_path}/checkpoint-1" in msg
    # a torn weights file: named, with the previous checkpoint offered
    with open(f"{tmp_path}/checkpoint-2/model.safetensors", "r+b") as f:
        f.truncate(1000)
    msg = _error(checkpoints.maybe_resume, args, model, optimizer, scheduler)
    assert "checkpoint-2/model.safetensors cannot be read" in msg and "checkpoint-1" in msg


def test_nan_logits_are_a_sentence_not_a_multinomial_error(tiny_qwen):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen)
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    ids, mask = data.encode_prompts(tok, ["POST: a . TL;DR:"])
    msg = _error(sampling.generate, model, tok, ids, mask, 4)
    assert "next-token logits hold NaN/inf (generated token 1)" in msg and "--learning_rate" in msg


def test_a_causal_lm_is_not_a_reward_model(tiny_qwen):
    # eval.py --judge rm:, grpo.py / ppo.py / dpo.py --reward_model all load through load_reward_model
    args = type("A", (), {"dtype": "float32", "attn_implementation": "sdpa", "trust_remote_code": False,
                          "gradient_checkpointing": False})()
    msg = _error(common.load_reward_model, tiny_qwen, args)
    assert f"{tiny_qwen} is not a reward model" in msg and "score.weight" in msg and "reward.py" in msg


# ------------------------------------------------------------------ output folders (#18)
def test_output_folder_is_protected_and_locked(tmp_path, tiny_qwen):
    from types import SimpleNamespace

    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "summary.json").write_text("{}")
    args = SimpleNamespace(output_dir=str(out), model=tiny_qwen, resume=False, resume_from_checkpoint="",
                           overwrite_output_dir=False, estimate_memory=False)
    msg = _error(checkpoints.check_output_dir, args)
    assert "holds another run's model and checkpoints (checkpoint-2, config.json)" in msg and "--overwrite_output_dir" in msg
    assert "is the --model folder" in _error(checkpoints.check_output_dir, SimpleNamespace(**{**vars(args), "output_dir": tiny_qwen}))
    args.overwrite_output_dir = True
    checkpoints.check_output_dir(args)
    # a live run holds <output_dir>/.lock: a second one is refused; the OS frees it when the holder dies
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(120)",
                               str(out / ".lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    assert "another run is writing to" in _error(checkpoints.claim_output_dir, args)
    assert os.path.exists(out / "checkpoint-2")  # nothing removed by the refused run
    holder.kill()
    holder.wait()
    checkpoints.claim_output_dir(args)  # after the holder's crash: free again; the previous run's leftovers go
    assert sorted(os.listdir(out)) == [".lock"]  # nothing of the previous run looks current
    # held by this process now: another process is refused, a second run in this process (a resume) reuses it
    probe = subprocess.run([sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a+')\n"
                            "try: fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError: print('busy')",
                            str(out / ".lock")], capture_output=True, text=True)
    assert probe.stdout.strip() == "busy"
    checkpoints.claim_output_dir(args)
    checkpoints._LOCK.close()
    checkpoints._LOCK = None


# ------------------------------------------------------------------ validation before anything loads (#18)
@pytest.mark.parametrize("script, argv, expected", [
    ("sft.py", ["--warmup_steps", "-3"], "--warmup_steps must be at least 0, got -3"),
    ("sft.py", ["--save_steps", "-1"], "--save_steps must be at least 0"),
    ("sft.py", ["--learning_rate", "-1"], "--learning_rate must be positive, got -1.0"),
    ("sft.py", ["--max_completion_length", "0"], "--max_completion_length must be at least 1"),
    ("sft.py", ["--lr_scheduler_type", "cosine_annealing"], "--lr_scheduler_type 'cosine_annealing' is not one of: linear, cosine"),
    ("ppo.py", ["--missing_eos_penalty", "nan"], "--missing_eos_penalty must be a finite number"),
    ("grpo.py", ["--temperature", "0"], "--temperature must be positive"),
    ("sft.py", ["--per_device_train_batch_size", "4"], "TRL's --per_device_train_batch_size is --batch_size here (Examples per micro-batch"),
    ("grpo.py", ["--per_device_train_batch_size", "4"], "is --batch_size here (Prompts per micro-batch"),
    ("sft.py", ["--warmup_ratio", "0.1"], "TRL's --warmup_ratio is --warmup_steps here"),
    ("grpo.py", ["--eval_reward_fn", "gold"], "--eval_reward_fn gold scores the --eval_dataset completions: add --eval_dataset"),
    ("ppo.py", ["--eval_reward_fn", "gold,x.py:f"], "--eval_reward_fn gold,x.py:f scores the --eval_dataset completions"),
    ("eval.py", ["--judge", "gold", "runs/sft"], "unexpected argument(s) runs/sft: every setting is a --flag value pair "
                                                 "(a script that takes bare arguments wants them before the first --flag)"),
])
def test_bad_flags_fail_before_anything_loads(monkeypatch, tmp_path, script, argv, expected):
    import importlib

    Args = importlib.import_module(script[:-3]).Args
    monkeypatch.setattr(sys, "argv", [script, *argv, "--output_dir", str(tmp_path / "o")])
    assert expected in _error(common.parse_args, Args)
    assert not os.path.exists(tmp_path / "o")
    monkeypatch.setattr(sys, "argv", [script, "--output_dir", str(tmp_path / "o")])
    common.parse_args(Args)  # the defaults pass


# ------------------------------------------------------------------ one sentence, not a traceback (#18)
def test_bad_data_files_are_one_sentence(tmp_path):
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n\n")
    assert "blank.jsonl is empty (no JSON rows" in _error(data.load_data, str(blank))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    assert "latin.jsonl, line 2: not UTF-8 (byte 0xe9 at column 16)" in _error(data.load_data, str(latin))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    assert "empty.parquet has no rows" in _error(data.load_data, str(tmp_path / "empty.parquet"))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    assert "train.jsonl, line 2: not valid JSON" in _error(data.load_data, str(folder))
    assert "dataset ./nope does not exist" in _error(data.load_data, "./nope")


def test_empty_conversational_responses_and_identical_pairs(capsys):
    from datasets import Dataset

    user = {"role": "user", "content": "POST: a . TL;DR:"}
    msgs = Dataset.from_list([{"messages": [user, {"role": "assistant", "content": " "}]}])
    assert "row 0, column 'messages': the last assistant message is empty" in _error(data.sft_pairs, msgs, "m.jsonl")
    conv = Dataset.from_list([{"chosen": [user, {"role": "assistant", "content": ""}],
                               "rejected": [user, {"role": "assistant", "content": "b"}]}])
    assert "row 0, column 'chosen': the last assistant message is empty" in _error(data.preference_triples, conv, "p.jsonl")
    with_prompt = Dataset.from_list([{"prompt": [user], "chosen": [{"role": "assistant", "content": ""}],
                                      "rejected": [{"role": "assistant", "content": "b"}]}])
    assert "row 0, column 'chosen'" in _error(data.preference_triples, with_prompt, "p.jsonl")
    same = Dataset.from_list([{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "c", "rejected": "c"}])
    assert len(data.preference_triples(same, "p.jsonl")) == 2  # kept, but counted
    assert "1 of 2 pairs of p.jsonl have chosen == rejected (first: row 1)" in capsys.readouterr().out


def test_bad_model_folders_are_one_sentence(tmp_path, tiny_qwen):
    import shutil

    args = type("A", (), {"dtype": "float32", "attn_implementation": "sdpa", "trust_remote_code": False})()
    no_tok = tmp_path / "no_tok"
    shutil.copytree(tiny_qwen, no_tok, ignore=shutil.ignore_patterns("tokenizer*"))
    assert "holds no tokenizer" in _error(common.load_tokenizer, str(no_tok))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no model (no config.json)" in _error(common.load_model, str(empty), args)
    torn = tmp_path / "torn"
    shutil.copytree(tiny_qwen, torn)
    with open(torn / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(torn / "model.safetensors") // 2)
    msg = _error(common.load_model, str(torn), args)
    assert f"{torn}/model.safetensors cannot be loaded" in msg and "torn or corrupt" in msg
    small = tmp_path / "small"  # a vocabulary smaller than the tokenizer
    tok = world.build_tokenizer()
    world.build_model(tok, hidden_size=32, num_layers=1).save_pretrained(small)
    tok.add_tokens(["zebra", "quokka"])
    tok.save_pretrained(small)
    common.load_tokenizer(str(small))
    # not a folder here (e.g. a relative path with a typo) and not on the Hub (offline here): one sentence
    assert "nobody-xyz/no-such-model is not a local folder and the Hugging Face Hub cannot provide it" in _error(
        common.check_model_source, "nobody-xyz/no-such-model")
    assert f"the tokenizer has {len(tok)} tokens but the model's embedding only {len(tok) - 2}" in _error(
        common.load_model, str(small), args)


def test_reward_functions_return_any_real_number_and_may_not_exit():
    import numpy as np

    rewards = common.call_reward_fns([lambda completions, **kw: [np.float32(0.5), torch.tensor(-1.0), 2, np.int64(3)]], list("abcd"), list("wxyz"))[:, 0]
    assert rewards.tolist() == [0.5, -1.0, 2.0, 3.0]
    assert "returned True for prompt 0" in _error(common.call_reward_fns, [lambda completions, **kw: [True]], ["a"], ["b"])
    assert "returned tensor([1., 2.])" in _error(common.call_reward_fns, [lambda completions, **kw: [torch.tensor([1.0, 2.0])]], ["a"], ["b"])

    def quits(prompts, completions, **kw):
        import sys

        if any("bad" in p for p in prompts):
            sys.exit(3)
        return [1.0] * len(prompts)

    msg = _error(common.call_reward_fns, [quits], ["ok", "a bad one"], ["x", "y"])
    assert "reward function quits raised SystemExit: 3" in msg and "prompt 1" in msg and "a bad one" in msg


def test_help_imports_no_heavy_module():
    """--help parses Args only: it must not import datasets, the distributed-tensor stack or
    transformers' model code (14 s before, now torch + transformers' argument parser alone)."""
    import subprocess
    import sys

    from conftest import ROOT

    heavy = ("datasets", "torch.distributed.tensor", "transformers.cache_utils", "transformers.modeling_utils")
    code = ("import runpy, sys\nsys.argv = ['grpo.py', '--help']\ntry:\n    runpy.run_path('grpo.py', run_name='__main__')\n"
            f"except SystemExit:\n    pass\nprint('loaded:', [m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    assert "loaded: []" in out, out[-500:]
    # --no_merge_adapters has its own help (HF's parser repeated --merge_adapters' "also writes the adapters merged")
    no_merge = out[out.index("  --no_merge_adapters"):]
    assert "writes only the" in no_merge[:300] and "also writes" not in no_merge[:300]


def test_a_crash_while_saving_leaves_no_half_checkpoint(tmp_path, tiny_qwen, monkeypatch):
    """A checkpoint is written to <folder>.tmp and renamed into place: a crash in the middle of a
    save (here the tokenizer's save raises) leaves the earlier checkpoint of that name whole and no
    half checkpoint under a new name. save_final moves the model into <output_dir> with
    config.json last, so a crash during the moves never leaves a loadable half-model."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    class Crash(Exception):
        pass

    class CrashingTokenizer:
        def save_pretrained(self, path):
            raise Crash

    args = SimpleNamespace(output_dir=str(tmp_path), save_total_limit=0)
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_qwen), AutoTokenizer.from_pretrained(tiny_qwen)
    checkpoints.save_checkpoint(model, tok, args, f"{tmp_path}/checkpoint-2")
    whole = sorted(os.listdir(tmp_path / "checkpoint-2"))
    assert {"config.json", "model.safetensors", "args.json", "tokenizer.json"} <= set(whole)
    for step in (2, 4):  # a crash while overwriting checkpoint-2, and while writing a new checkpoint-4
        with pytest.raises(Crash):
            checkpoints.save_checkpoint(model, CrashingTokenizer(), args, f"{tmp_path}/checkpoint-{step}")
    assert sorted(os.listdir(tmp_path / "checkpoint-2")) == whole and not os.path.exists(tmp_path / "checkpoint-4")
    AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-2")  # still loads

    moved, replace = [], os.replace

    def recorded(src, dst):
        moved.append(os.path.basename(dst))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", recorded)
    checkpoints.save_final(model, tok, args)
    assert moved[-1] == "config.json" and "model.safetensors" in moved
    AutoModelForCausalLM.from_pretrained(tmp_path)
