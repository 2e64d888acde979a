"""Never lose a run, round three (#54): no reward is silently zero or wrong, model output never
crashes a run, and a run's end never discards its model. Each case runs through the script's
main() in this process, on the tiny models of conftest.py, and fails without its fix:

- silently wrong: NaN reward weights, a reward function returning a dict or a set, rewards of 0 and
  1e20 (float32's variance overflowed: every advantage 0), two rewards of one name, the gold
  judge on another world's prompts, a tool that prints, a sweep axis repeated after `--`;
- one sentence, not a traceback: a reward beyond float32, an async generator, a tool call that
  cannot be parsed, a --tools file that raises, a huge --seed, a dangling --output_dir link, a
  full disk in a safetensors save;
- a run's work: a wrong --eval_dataset stops before step 1, a failing final evaluation comes after
  the final save, `make demo SEED="0 1"` stops, and --resume refuses a changed reward file or dataset.
"""

import errno
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, main_error, run_main

from rlhf import tools
import grpo
import ppo
import sweep

REWARDS = '''
def length(completions, **kw):
    return [float(len(c)) for c in completions]


def as_dict(completions, **kw):
    return {c: 1.0 for c in completions}


def as_set(completions, **kw):
    return {float(i) for i in range(len(completions))}


def beyond_float32(completions, **kw):
    return [1e39] * len(completions)


async def agen(completions, **kw):
    for c in completions:
        yield 1.0


def separating(completions, **kw):  # 0 and 1e20 within every group of two
    return [1e20 * (i % 2) for i in range(len(completions))]


def bonus_reader(completions, **kw):  # reads a column through **kw: no signature says so
    return [float(b) for b in kw["bonus"]]
'''

HALF = "def half(completions, **kw):\n    return [{}] * len(completions)\n"


