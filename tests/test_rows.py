"""Row by row, with several prompts per micro-batch: every completion a reward function or judge
receives arrives beside its own prompt, its own dataset columns and its own token ids. Each
prompt of the dataset carries a distinct `tag` column (the number written in the prompt); the
reward function, a file in the test's folder, asserts that every row's prompt holds its tag and
records what it got; the test then finds each recorded row among the rows sampling.generate
returned (row r continues prompt r // num_return_sequences) and checks that the prompt it was
sampled from is that row's prompt. For eval.py, each response must be what the policy answers
to that prompt alone, and each per-row judgment the reward of that response under that row's
columns."""

import inspect
import json
import os

import numpy as np
import pytest
from conftest import run_main, save_tiny

import dpo
import eval as eval_script
import grpo
import ppo
from rlhf import data
from rlhf import sampling
from worlds import world

REWARDS = '''import json, os
LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.jsonl")


def text_of(prompt):  # a conversation's last user turn, or the text
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def own_prompt(prompts, completions, completion_ids, tag, **kw):
    for p, t in zip(prompts, tag):
        assert f"car {t} ." in text_of(p), f"row with tag {t} got the prompt {p!r}"
    with open(LOG, "a") as f:
        f.write(json.dumps({"fn": "own_prompt", "prompts": prompts, "completions": completions,
                            "completion_ids": completion_ids, "tag": tag}) + "\\n")
    return [float(len(c)) + 0.1 * t for c, t in zip(completions, tag)]


def odd_only(prompts, completions, tag, **kw):
    """Applies to the odd tags only (None elsewhere, as TRL allows)."""
    return [float(len(c.split())) if t % 2 else None for c, t in zip(completions, tag)]
'''


def tagged_prompts(folder, n=8):
    """n prompts, each with a distinct `tag` (the number in its text), and the reward file."""
    path = os.path.join(folder, "prompts.jsonl")
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:", "tag": i}) + "\n")
    with open(os.path.join(folder, "r.py"), "w") as f:
        f.write(REWARDS)
    return path, os.path.join(folder, "r.py")


