"""What a run folder holds (checkpoints.run_files / run_outputs), and #25's attack run: a folder
holding any run's output (model, adapters, checkpoints) is protected; --model inside --output_dir
is refused; --overwrite_output_dir removes all of the old run or nothing; adapters record what they
were trained on; filesystem failures and bad inputs end in one sentence. In-process, tiny models;
the full-disk and read-only cases mount a small tmpfs (root only; skipped with the reason otherwise)."""

import contextlib
import json
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch
from conftest import main_error, run_main

from rlhf import checkpoints
import common
from rlhf import data
import dpo
from rlhf.evaluation import policies
import sft


def _sft_flags(model, data_file, out, *extra):
    return ["--model", model, "--dataset", data_file, "--max_steps", "1", "--batch_size", "2", "--optim", "adamw",
            "--output_dir", str(out), *extra]


@contextlib.contextmanager
def tmpfs(path, options):
    """A tmpfs mounted at `path` (e.g. size=64k, or ro): root can; elsewhere the test is skipped."""
    os.makedirs(path, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or 'mount failed'}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# ------------------------------------------------------------------ data loss
def test_an_adapter_only_folder_is_protected(tmp_path, tiny_qwen, sft_data, monkeypatch, capsys):
    out = tmp_path / "lora"
    flags = _sft_flags(tiny_qwen, sft_data, out, "--use_peft", "--no_merge_adapters")
    run_main(sft, flags, monkeypatch)
    assert os.listdir(out / "adapter") and not (out / "config.json").exists()
    before = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    msg = main_error(sft, flags, monkeypatch, capsys)
    assert f"--output_dir {out} holds another run's adapters (adapter)" in msg and "--overwrite_output_dir" in msg
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == before
    assert not (out / ".lock").exists()  # #24: a finished run leaves no .lock (the refused one took none)


def test_model_inside_the_output_dir_is_refused_at_any_depth_and_through_links(tmp_path, tiny_qwen, monkeypatch, capsys):
    out = tmp_path / "run"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": tiny_qwen}))
    (out / "checkpoint-6").mkdir()
    (out / "checkpoint-6" / "config.json").write_text("{}")
    os.symlink(out, tmp_path / "link")
    for model, extra in [(out / "adapter", ["--use_peft", "--no_merge_adapters"]),
                         (out / "checkpoint-6", ["--overwrite_output_dir"]),
                         (tmp_path / "link" / "checkpoint-6", ["--overwrite_output_dir"])]:
        msg = main_error(sft, ["--model", str(model), "--output_dir", str(out), *extra], monkeypatch, capsys)
        assert f"--output_dir {out} holds the --model folder {model}" in msg, msg
    assert (out / "checkpoint-6" / "config.json").exists() and (out / "adapter" / "adapter_config.json").exists()


def test_overwrite_removes_every_file_of_the_old_run_and_keeps_link_targets(tmp_path, capsys):
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "adapter_config.json").write_text("{}")
    for name in ("metrics.jsonl", "completions.jsonl", "args.json", "tokenizer.json", "notes.txt"):
        (out / name).write_text("x")
    elsewhere.mkdir()
    (elsewhere / "trainer_state.pt").write_text("x")
    os.symlink(elsewhere, out / "checkpoint-3")  # a checkpoint linked to a folder outside
    args = SimpleNamespace(output_dir=str(out), resume=False, resume_from_checkpoint="", overwrite_output_dir=True)
    checkpoints.claim_output_dir(args)
    checkpoints.release_output_dir()
    assert sorted(os.listdir(out)) == ["notes.txt"]  # the user's own file stays; the old run's adapters do not
    assert (elsewhere / "trainer_state.pt").exists()  # the link went, not what it points to
    assert "the links checkpoint-3 only: what they point to is kept" in capsys.readouterr().out