@pytest.fixture
def files(tmp_path):
    """prompts.jsonl (bonus and tests columns), eval.jsonl (prompt only), foreign.jsonl (no post of
    the embedded world), r.py (REWARDS), a.py and b.py (a function `half` each)."""
    def write(name, rows):
        with open(tmp_path / name, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    write("prompts.jsonl", [{"prompt": f"POST: bob sold the car {i} . TL;DR:", "bonus": i, "tests": ["assert f(1) == 1"]}
                            for i in range(8)])
    write("eval.jsonl", [{"prompt": f"POST: alice bought the bike {i} . TL;DR:"} for i in range(3)])
    write("foreign.jsonl", [{"prompt": f"POST: i think the {i} . TL;DR:"} for i in range(8)])
    (tmp_path / "r.py").write_text(REWARDS)
    (tmp_path / "a.py").write_text(HALF.format("0.5"))
    (tmp_path / "b.py").write_text(HALF.format("0.25"))
    return {k: str(tmp_path / k) for k in ("prompts.jsonl", "eval.jsonl", "foreign.jsonl", "r.py", "a.py", "b.py")}


def tiny_grpo(model, files, *extra, module=grpo):
    return ["--model", model, "--dataset", files["prompts.jsonl"], "--batch_size", "2",
            *(["--num_generations", "2"] if module is grpo else []),
            "--max_steps", "1", "--max_completion_length", "4", "--optim", "adamw", *extra]


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------ rewards: silently wrong, or a traceback
@pytest.mark.parametrize("reward_fn, weights, dataset, expected", [
    ("r.py:length", "nan", None, "--reward_weights 'nan': every weight must be a finite number"),
    ("r.py:length,a.py:half", "0,nan", None, "--reward_weights '0,nan': every weight must be a finite number"),
    ("r.py:as_dict", "", None, "reward function as_dict returned a dict; it must return a list with one reward per completion"),
    ("r.py:as_set", "", None, "reward function as_set returned a set; it must return a list"),
    ("r.py:beyond_float32", "", None, "returned 1e+39 for completion 0 of prompt 0"),
    ("r.py:agen", "", None, "reward function agen returned a async_generator; it must return a list"),
    ("a.py:half,b.py:half", "", None, "two rewards are named 'half', and rewards/half/mean can log only one of them"),
    ("gold", "", "foreign.jsonl", "reward function gold_reward raised ValueError: the prompt holds no post of the embedded world"),
], ids=["nan_weight", "nan_weight_of_two", "dict", "set", "beyond_float32", "async_generator", "one_name", "gold_elsewhere"])
def test_a_wrong_reward_stops_with_one_sentence(tmp_path, tiny_qwen, files, monkeypatch, capsys, reward_fn, weights,
                                                 dataset, expected):
    spec = ",".join(s if s == "gold" else os.path.join(tmp_path, s) for s in reward_fn.split(","))
    argv = tiny_grpo(tiny_qwen, files, "--reward_fn", spec, "--output_dir", str(tmp_path / "out"))
    if weights:
        argv += ["--reward_weights", weights]
    if dataset:
        argv[argv.index("--dataset") + 1] = files[dataset]
    message = main_error(grpo, argv, monkeypatch, capsys)
    assert expected in message and "Traceback" not in message
    assert not os.path.exists(tmp_path / "out" / "config.json")


def test_rewards_of_0_and_1e20_give_full_size_advantages(tmp_path, tiny_qwen, files, monkeypatch):
    """Finite rewards that separate perfectly: float32's variance of 0 and 1e20 overflowed (std inf),
    every advantage was 0 (no gradient) and metrics.jsonl held Infinity."""
    out = str(tmp_path / "out")
    run_main(grpo, tiny_grpo(tiny_qwen, files, "--reward_fn", f"{files['r.py']}:separating", "--beta", "0",
                             "--log_completions", "--output_dir", out), monkeypatch)
    (row,) = metrics(out)
    assert math.isfinite(row["reward_std"]) and row["reward_std"] == pytest.approx(1e20 / math.sqrt(2), rel=1e-5)
    assert row["grad_norm"] > 0
    with open(os.path.join(out, "completions.jsonl")) as f:
        advantages = [r["advantage"] for r in map(json.loads, f)]
    assert sorted(advantages) == pytest.approx([-1 / math.sqrt(2)] * 2 + [1 / math.sqrt(2)] * 2, rel=1e-3)
    # ppo.py whitens its advantages over the batch: the same overflow, the same fix
    whitened = ppo.masked_whiten(torch.tensor([[0.0, 1e20]]), torch.ones(1, 2))
    torch.testing.assert_close(whitened, torch.tensor([[-1.0, 1.0]]))


# ------------------------------------------------------------------ tools: model output never stops a run
@pytest.mark.parametrize("body, expected", [
    ("[" * 5000 + "]" * 5000, "the tool call cannot be read (RecursionError"),
    ('{"name": "add", "arguments": {"a": ' + "9" * 5000 + ', "b": 1}}', "the tool call cannot be read (ValueError"),
    ('{"name": "add", "arguments": "' + "[" * 5000 + '"}', 'a tool call must be {"name": <string>, "arguments": <object>}'),
], ids=["nested", "digits", "nested_arguments"])
def test_a_tool_call_that_cannot_be_parsed_is_a_failed_call(body, expected):
    (call,) = tools.parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(call, str) and call.startswith(expected)
    ((name, reply, failed),) = tools.execute([call], [])
    assert failed and reply.startswith("error: ")


def test_a_tool_that_prints_returns_its_answer(tmp_path):
    """A tool's own prints (at import and in the call, to stdout and stderr) filled the sandbox's
    2,000 kept characters, pushed the reply out and made a correct answer a failed call."""
    path = tmp_path / "chatty.py"
    path.write_text('print("loading " * 500)\n\n\n'
                    'def chatty(n: int) -> int:\n    """Add one, loudly.\n\n    Args:\n        n: the number\n    """\n'
                    '    import sys\n    print("working " * 1000)\n    print("warn " * 100, file=sys.stderr)\n'
                    '    return n + 1\n')
    tool_list = tools.load_tools(f"{path}:chatty")
    assert tools.execute([{"name": "chatty", "arguments": {"n": 41}}], tool_list) == [("chatty", "42", False)]


@pytest.mark.parametrize("source, expected", [
    ("raise RuntimeError('no config')\n", "importing {path} raised RuntimeError: no config; fix the file"),
    ("def f(:\n", "importing {path} raised SyntaxError"),
    ("import sys\nsys.exit(3)\n", "importing {path} raised SystemExit: 3"),
], ids=["raises", "syntax", "exits"])
def test_a_tools_file_that_fails_at_import_is_one_sentence(tmp_path, tiny_qwen, files, monkeypatch, capsys, source,
                                                          expected):
    path = tmp_path / "bad_tool.py"
    path.write_text(source)
    message = main_error(grpo, tiny_grpo(tiny_qwen, files, "--tools", f"{path}:f", "--output_dir", str(tmp_path / "o")),
                         monkeypatch, capsys)
    assert f"--tools '{path}:f': " + expected.format(path=path) in message


# ------------------------------------------------------------------ flags and folders
def test_a_huge_seed_is_one_sentence_before_anything_loads(tmp_path, tiny_qwen, files, monkeypatch, capsys):
    for seed in ("99999999999999999999", "-1"):
        argv = tiny_grpo(tiny_qwen, files, "--reward_fn", f"{files['r.py']}:length", "--seed", seed, "--output_dir",
                         str(tmp_path / "o"))
        message = main_error(grpo, argv, monkeypatch, capsys)
        assert f"--seed must be in 0..4294967295, got {seed}." in message
    assert not os.path.exists(tmp_path / "o")


def test_a_dangling_output_link_is_one_sentence_before_anything_loads(tmp_path, tiny_qwen, files, monkeypatch, capsys):
    link = tmp_path / "out"
    os.symlink(tmp_path / "gone", link)
    argv = tiny_grpo(tiny_qwen, files, "--reward_fn", f"{files['r.py']}:length", "--output_dir", str(link))
    message = main_error(grpo, argv, monkeypatch, capsys)
    assert f"--output_dir {link} is a link to {tmp_path / 'gone'}, which does not exist" in message


@pytest.mark.parametrize("error", ["safetensors", "enospc"])
def test_a_full_disk_in_a_safetensors_save_is_one_sentence_and_leaves_no_tmp(tmp_path, tiny_qwen, files, monkeypatch,
                                                                            capsys, error):
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def full_disk(*args, **kwargs):
        if error == "safetensors":  # what safetensors' Rust writer raises on ENOSPC
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                  'message: "No space left on device" })')
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    out = tmp_path / "out"
    argv = tiny_grpo(tiny_qwen, files, "--reward_fn", f"{files['r.py']}:length", "--save_steps", "1", "--output_dir", str(out))
    message = main_error(grpo, argv, monkeypatch, capsys)
    assert f"cannot write {out}/checkpoint-1 (" in message and "No space left on device" in message
    assert "the half-written copy was removed" in message
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


