"""The algorithm files read as the paper: a module docstring that holds the objective and the
departures (not a manual), a main() a reader follows in one sitting, a training loop of the
paper's steps, and no feature named inside that loop (vLLM and tools enter through
rlhf/rollouts.py's contract, chosen before the loop). Prints each file's numbers.

    python -m pytest -q -s tests/test_readable.py
"""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = {"docstring": 45, "main": 160, "loop": 75}  # lines
FEATURES = re.compile(r"vllm|tool|sampling_logprobs", re.IGNORECASE)  # no line of the loop names these (the engine's log-probs are vLLM's)
HISTORY = re.compile(r"\b(19|20)\d\d-\d\d-\d\d\b|CHANGELOG|\(was \d|\bwas \d+\)|\bused to be\b")


def shape(path):
    """(docstring lines, main() lines, the training loop's lines, the loop's lines that name a feature)."""
    source = open(path).read()
    lines = source.splitlines()
    tree = ast.parse(source)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    # the training loop: main()'s longest top-level for/while statement
    loop = max((n for n in main.body if isinstance(n, (ast.For, ast.While))), key=lambda n: n.end_lineno - n.lineno)
    body = lines[loop.lineno - 1:loop.end_lineno]
    named = [f"{loop.lineno + i}: {line.strip()}" for i, line in enumerate(body) if FEATURES.search(line)]
    docstring = tree.body[0]  # its lines in the file, the quotes' own lines included
    return (docstring.end_lineno - docstring.lineno + 1, main.end_lineno - main.lineno + 1,
            loop.end_lineno - loop.lineno + 1, named)


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py", "dpo.py", "kto.py", "distill.py"])
def test_the_algorithm_reads_as_the_paper(script):
    doc, main, loop, named = shape(os.path.join(ROOT, script))
    print(f"{script}: docstring {doc} lines, main() {main}, training loop {loop}, loop lines naming vLLM/tools {len(named)}")
    assert doc <= LIMITS["docstring"], f"{script}'s docstring is {doc} lines: recipes and evidence go to docs/"
    assert main <= LIMITS["main"], f"{script}'s main() is {main} lines: move setup and end-of-run steps into named helpers"
    assert loop <= LIMITS["loop"], f"{script}'s training loop is {loop} lines: it should read as the paper's steps"
    assert not named, f"{script}'s loop names a feature (it belongs behind rlhf/rollouts.py or a helper): {named}"


def test_the_checker_counts_what_it_claims(tmp_path):
    """shape() on a file whose numbers are known: a 3-line docstring, a 7-line main() whose loop
    has 4 lines, one of which names vLLM."""
    path = tmp_path / "algo.py"
    path.write_text('"""one\ntwo\nthree"""\n\n\ndef main():\n    x = 0\n    for step in range(3):\n'
                    '        x += 1\n        y = 2  # the vLLM engine\n        x -= y\n    return x\n')
    doc, main, loop, named = shape(str(path))
    assert (doc, main, loop) == (3, 7, 4) and len(named) == 1 and "vLLM" in named[0]


@pytest.mark.parametrize("path", ["sft.py", "reward.py", "ppo.py", "dpo.py", "grpo.py", "kto.py", "distill.py", "eval.py", "common.py", "sweep.py"]
                         + [f"worlds/{f}" for f in sorted(os.listdir(os.path.join(ROOT, "worlds"))) if f.endswith(".py")]
                         + [f"rlhf/{f}" for f in sorted(os.listdir(os.path.join(ROOT, "rlhf"))) if f.endswith(".py")]
                         + [f"rlhf/evaluation/{f}" for f in sorted(os.listdir(os.path.join(ROOT, "rlhf", "evaluation"))) if f.endswith(".py")])
def test_no_history_in_code(path):
    """Code says why it is as it is, not how it got there: no dates, CHANGELOG pointers or "was N"."""
    hits = [f"{i + 1}: {line.strip()}" for i, line in enumerate(open(os.path.join(ROOT, path)).read().splitlines())
            if HISTORY.search(line)]
    assert not hits, f"{path}: history in code: {hits}"


def test_a_fork_runs_under_its_own_name(tmp_path, tiny_qwen, monkeypatch, capsys):
    """A copy of grpo.py (as a user saves it, my_grpo.py) runs as it is, prints under its own
    name and writes its metrics: nothing in it depends on its file name or place."""
    import importlib.util
    import json

    from conftest import run_main

    fork = tmp_path / "my_grpo.py"
    fork.write_text(open(os.path.join(ROOT, "grpo.py")).read())
    spec = importlib.util.spec_from_file_location("my_grpo", fork)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:"}) + "\n" for i in range(4)))
    (tmp_path / "r.py").write_text("def length(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    out = tmp_path / "out"
    run_main(module, ["--model", tiny_qwen, "--dataset", str(tmp_path / "p.jsonl"), "--reward_fn", f"{tmp_path}/r.py:length",
                      "--num_generations", "2", "--gradient_accumulation_steps", "1", "--max_steps", "1",
                      "--max_completion_length", "4", "--optim", "adamw", "--output_dir", str(out)], monkeypatch)
    printed = capsys.readouterr().out
    assert "my_grpo: " in printed and "\ngrpo: " not in printed
    assert len(open(out / "metrics.jsonl").read().splitlines()) == 1