def test_overwrite_removes_nothing_when_it_cannot_remove_everything(tmp_path, monkeypatch):
    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    for name in ("config.json", "metrics.jsonl", "summary.json"):
        (out / name).write_text("{}")
    real = os.rename

    def rename(src, dst):  # metrics.jsonl cannot move (as on a read-only mount inside the folder)
        if str(src).endswith("metrics.jsonl"):
            raise OSError(30, "Read-only file system")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    args = SimpleNamespace(output_dir=str(out), resume=False, resume_from_checkpoint="", overwrite_output_dir=True)
    with pytest.raises(SystemExit) as e:
        checkpoints.claim_output_dir(args)
    checkpoints.release_output_dir()
    assert f"cannot remove {out}/metrics.jsonl (Read-only file system); nothing of the previous run" in str(e.value)
    assert sorted(os.listdir(out)) == ["checkpoint-2", "config.json", "metrics.jsonl", "summary.json"]


# ------------------------------------------------------------------ silently wrong
def test_adapters_on_adapters_record_their_base_and_merge_every_stage(tmp_path, tiny_qwen, sft_data, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    first, second = tmp_path / "first", tmp_path / "second"
    run_main(sft, _sft_flags(tiny_qwen, sft_data, first, "--use_peft", "--no_merge_adapters", "--learning_rate", "1e-2"),
             monkeypatch)
    run_main(sft, _sft_flags(str(first / "adapter"), sft_data, second, "--use_peft", "--learning_rate", "1e-2"), monkeypatch)
    config = json.loads((second / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(first / "adapter")  # exactly what it was trained on
    assert (second / "summary.json").exists() and not (second / "final.tmp.tmp").exists()
    # the merged model = base + first adapters + second adapters
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen)
    chained = PeftModel.from_pretrained(PeftModel.from_pretrained(base, first / "adapter").merge_and_unload(),
                                        second / "adapter").merge_and_unload()
    merged = AutoModelForCausalLM.from_pretrained(second)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, chained(ids).logits, atol=1e-5)
        fresh = AutoModelForCausalLM.from_pretrained(tiny_qwen)  # merge_and_unload changed `base` in place
        assert not torch.allclose(merged(ids).logits, fresh(ids).logits, atol=1e-3)


def test_eval_cache_follows_an_adapters_base(tmp_path, tiny_qwen):
    import shutil

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    shutil.copytree(tiny_qwen, base)
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    (adapter / "adapter_model.safetensors").write_bytes(b"a")
    policies.weights_fingerprint.cache_clear()
    before = policies.weights_fingerprint(str(adapter))
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b" ")  # the base's weights replaced in place
    policies.weights_fingerprint.cache_clear()
    assert policies.weights_fingerprint(str(adapter)) != before


def test_a_reward_model_is_not_a_policy(tmp_path, tiny_qwen):
    from transformers import AutoModelForSequenceClassification

    rm = tmp_path / "rm"
    AutoModelForSequenceClassification.from_pretrained(tiny_qwen, num_labels=1).save_pretrained(rm)
    args = SimpleNamespace(dtype="float32", attn_implementation="auto", trust_remote_code=False)
    with pytest.raises(SystemExit) as e:
        common.load_model(str(rm), args)
    assert f"{rm} is a reward model (Qwen2ForSequenceClassification" in str(e.value)


def test_online_dpo_stops_on_a_nan_judge(tmp_path, tiny_qwen, monkeypatch, capsys):
    rewards = tmp_path / "r.py"
    rewards.write_text("def nan(prompts, completions, **kw):\n    return [float('nan')] * len(completions)\n")
    monkeypatch.setattr(common, "call_reward_fns", lambda fns, p, c, *a, **k: torch.full((len(c), len(fns)), float("nan")))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:"}) + "\n" for i in range(4)))
    msg = main_error(dpo, ["--online", "--model", tiny_qwen, "--dataset", str(prompts), "--reward_fn", f"{rewards}:nan",
                           "--max_steps", "1", "--batch_size", "2", "--max_new_tokens", "4", "--optim", "adamw",
                           "--output_dir", str(tmp_path / "o")], monkeypatch, capsys)
    assert "the judge's score is NaN at step 1" in msg
    assert not (tmp_path / "o" / "config.json").exists()