@pytest.mark.parametrize("fixed", [["--num_generations", "8"], ["--num_generations=8"], ["--num-generations", "8"]])
def test_a_sweep_axis_repeated_after_the_separator_is_refused(tmp_path, monkeypatch, capsys, fixed):
    script = tmp_path / "fake.py"
    script.write_text("")
    with pytest.raises(SystemExit) as e:
        sweep.parse([str(script), "--num_generations", "4,16", "--", "--model", "m", *fixed])
    assert "is an axis of the sweep and is repeated after '--'" in str(e.value)
    sweep.parse([str(script), "--num_generations", "4,16", "--", "--model", "m"])  # on one side only: fine


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_takes_one_integer_seed():
    def make(*argv):
        return subprocess.run(["make", "-n", "demo", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)

    for bad in ('SEED=0 1', 'SEED=1;x', 'JOBS=two'):
        proc = make(bad)
        assert proc.returncode != 0 and "is not one integer: pass one" in proc.stderr, proc.stderr
    assert make("SEED=3").returncode == 0


# ------------------------------------------------------------------ a run's work: eval data, final save, resume
@pytest.mark.parametrize("module, flags, expected", [
    (grpo, ["--reward_fn", "exec_tests"], "reward function exec_tests reads the column 'tests', which --eval_dataset "
                                          "{eval} does not have (its columns: prompt)"),
    (ppo, ["--reward_fn", "exec_tests"], "reward function exec_tests reads the column 'tests', which --eval_dataset "
                                         "{eval} does not have (its columns: prompt)"),
    (grpo, ["--reward_fn", "{r}:length", "--eval_reward_fn", "gold"],
     "--eval_dataset {eval} cannot be scored (checked on its first row before step 1: nothing was trained): reward "
     "function gold_reward raised ValueError: the prompt holds no post of the embedded world"),
], ids=["grpo", "ppo", "gold"])
def test_an_eval_dataset_the_rewards_cannot_score_stops_before_step_1(tmp_path, tiny_qwen, files, monkeypatch, capsys,
                                                                      module, flags, expected):
    """exec_tests reads the training data's `tests` column, gold only the embedded world's posts: an
    --eval_dataset without them was found only at the final evaluation, which then stopped the run
    before the final save."""
    out = tmp_path / "out"
    eval_data = files["foreign.jsonl"] if "gold" in flags else files["eval.jsonl"]
    argv = tiny_grpo(tiny_qwen, files, *[f.format(r=files["r.py"]) for f in flags], "--eval_dataset", eval_data,
                     "--output_dir", str(out), module=module)
    message = main_error(module, argv, monkeypatch, capsys)
    assert expected.format(eval=eval_data) in message
    assert not os.path.exists(out / "metrics.jsonl")  # no step was trained


@pytest.mark.parametrize("module", [grpo, ppo])
def test_a_failing_final_evaluation_comes_after_the_final_save(tmp_path, tiny_qwen, files, monkeypatch, capsys, module):
    """A reward that reads a column through **kwargs cannot be checked before step 1; when the
    --eval_dataset lacks it, the final evaluation fails, but the trained model is saved first."""
    out = tmp_path / "out"
    argv = tiny_grpo(tiny_qwen, files, "--reward_fn", f"{files['r.py']}:bonus_reader", "--eval_dataset",
                     files["eval.jsonl"], "--output_dir", str(out), module=module)
    message = main_error(module, argv, monkeypatch, capsys)
    assert "reward function bonus_reader raised KeyError: 'bonus'" in message
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    assert [r["step"] for r in metrics(out)] == [1]  # the training step was logged


@pytest.mark.parametrize("changed", ["r.py", "prompts.jsonl"])
def test_resume_refuses_a_reward_file_or_dataset_that_changed(tmp_path, tiny_qwen, files, monkeypatch, capsys, changed):
    out = str(tmp_path / "out")
    argv = tiny_grpo(tiny_qwen, files, "--reward_fn", f"{files['r.py']}:length", "--save_steps", "1", "--output_dir", out)
    run_main(grpo, argv, monkeypatch)
    with open(files[changed], "a") as f:  # rewards 0.5 -> 50.0, a dataset rewritten: new content, same name
        f.write("\n# edited\n" if changed == "r.py" else json.dumps({"prompt": "POST: carol fixed the lamp . TL;DR:",
                                                                     "bonus": 9, "tests": ["assert f(1) == 1"]}) + "\n")
    resumed = [*argv, "--resume", "--max_steps", "2"]
    message = main_error(grpo, resumed, monkeypatch, capsys)
    assert (f"{files[changed]} (--{'reward_fn' if changed == 'r.py' else 'dataset'}) is not the file "
            f"{out}/checkpoint-1 was trained with (its content changed)") in message
    if changed == "r.py":  # --resume_allow_changes continues, and says so
        capsys.readouterr()
        run_main(grpo, [*resumed, "--resume_allow_changes"], monkeypatch)
        assert f"resume: {files['r.py']} (--reward_fn) changed since {out}/checkpoint-1 was saved" in capsys.readouterr().out
        assert [r["step"] for r in metrics(out)] == [1, 2]


@pytest.mark.parametrize("changed", ["model folder", "dataset folder", "helper module"])
def test_resume_refuses_a_folder_or_imported_module_that_changed(tmp_path, tiny_qwen, files, monkeypatch, capsys, changed):
    """The --model folder's weights replaced (a DPO reference too), a --dataset folder rewritten,
    and a module that the reward file imports edited: each refused as a changed file is."""
    from safetensors.torch import load_file, save_file

    from rlhf import basics

    monkeypatch.setattr(basics, "USER_IMPORTS", set())  # this test's imports only
    monkeypatch.setattr(sys, "path", list(sys.path))  # the reward file's sys.path.insert goes with the test
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen, model)
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(files["prompts.jsonl"], data / "train.jsonl")
    helper = tmp_path / "lib" / f"sign_{os.getpid()}_{abs(hash(str(tmp_path)))}.py"  # a name no other test imported
    helper.parent.mkdir()
    helper.write_text("SIGN = 1.0\n")
    (tmp_path / "signed.py").write_text(f"import sys\nsys.path.insert(0, {str(helper.parent)!r})\nimport {helper.stem}\n"
                                        f"def signed(completions, **kw):\n    return [{helper.stem}.SIGN * len(c) for c in completions]\n")
    out = str(tmp_path / "out")
    argv = tiny_grpo(str(model), {"prompts.jsonl": str(data)}, "--reward_fn", f"{tmp_path / 'signed.py'}:signed",
                     "--save_steps", "1", "--output_dir", out)
    run_main(grpo, argv, monkeypatch)
    if changed == "model folder":
        weights = load_file(model / "model.safetensors")
        save_file({k: v * 1.01 for k, v in weights.items()}, model / "model.safetensors", metadata={"format": "pt"})
        expected = f"{model} (--model) is not the folder {out}/checkpoint-1 was trained with (its content changed)"
    elif changed == "dataset folder":
        rows = (data / "train.jsonl").read_text().splitlines()
        (data / "train.jsonl").write_text("\n".join(reversed(rows)) + "\n")
        expected = f"{data} (--dataset) is not the folder {out}/checkpoint-1 was trained with (its content changed)"
    else:
        helper.write_text("SIGN = -1.0\n")
        expected = (f"{os.path.realpath(helper)} (a module a --reward_fn or --tools file imported) is not the file "
                    f"{out}/checkpoint-1 was trained with (its content changed)")
    message = main_error(grpo, [*argv, "--resume", "--max_steps", "2"], monkeypatch, capsys)
    assert expected in message and "Restore it, or add --resume_allow_changes" in message