def generated_rows(monkeypatch):
    """Spy on sampling.generate: a list that fills with one (prompt ids, completion ids) pair per
    sampled row, real tokens only, in the order the rows were returned."""
    rows, fn = [], sampling.generate
    signature = inspect.signature(fn)

    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        n = a["num_return_sequences"]
        completion_ids, completion_mask = out[0], out[1]
        for r in range(completion_ids.shape[0]):
            prompt = a["prompt_ids"][r // n][a["prompt_mask"][r // n].bool()].tolist()
            rows.append((prompt, completion_ids[r][completion_mask[r].bool()].tolist()))
        return out

    monkeypatch.setattr(sampling, "generate", wrapper)
    return rows


def recorded_calls(folder):
    with open(os.path.join(folder, "calls.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_rows(folder, rows, tokenizer, expected_calls):
    """Every recorded reward call is a run of consecutive sampled rows, in their order: row j's
    completion ids are the sampled row's, and the prompt that row was sampled from holds row j's
    tag (so its prompt and columns are its own). Several prompts in each call."""
    calls = recorded_calls(folder)
    assert len(calls) == expected_calls
    start = 0
    for call in calls:
        n = len(call["completion_ids"])
        assert len(set(call["tag"])) > 1  # several prompts per call
        # the run of sampled rows this call scores: the first at or after `start` that matches it whole
        matches = [s for s in range(start, len(rows) - n + 1)
                   if all(rows[s + j][1] == call["completion_ids"][j] for j in range(n))]
        assert matches, "a reward call's completion ids are not the sampled rows, in order"
        start = matches[0]
        for j in range(n):
            prompt = " ".join(tokenizer.decode(rows[start + j][0]).split())
            assert f"car {call['tag'][j]} ." in prompt, f"row {j} (tag {call['tag'][j]}) was sampled from {prompt!r}"
        start += n


def test_grpo_scores_each_completion_with_its_own_prompt_and_columns(tmp_path, tiny_qwen, monkeypatch):
    """4 prompts x 2 completions per micro-batch, 2 micro-batches, 2 steps."""
    from transformers import AutoTokenizer

    prompts, rewards = tagged_prompts(tmp_path)
    rows = generated_rows(monkeypatch)
    run_main(grpo, ["--model", tiny_qwen, "--dataset", prompts, "--reward_fn", f"{rewards}:own_prompt",
                    "--batch_size", "4", "--num_generations", "2", "--gradient_accumulation_steps", "2",
                    "--max_steps", "2", "--max_completion_length", "5", "--optim", "adamw",
                    "--output_dir", str(tmp_path / "out")], monkeypatch)
    check_rows(tmp_path, rows, AutoTokenizer.from_pretrained(tiny_qwen), expected_calls=4)


def test_ppo_scores_each_completion_with_its_own_prompt_and_columns(tmp_path, tiny_qwen, monkeypatch):
    """A rollout of 8 prompts sampled in micro-batches of 4, scored in one call, 2 steps."""
    from transformers import AutoTokenizer

    prompts, rewards = tagged_prompts(tmp_path)
    rows = generated_rows(monkeypatch)
    run_main(ppo, ["--model", tiny_qwen, "--dataset", prompts, "--reward_fn", f"{rewards}:own_prompt",
                   "--batch_size", "4", "--gradient_accumulation_steps", "2", "--num_mini_batches", "1",
                   "--max_steps", "2", "--max_completion_length", "5", "--optim", "adamw",
                   "--output_dir", str(tmp_path / "out")], monkeypatch)
    check_rows(tmp_path, rows, AutoTokenizer.from_pretrained(tiny_qwen), expected_calls=2)


def test_online_dpo_judges_each_sample_with_its_own_prompt_and_columns(tmp_path, tiny_qwen, monkeypatch):
    """Online DPO: 4 prompts x 2 samples per micro-batch, 2 micro-batches, 2 steps."""
    from transformers import AutoTokenizer

    prompts, rewards = tagged_prompts(tmp_path)
    rows = generated_rows(monkeypatch)
    run_main(dpo, ["--model", tiny_qwen, "--dataset", prompts, "--online", "--reward_fn", f"{rewards}:own_prompt",
                   "--batch_size", "4", "--gradient_accumulation_steps", "2", "--max_steps", "2",
                   "--max_new_tokens", "5", "--optim", "adamw", "--output_dir", str(tmp_path / "out")], monkeypatch)
    check_rows(tmp_path, rows, AutoTokenizer.from_pretrained(tiny_qwen), expected_calls=4)


def test_eval_judges_each_response_under_its_own_row(tmp_path, tiny_qwen, monkeypatch):
    """eval.py on 6 tagged prompts, generated 4 at a time, judged by two reward functions (one
    returns None on the even tags): each response is what its policy answers to that prompt
    alone; each row of judgments.jsonl holds the summed reward of the two responses under that
    row's tag; each function's win rate is its own per-row outcomes' mean (a None a tie)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts, rewards = tagged_prompts(tmp_path, n=6)
    other = save_tiny(tmp_path / "other", "Qwen2", world.build_tokenizer(), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    out = tmp_path / "eval"
    run_main(eval_script, [tiny_qwen, other, "--dataset", prompts, "--reward_fn",
                           f"{rewards}:own_prompt,{rewards}:odd_only", "--eval_batch_size", "4",
                           "--max_completion_length", "6", "--num_bootstrap", "20", "--output_dir", str(out)], monkeypatch)
    generations = [json.loads(line) for line in open(out / "generations.jsonl")]
    judgments = [json.loads(line) for line in open(out / "judgments.jsonl")]
    results = json.load(open(out / "results.json"))
    runs = list(generations[0]["responses"])
    assert len(runs) == 2 and [g["prompt_id"] for g in generations] == list(range(6))
    # each response: the policy's greedy answer to that prompt alone
    for run, path in zip(runs, [tiny_qwen, other]):
        tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
        for g in generations:
            assert f"car {g['prompt_id']} ." in g["prompt"]
            with torch.no_grad():
                (alone,), _, _ = sampling.sample_texts(model, tok, [data.render_prompt(tok, g["prompt"])], 6, do_sample=False)
            assert g["responses"][run] == alone, (run, g["prompt_id"])
    # the functions were called with several rows at once, each beside its own prompt (asserted there)
    assert all(len(c["tag"]) == 6 and c["tag"] == list(range(6)) for c in recorded_calls(tmp_path))

    def own(c, t):
        return len(c) + 0.1 * t

    def odd(c, t):
        return float(len(c.split())) if t % 2 else None

    assert len(judgments) == 6
    outcomes = {"own_prompt": [], "odd_only": []}
    for j in judgments:
        i, (a, b) = j["prompt_id"], (j["policy_a"], j["policy_b"])
        ra, rb = generations[i]["responses"][a], generations[i]["responses"][b]
        total_a = own(ra, i) + (odd(ra, i) or 0.0)
        total_b = own(rb, i) + (odd(rb, i) or 0.0)
        assert j["score_a"] == pytest.approx(total_a, abs=1e-4) and j["score_b"] == pytest.approx(total_b, abs=1e-4)
        for name, f in (("own_prompt", own), ("odd_only", odd)):
            x, y = f(ra, i), f(rb, i)
            outcomes[name].append(0.5 if x is None or y is None or x == y else float(x > y))
    assert outcomes["odd_only"].count(0.5) >= 3  # the even tags: no score, a tie
    (pair,) = results["pairwise"]
    for name, o in outcomes.items():
        assert pair["rewards"][name]["win_rate"] == pytest.approx(np.mean(o), abs=1e-9), name