def test_data_folders_are_read_whole_or_refused(tmp_path):
    import pandas as pd

    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"prompt": "p", "completion": "c"}) + "\n" for _ in range(10)))
    pd.DataFrame({"prompt": ["p"] * 10, "completion": ["c"] * 10}).to_parquet(folder / "b.parquet")
    with pytest.raises(SystemExit) as e:
        data.load_data(str(folder))
    assert "mixes file types" in str(e.value) and "a.jsonl" in str(e.value) and "b.parquet" in str(e.value)
    os.remove(folder / "b.parquet")
    (folder / "c.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n")
    with pytest.raises(SystemExit) as e:
        data.load_data(str(folder))
    assert "mixes formats" in str(e.value) and "c.jsonl has" in str(e.value) and "chosen" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        data.load_data(str(tmp_path / "empty"))
    assert "holds no data files" in str(e.value)
    # borderline, decided: a UTF-8 file with a byte-order mark is read
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "p", "completion": "c"}).encode() + b"\n")
    assert data.load_data(str(bom)).column_names == ["prompt", "completion"]


# ------------------------------------------------------------------ one sentence, not a traceback
def test_read_only_and_new_folders_under_a_read_only_mount_fail_before_loading(tmp_path, tiny_qwen, sft_data,
                                                                                monkeypatch, capsys):
    with tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        monkeypatch.setattr(common, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
        for out in (ro, ro / "new" / "run"):
            msg = main_error(sft, _sft_flags(tiny_qwen, sft_data, out), monkeypatch, capsys)
            assert msg.startswith(f"error: cannot write {out} ({ro} is on a read-only file system)"), msg


def test_a_full_disk_is_one_sentence_and_keeps_the_checkpoints(tmp_path, tiny_qwen, sft_data, monkeypatch, capsys):
    import shutil

    size = os.path.getsize(os.path.join(tiny_qwen, "model.safetensors"))
    # a checkpoint is about 3 model sizes (weights and two AdamW moments): room for one and a half of them
    with tmpfs(tmp_path / "small", f"size={size * 9 // 2 // 1024 + 128}k") as small:
        # less room than the model takes: refused before the model loads
        (small / "filler").write_bytes(b"\0" * (shutil.disk_usage(small).free - size // 2))
        msg = main_error(sft, _sft_flags(tiny_qwen, sft_data, small / "run"), monkeypatch, capsys)
        assert "MB free, and saving a model the size of" in msg
        os.remove(small / "filler")
        # room for one checkpoint (weights + AdamW moments), not two: the first is kept, the half-written second removed
        msg = main_error(sft, _sft_flags(tiny_qwen, sft_data, small / "run", "--max_steps", "2", "--save_steps", "1",
                                         "--overwrite_output_dir"), monkeypatch, capsys)
        assert msg.startswith(f"error: cannot write {small / 'run'}/checkpoint-2") or "cannot write" in msg, msg
        assert "checkpoint-1" in msg and "intact" in msg and "the disk is full" in msg, msg
        assert sorted(n for n in os.listdir(small / "run") if n.startswith("checkpoint-")) == ["checkpoint-1"]
        # a summary that cannot be written: one sentence naming it
        (small / "filler").write_bytes(b"\0" * 10)
        with open(small / "filler2", "wb") as f:
            with contextlib.suppress(OSError):
                f.write(b"\0" * (size * 8))
        with pytest.raises(SystemExit) as e:
            checkpoints.write_json(str(small / "run" / "summary.json"), {"a": "x" * 100_000})
        assert f"cannot write {small / 'run'}/summary.json (No space left on device)" in str(e.value)


def test_a_trainer_state_without_step_is_one_sentence(tmp_path, tiny_qwen):
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    torch.save({"optimizer": {}}, folder / "trainer_state.pt")
    args = SimpleNamespace(resume=False, resume_from_checkpoint=str(folder), output_dir=str(tmp_path))
    with pytest.raises(SystemExit) as e:
        checkpoints.maybe_resume(args, None, None, None)
    assert "trainer_state.pt has no step, scheduler, rng" in str(e.value)


def test_a_reward_file_that_raises_at_import_is_one_sentence(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import not_a_module\n")
    with pytest.raises(SystemExit) as e:
        common.load_reward_fn(f"{bad}:f")
    assert f"importing {bad} raised ModuleNotFoundError" in str(e.value)


def test_resume_may_change_logging_flags(tmp_path):
    """#24: --log_completions is a logging flag; the README says those may change on resume."""
    saved = {"seed": 0, "max_steps": 4, "log_completions": False, "num_completions_to_print": 4}
    (tmp_path / "args.json").write_text(json.dumps(saved))
    args = SimpleNamespace(**{**saved, "log_completions": True, "num_completions_to_print": 2})
    checkpoints.check_resume_args(args, str(tmp_path), 2)
    with pytest.raises(SystemExit):
        checkpoints.check_resume_args(SimpleNamespace(**{**saved, "seed": 1}), str(tmp_path), 2)


# ------------------------------------------------------------------ borderline, decided
def test_a_diverged_run_says_so_and_does_not_look_like_success(tmp_path, tiny_llama, sft_data, monkeypatch, capsys):
    """lr 1e3: the loss jumps to ~1e7 and stays far above where it started."""
    out = tmp_path / "div"
    msg = main_error(sft, _sft_flags(tiny_llama, sft_data, out, "--learning_rate", "1e3", "--warmup_steps", "0",
                                     "--max_steps", "3"), monkeypatch, capsys)
    assert "the run diverged" in msg, msg
    assert "diverged" in json.loads((out / "summary.json").read_text())
    assert (out / "config.json").exists()  # saved, for inspection


@pytest.mark.parametrize("losses,grad_norm,diverged", [
    ([5.0, 2e7, 3e5], 1.0, True),  # far above the start at the end
    ([5.0, 2e7, 4.0], 0.0, True),  # blew up, then a zero gradient: the loss looks normal, nothing moves any more
    ([5.0, 2e7, 4.0], 0.3, False),  # blew up and came back, still learning
    ([5.0, 499.0, 499.0], 1.0, False),  # under 100-fold
])
def test_divergence_is_a_loss_that_stays_up_or_a_blow_up_that_left_no_gradient(tmp_path, losses, grad_norm, diverged):
    from rlhf import tracking

    rows = [{"step": i + 1, "loss": loss, "grad_norm": 1.0} for i, loss in enumerate(losses)]
    rows[-1]["grad_norm"] = grad_norm
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = tracking.divergence(str(tmp_path))
    assert bool(found) == diverged
    if diverged:
        assert found["diverged"] == (f"the loss rose from 5 (step 1) to 2e+07 (step 2) and ends at {losses[-1]:.3g} with "
                                     f"grad_norm {grad_norm:.3g}: the run diverged and its weights are likely destroyed; "
                                     "rerun with a lower --learning_rate.")


def test_resuming_an_older_checkpoint_abandons_the_newer_ones(tmp_path, tiny_qwen, sft_data, monkeypatch):
    out = tmp_path / "run"
    flags = _sft_flags(tiny_qwen, sft_data, out, "--max_steps", "3", "--save_steps", "1")
    run_main(sft, flags, monkeypatch)
    # back to step 1, and on to step 2 only
    run_main(sft, [*flags, "--max_steps", "2", "--resume_from_checkpoint", str(out / "checkpoint-1")], monkeypatch)
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == [
        "checkpoint-1", "checkpoint-2", "checkpoint-2.abandoned", "checkpoint-3.abandoned"]
    assert checkpoints.last_checkpoint(str(out)) == str(out / "checkpoint-2")  # --resume continues this run


# ------------------------------------------------------------------ #53's papercuts
def test_nan_and_inf_are_written_as_null(tmp_path):
    """summary.json (checkpoints.write_json) and metrics.jsonl (tracking.MetricsLogger): JSON has no
    NaN; a bare NaN is rejected by JSON.parse and jq, null is not."""
    from rlhf import tracking

    checkpoints.write_json(str(tmp_path / "summary.json"), {"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": -float("inf")}})
    text = (tmp_path / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"a": None, "b": [1.0, None], "c": {"d": None}}
    args = SimpleNamespace(output_dir=str(tmp_path / "run"), report_to="none", overwrite_output_dir=False, resume=False,
                           resume_from_checkpoint="")
    logger = tracking.MetricsLogger(args)
    logger.update({"loss": torch.tensor(float("nan")), "grad_norm": 2.0})
    logger.log(1)
    logger.close()
    line = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "NaN" not in line and json.loads(line) == {"step": 1, "loss": None, "grad_norm": 2.0}


def test_a_lora_run_shares_its_files_says_where_the_adapters_are_and_warns_nothing(tmp_path, tiny_qwen, sft_data,
                                                                                 monkeypatch, capsys):
    """Weights written 0666 less the umask like every other file (save_pretrained leaves them 0600);
    the last line names adapter/; SFT's summary has its time; no FutureWarning (peft's
    is_gradient_checkpointing read) on the way."""
    import warnings

    out = tmp_path / "lora"
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        run_main(sft, _sft_flags(tiny_qwen, sft_data, out, "--use_peft", "--save_steps", "1"), monkeypatch)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    umask = os.umask(0)
    os.umask(umask)
    for f in ("model.safetensors", "adapter/adapter_model.safetensors", "checkpoint-1/adapter_model.safetensors", "args.json"):
        assert os.stat(out / f).st_mode & 0o777 == 0o666 & ~umask, f
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith(f"saved the merged model to {out} and the LoRA adapters to {out / 'adapter'}/")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_seconds"] > 0 and summary["seconds_per_step"] > 0


def test_an_unreachable_hub_id_is_one_sentence_cut_at_a_word(monkeypatch):
    """Offline, the Hub's reason is kept whole (it was cut at 150 characters, mid-word)."""
    import huggingface_hub

    from rlhf import basics

    def refuse(reason):
        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, *a, **k: (_ for _ in ()).throw(OSError(reason)))
        with pytest.raises(SystemExit) as e:
            basics.check_hub_id("org/missing-model-53", "model")
        assert str(e.value).endswith("or download it while online.")
        return str(e.value).split("(OSError: ", 1)[1].rsplit("); check the path", 1)[0]

    offline = ("Cannot reach https://huggingface.co/api/models/org/missing-model-53: offline mode is enabled. To disable "
               "it, please unset the `HF_HUB_OFFLINE` environment variable.")
    assert refuse(offline) == offline  # huggingface_hub's whole sentence (185 characters)
    long = refuse(offline * 3)
    assert long.endswith(" ...") and (offline * 3).startswith(long[:-4]) and (offline * 3)[len(long) - 4] == " "
    assert basics.brief("a" * 10 + " bcdefgh", 12) == "aaaaaaaaaa ..." and basics.brief("short one") == "short one"


def test_eval_help_describes_evals_own_flags(monkeypatch, capsys):
    import sys

    import eval as ev

    monkeypatch.setattr(sys, "argv", ["eval.py", "--help"])
    with pytest.raises(SystemExit):
        common.parse_args(ev.Args)
    text = " ".join(capsys.readouterr().out.split())
    assert "--model" not in text  # the policies are arguments, not --model
    assert "Where results.json, results.md, judgments.jsonl, generations.jsonl, the plots" in text and "(default: runs/eval)" in text
    assert "--seed SEED Seed of the sampling" in text and "checkpoints" not in text.split("--seed")[1][:200]