def test_resume_with_the_output_inside_the_model_folder(tmp_path, tiny_qwen, files, monkeypatch):
    """--output_dir inside the --model folder: the run's own logs, which grow, are not part of the
    model folder's fingerprint, so the resume is not refused."""
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen, model)
    out = str(model / "grpo")
    argv = tiny_grpo(str(model), files, "--reward_fn", f"{files['r.py']}:length", "--save_steps", "1", "--output_dir", out)
    run_main(grpo, argv, monkeypatch)
    run_main(grpo, [*argv, "--resume", "--max_steps", "2"], monkeypatch)
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_resume_refuses_a_reward_file_edited_before_the_first_checkpoint(tmp_path, tiny_qwen, files, monkeypatch, capsys):
    """The checkpoints record the inputs as the run loaded them, not as they were at the save: a
    reward file edited during step 1 (here, by itself on its first call) makes a resume refuse."""
    out = str(tmp_path / "out")
    reward = tmp_path / "self_editing.py"
    reward.write_text("import os\n"
                      "def length(completions, **kw):\n"
                      "    with open(__file__, 'a') as f:\n"
                      "        f.write('# edited during the run\\n')\n"
                      "    return [float(len(c)) for c in completions]\n")
    argv = tiny_grpo(tiny_qwen, files, "--reward_fn", f"{reward}:length", "--save_steps", "1", "--output_dir", out)
    run_main(grpo, argv, monkeypatch)
    message = main_error(grpo, [*argv, "--resume", "--max_steps", "2"], monkeypatch, capsys)
    assert f"{reward} (--reward_fn) is not the file {out}/checkpoint-1 was trained with (its content changed)" in message


def test_resume_refuses_a_changed_reward_module_named_by_its_dotted_path(tmp_path, tiny_qwen, files, monkeypatch, capsys):
    """--reward_fn mymodule:fn (a module on the path, not a file): an edit of that module between
    the runs is refused on resume as a file's is."""
    out = str(tmp_path / "out")
    module = tmp_path / "lengthy_rewards_for_resume.py"
    module.write_text("def length(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = tiny_grpo(tiny_qwen, files, "--reward_fn", "lengthy_rewards_for_resume:length", "--save_steps", "1",
                     "--output_dir", out)
    run_main(grpo, argv, monkeypatch)
    with open(module, "a") as f:
        f.write("\n# edited\n")
    message = main_error(grpo, [*argv, "--resume", "--max_steps", "2"], monkeypatch, capsys)
    assert f"{module} (a module a --reward_fn or --tools file imported) is not the file" in message
