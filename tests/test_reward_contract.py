"""One contract for what rewards receive, the same in every script that scores completions:
a reward function gets TRL's exact form (the decoded text, unchanged; one assistant message
holding it after a conversational prompt), a reward model reward.py's rendering of it. One
reward function and one reward model give identical scores through grpo.py, ppo.py,
dpo.py --online and eval.py."""

import functools
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from conftest import chat_tokenizer, trl_python, uniform_words_model

import common
from rlhf import data
from rlhf import reward_contract
import dpo
import eval as ev
import grpo
import ppo
import reward
from rlhf import sampling
from worlds import world
from worlds import world_arith

REWARD_FN = '''
SEEN = []


def shape(prompts, completions, **columns):
    """A TRL-style format reward: reads c[0]["content"] after a conversation, c itself after text."""
    texts = [c[0]["content"] if isinstance(p, list) else c for p, c in zip(prompts, completions)]
    SEEN.extend(texts)
    return [float(t.startswith("alice")) + 0.01 * len(t) for t in texts]
'''


def test_every_script_scores_a_completion_alike(tmp_path):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = chat_tokenizer()
    rm_path = str(tmp_path / "rm")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(rm_path)
    tok.save_pretrained(rm_path)
    fn_path = tmp_path / "rewards.py"
    fn_path.write_text(REWARD_FN)
    spec = f"{fn_path}:shape"

    # a text prompt and a conversational one; the completions as the policy's generate + decode give them
    prompts = ["POST: alice bought the bike .\nTL;DR:", [{"role": "user", "content": "POST: bob lost the phone ."}]]
    c_ids, c_mask = data.encode_completions(tok, [" alice bought bike .", "bob lost phone ."])
    texts = sampling.decode_completions(tok, c_ids, c_mask, torch.tensor([False, False]))
    assert texts == [" alice bought bike .", "bob lost phone ."]  # the text itself: no EOS, nothing added or stripped
    columns = {"post": ["alice bought the bike .", "bob lost the phone ."]}
    args = SimpleNamespace(eval_batch_size=8, max_prompt_length=512, reward_model=rm_path, reward_fn=spec, reward_weights="", max_steps=1,
                           dtype="float32", attn_implementation="sdpa", trust_remote_code=False)

    # grpo.py: both sources at once, (N, K); the reward model centred by its reward_mean (0 here)
    rewards, _ = grpo.load_rewards(args)
    by_grpo = grpo.score(rewards, prompts, texts, None, columns, args)
    fn_scores, rm_scores = by_grpo[:, 0], by_grpo[:, 1]
    seen = rewards[0]["fn"].__globals__["SEEN"]
    assert seen == texts  # the function read the decoded text itself, after text and conversation alike
    # ppo.py
    rm, rm_tok = common.load_reward_model(rm_path, args)
    torch.testing.assert_close(ppo.score(common.load_reward_fns(spec), None, None, prompts, texts, None, columns, args), fn_scores)
    torch.testing.assert_close(ppo.score(None, rm, rm_tok, prompts, texts, None, columns, args), rm_scores)
    # dpo.py --online: its judges receive sample_pairs' reward_completions
    completions = sampling.reward_completions(prompts, texts)
    judge, _ = dpo.make_judge(SimpleNamespace(**{**vars(args), "reward_model": ""}), False)
    torch.testing.assert_close(judge(prompts, completions, None, columns), fn_scores)
    judge, _ = dpo.make_judge(SimpleNamespace(**{**vars(args), "reward_fn": ""}), False)
    torch.testing.assert_close(judge(prompts, completions, None, columns), rm_scores)
    # eval.py --judge gold --reward_fn ... and --judge rm:PATH
    by_eval = ev.judge_scores("gold", None, {"p": texts}, prompts, columns, args)[0]["p"]  # (scores, per function)
    torch.testing.assert_close(torch.tensor(by_eval, dtype=torch.float32), fn_scores)
    by_eval = ev.judge_scores("rm", rm_path, {"p": texts}, prompts, columns, args)[0]["p"]
    torch.testing.assert_close(torch.tensor(by_eval, dtype=torch.float32), rm_scores)
    # ... and the reward model read what reward.py trains on: its rendering of (prompt, answer)
    for i, p in enumerate(prompts):
        answer = texts[i] if isinstance(p, str) else [{"role": "assistant", "content": texts[i]}]
        trained, _ = reward.pair_scores(rm, rm_tok, reward.render(rm_tok, [(p, answer, answer)]),
                                        SimpleNamespace(max_prompt_length=512, max_completion_length=256))
        assert abs(float(trained[0]) - float(rm_scores[i])) < 1e-5


# ============================================================================ TRL's reward functions, unchanged
# TRL's documented reward functions as TRL's docs write them (not imported): the quick-start
# length reward, think_format_reward, an accuracy reward with a `solution` column (None where the
# solution cannot be parsed, as TRL's accuracy_reward), one written (completions, prompts, **kw),
# one returning None for some samples (it reads completion_ids), one async (it logs a metric).
# `recorded` appends every call's keywords and rewards to $REWARD_CALLS for the test.
TRL_REWARDS = '''
import asyncio
import functools
import inspect
import json
import os
import re


def recorded(fn):
    def record(kwargs, rewards):
        path = os.environ.get("REWARD_CALLS")
        if path:
            state = kwargs.get("trainer_state")
            row = {"fn": fn.__name__, "rewards": list(rewards), "global_step": getattr(state, "global_step", None),
                   "max_steps": getattr(state, "max_steps", None), "log_callables": [callable(kwargs.get(k)) for k in ("log_extra", "log_metric")],
                   "not_lists": sorted(k for k, v in kwargs.items() if k not in ("trainer_state", "log_extra", "log_metric") and type(v) is not list),
                   **{k: v for k, v in kwargs.items() if k not in ("trainer_state", "log_extra", "log_metric")}}
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\\n")

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            rewards = await fn(*args, **kwargs)
            record(kwargs, rewards)
            return rewards
    else:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            rewards = fn(*args, **kwargs)
            record(kwargs, rewards)
            return rewards
    return wrapper


@recorded
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


@recorded
def think_format_reward(completions, **kwargs):
    pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content, re.DOTALL | re.MULTILINE) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


@recorded
def accuracy_reward(completions, solution, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    rewards = []
    for content, sol in zip(contents, solution):
        if sol == "n/a":  # the gold solution cannot be parsed: skip this example
            rewards.append(None)
        else:
            rewards.append(float(sol in content.split()))
    return rewards


@recorded
def longer_than_prompt(completions, prompts, **kw):
    return [len(c[0]["content"]) / 10 - len(p[-1]["content"]) / 100 for c, p in zip(completions, prompts)]


@recorded
def even_length_only(completions, completion_ids, **kwargs):
    return [None if len(ids) % 2 else float(len(ids)) for ids in completion_ids]


@recorded
async def async_judge(prompts, completions, log_metric=None, **kwargs):
    await asyncio.sleep(0)
    rewards = [float(c[0]["content"].count(" ")) for c in completions]
    if log_metric is not None:
        log_metric("judge/spaces", sum(rewards) / len(rewards))
    return rewards
'''
FN_NAMES = ["reward_len", "think_format_reward", "accuracy_reward", "longer_than_prompt", "even_length_only", "async_judge"]
WEIGHTS = [0.5, 1.0, 2.0, -1.0, 0.25, 0.1]
WORDS = ["alice", "bob", "bike", "phone", "car", "lost", "bought", "the"]


@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory):
    """grpo.py, ppo.py, dpo.py --online and eval.py (greedy and pass@k, a reference column) run in
    this process with TRL's six reward functions on a conversational dataset with a `solution`
    column; returns the output folders, each run's recorded reward-function calls, the tokenizer."""
    import json

    root = tmp_path_factory.mktemp("trl_rewards")
    tok = uniform_words_model(root / "policy")
    rewards = root / "trl_rewards.py"
    rewards.write_text(TRL_REWARDS)
    rows = [{"prompt": [{"role": "user", "content": f"say {w} {i}"}],
             "solution": w if i % 3 else "n/a", "reference": f"{w} {w}"} for i, w in enumerate(WORDS * 2)]
    with open(root / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    spec = ",".join(f"{rewards}:{n}" for n in FN_NAMES)
    base = ["--model", str(root / "policy"), "--dataset", str(root / "prompts.jsonl"), "--reward_fn", spec,
            "--reward_weights", ",".join(map(str, WEIGHTS)), "--max_steps", "2", "--optim", "adamw",
            "--log_completions", "--logging_steps", "1", "--max_prompt_length", "64"]
    held_out = ["--eval_dataset", str(root / "prompts.jsonl")]  # greedy completions, scored with the same functions
    argvs = {
        "grpo": [*base, *held_out, "--batch_size", "2", "--num_generations", "4", "--gradient_accumulation_steps", "1",
                 "--max_completion_length", "8", "--temperature", "1.0"],
        "ppo": [*base, *held_out, "--batch_size", "4", "--gradient_accumulation_steps", "1", "--num_mini_batches", "1", "--num_ppo_epochs", "1",
                "--max_completion_length", "8", "--temperature", "1.0"],
        "dpo": [*base, "--online", "--batch_size", "4", "--max_new_tokens", "8", "--temperature", "1.0"],
        # the accuracy reward alone as the verifier (weight 1; None -> left out of the sum)
        "eval": [str(root / "policy"), "--dataset", str(root / "prompts.jsonl"), "--dataset_split", "train",
                 "--reward_fn", spec, "--reward_weights", "0,0,1,0,0,0", "--num_samples", "2", "--temperature", "1.0",
                 "--max_completion_length", "8", "--num_bootstrap", "20", "--eval_batch_size", "8"],
    }
    out, calls = {}, {}
    for name, module in (("grpo", grpo), ("ppo", ppo), ("dpo", dpo), ("eval", ev)):
        out[name], log = root / name, root / f"{name}_calls.jsonl"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("REWARD_CALLS", str(log))
            mp.setenv("TQDM_DISABLE", "1")
            mp.setattr(sys, "argv", [f"{name}.py", *argvs[name], "--output_dir", str(out[name])])
            module.main()
        with open(log) as f:
            calls[name] = [json.loads(line) for line in f]
    return out, calls, tok


def batches(calls):
    """The recorded calls as batches: one call of every function on the same completions."""
    out = []
    for i in range(0, len(calls), len(FN_NAMES)):
        group = {c["fn"]: c for c in calls[i:i + len(FN_NAMES)]}
        assert sorted(group) == sorted(FN_NAMES), [c["fn"] for c in calls[i:i + len(FN_NAMES)]]
        first = group[FN_NAMES[0]]
        for c in group.values():  # every function of a batch saw the same rows
            assert (c["prompts"], c["completions"], c["completion_ids"], c["solution"]) == \
                (first["prompts"], first["completions"], first["completion_ids"], first["solution"])
        out.append(group)
    return out


def nan_weighted_sum(group):
    """Our own transcription of TRL's sum: sum_k w_k r_k over the functions that did not return
    None; None when every function did."""
    per = [[group[n]["rewards"][i] for n in FN_NAMES] for i in range(len(group[FN_NAMES[0]]["rewards"]))]
    return [None if all(r is None for r in row) else sum(w * r for w, r in zip(WEIGHTS, row) if r is not None)
            for row in per]


def test_trl_reward_functions_run_unchanged_in_every_script(trl_runs):
    import json

    out, calls, tok = trl_runs
    for script in ("grpo", "ppo", "dpo", "eval"):
        for group in batches(calls[script]):
            for name, c in group.items():
                assert c["not_lists"] == [], (script, name)  # prompts, completions, completion_ids, columns: lists
                assert c["log_callables"] == [True, True] and c["global_step"] is not None and c["max_steps"] is not None
                for p, comp, ids, sol in zip(c["prompts"], c["completions"], c["completion_ids"], c["solution"]):
                    assert isinstance(p, list) and comp[0]["role"] == "assistant"  # TRL's conversational form
                    word = p[-1]["content"].split()[1]  # the solution column is aligned with its prompt
                    assert sol in (word, "n/a")
                    if script == "eval" and ids == tok(comp[0]["content"], add_special_tokens=False)["input_ids"]:
                        continue  # the reference: its text in the policy's tokenizer
                    assert all(isinstance(t, int) for t in ids)  # the completion's token ids, EOS included
                    text_ids = ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids
                    assert tok.decode(text_ids, skip_special_tokens=True) == comp[0]["content"]
    # grpo.py: the logged per-function rewards and their sum are those the functions returned,
    # None (null) where a function did not apply; the async judge's log_metric is in metrics.jsonl
    *_, last, held_out = batches(calls["grpo"])  # the last step's rollout, then --eval_dataset
    assert len(held_out["reward_len"]["prompts"]) == 16
    logged = [json.loads(line) for line in open(out["grpo"] / "completions.jsonl")][-8:]
    assert [r["completion"] for r in logged] == [c[0]["content"] for c in last["reward_len"]["completions"]]
    for name in FN_NAMES:
        assert [r[name] for r in logged] == pytest.approx(last[name]["rewards"], abs=1e-5)
    assert [r["reward"] for r in logged] == pytest.approx(nan_weighted_sum(last), abs=1e-4)
    assert any(r is None for r in last["even_length_only"]["rewards"]) and any(r is None for r in last["accuracy_reward"]["rewards"])
    metrics = [json.loads(line) for line in open(out["grpo"] / "metrics.jsonl")]
    assert "judge/spaces" in metrics[0] and [c["global_step"] for c in calls["grpo"][::6]] == [0, 1, 2]
    # dpo.py --online: the judge's scores are the weighted sums (two samples per prompt)
    last = batches(calls["dpo"])[-1]
    logged = [json.loads(line) for line in open(out["dpo"] / "completions.jsonl")][-8:]
    assert [r["score"] for r in logged] == pytest.approx(nan_weighted_sum(last), abs=1e-4)
    # ppo.py: the score of each completion that ends with EOS (the others get -missing_eos_penalty)
    *_, last, held_out = batches(calls["ppo"])  # the last step's rollout, then --eval_dataset
    assert len(held_out["reward_len"]["prompts"]) == 16
    ended = [ids[-1] == tok.eos_token_id for ids in last["reward_len"]["completion_ids"]]
    logged = [json.loads(line) for line in open(out["ppo"] / "completions.jsonl")][-len(ended):]
    assert [r["completion"] for r in logged] == [c[0]["content"] for c in last["reward_len"]["completions"]] and any(ended)
    for r, s, e in zip(logged, nan_weighted_sum(last), ended):
        assert r["score"] == pytest.approx(s if e else -1.0, abs=1e-4)
    # eval.py: greedy (the policy and the reference) and pass@k (2 samples a prompt), the same functions
    greedy, reference, sampled = batches(calls["eval"])
    assert len(sampled["reward_len"]["completions"]) == 2 * len(greedy["reward_len"]["completions"]) == 32
    judged = [json.loads(line) for line in open(out["eval"] / "judgments.jsonl")]  # the policy (a) vs the reference (b)
    assert [j["score_a"] for j in judged] == [r or 0.0 for r in greedy["accuracy_reward"]["rewards"]]  # weights 0,0,1,0,0,0
    assert [j["score_b"] for j in judged] == [r or 0.0 for r in reference["accuracy_reward"]["rewards"]]
    assert [c[0]["content"] for c in reference["reward_len"]["completions"]] == [f"{w} {w}" for w in WORDS * 2]
    results = json.loads(open(out["eval"] / "results.json").read())
    correct = [r or 0.0 for r in sampled["accuracy_reward"]["rewards"]]
    assert results["policies"]["policy"]["pass_at_k"]["pass@1"]["value"] == pytest.approx(sum(correct) / 32)


# ============================================================================ against TRL's own _calculate_rewards
# Run in the bench virtualenv (TRL 1.16): GRPOTrainer._calculate_rewards on a stand-in trainer
# carrying just what the method reads (its reward functions and names, a TrainerState, the
# log_extra / log_metric methods, an event loop for async functions), then TRL's weighted sum
# (nansum; NaN where no function applied), as _generate_and_score_completions computes it.
TRL_SIDE = r'''
import importlib.util, json, sys, types
from collections import defaultdict
import torch
from accelerate import PartialState
from transformers import TrainerState
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import start_event_loop_in_daemon

job = json.load(open(sys.argv[1]))
PartialState(cpu=True)  # accelerate's gather: one process
_, loop, ready = start_event_loop_in_daemon()
ready.wait()
out = []
for b in job["batches"]:
    spec = importlib.util.spec_from_file_location("rewards", b["reward_file"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fns = [getattr(module, n) for n in b["fn_names"]]
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        args=types.SimpleNamespace(report_to=[]), reward_funcs=fns, reward_processing_classes=[None] * len(fns),
        reward_func_names=b["fn_names"], state=TrainerState(global_step=b["global_step"], max_steps=b["max_steps"]),
        environments=None, async_loop=loop, _pending_extra_logs=defaultdict(list), _pending_metrics=defaultdict(list))
    trainer._log_completion_extra = GRPOTrainer._log_completion_extra.__get__(trainer)
    trainer._log_metric = GRPOTrainer._log_metric.__get__(trainer)
    inputs = [{"prompt": p, **{k: v[i] for k, v in b["columns"].items()}} for i, p in enumerate(b["prompts"])]
    per_func = GRPOTrainer._calculate_rewards(trainer, inputs, b["prompts"], b["completions"], b["completion_ids"])
    weights = torch.tensor(b["weights"])
    reward = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    reward[torch.isnan(per_func).all(dim=1)] = torch.nan
    nan_to_none = lambda t: [None if x != x else x for x in t.tolist()]
    out.append({"per_func": [nan_to_none(row) for row in per_func], "reward": nan_to_none(reward),
                "metrics": dict(trainer._pending_metrics)})
json.dump(out, open(sys.argv[2], "w"))
'''

# text prompts: TRL's quick-start length reward, its docs' \boxed{} example with a `solution`-like
# `ground_truth` column, and a function written (completions, prompts, **kw) that must not get
# its arguments swapped
TEXT_REWARDS = r'''
import re


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def reward_func(completions, ground_truth, **kwargs):
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def longer_than_prompt(completions, prompts, **kw):
    return [float(len(c) > len(p)) for c, p in zip(completions, prompts)]
'''


def test_rewards_equal_trls_calculate_rewards(trl_runs, tmp_path):
    import json
    import subprocess

    python = trl_python()
    out, calls, tok = trl_runs
    text_file = tmp_path / "text_rewards.py"
    text_file.write_text(TEXT_REWARDS)
    text_fns = ["reward_len", "reward_func", "longer_than_prompt"]
    text_batch = {"reward_file": str(text_file), "fn_names": text_fns, "weights": [1.0, 2.0, 0.5],
                  "prompts": ["Q: 2+2? A:", "Q: the sum of 40 and 2? A:"], "completions": [" \\boxed{4} and a long tail", " \\boxed{41}"],
                  "completion_ids": [[5, 6, 7], [8, 9]], "columns": {"ground_truth": ["4", "42"]}, "global_step": 3, "max_steps": 10}
    # every batch the four scripts scored, on the inputs the functions received there
    recorded = []
    for script in ("grpo", "ppo", "dpo", "eval"):
        for group in batches(calls[script]):
            first = group[FN_NAMES[0]]
            recorded.append({"reward_file": str(out["grpo"].parent / "trl_rewards.py"), "fn_names": FN_NAMES, "weights": WEIGHTS,
                             "prompts": first["prompts"], "completions": first["completions"],
                             "completion_ids": first["completion_ids"],
                             "columns": {k: first[k] for k in ("solution", "reference")}, "global_step": first["global_step"],
                             "max_steps": first["max_steps"], "group": group, "script": script})
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"batches": [text_batch] + [{k: v for k, v in b.items() if k not in ("group", "script")}
                                                          for b in recorded]}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("REWARD_CALLS", None)
    proc = subprocess.run([python, "-c", TRL_SIDE, str(job), str(tmp_path / "trl.json")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trl = json.load(open(tmp_path / "trl.json"))

    # the text batch: ours in this process on identical inputs; TRL's order of arguments, no swap
    fns = [common.load_reward_fn(f"{text_file}:{n}") for n in text_fns]
    ours = common.call_reward_fns(fns, text_batch["prompts"], text_batch["completions"], text_batch["completion_ids"],
                                  text_batch["columns"], step=3, max_steps=10)
    assert ours.tolist() == trl[0]["per_func"]
    assert [row[1:] for row in trl[0]["per_func"]] == [[1.0, 1.0], [0.0, 0.0]]  # swapped arguments would give 0, 1
    assert common.weighted_rewards(ours, torch.tensor(text_batch["weights"])).tolist() == pytest.approx(trl[0]["reward"])

    # the recorded batches: the per-function matrix (None -> NaN) and the weighted sum TRL gives equal
    # (a) what the functions returned in the scripts, (b) our contract on the same inputs, (c) the sums
    # the scripts logged (checked against the records in the test above)
    for b, t in zip(recorded, trl[1:]):
        group = b["group"]
        assert [[group[n]["rewards"][i] for n in FN_NAMES] for i in range(len(b["prompts"]))] == \
            [[None if r is None else pytest.approx(r, abs=1e-5) for r in row] for row in t["per_func"]], b["script"]
        fns = [common.load_reward_fn(f"{b['reward_file']}:{n}") for n in FN_NAMES]
        ours = common.call_reward_fns(fns, b["prompts"], b["completions"], b["completion_ids"], b["columns"],
                                      step=b["global_step"], max_steps=b["max_steps"])
        torch.testing.assert_close(ours, torch.tensor([[float("nan") if r is None else r for r in row] for row in t["per_func"]]),
                                   equal_nan=True)
        reward = common.weighted_rewards(ours, torch.tensor(WEIGHTS))
        assert [None if r != r else r for r in reward.tolist()] == pytest.approx(t["reward"], abs=1e-5)
        assert nan_weighted_sum(group) == pytest.approx(t["reward"], abs=1e-4)
        assert t["metrics"]["judge/spaces"] == pytest.approx([sum(group["async_judge"]["rewards"]) / len(b["prompts"])])
    grpo_logged = [json.loads(line) for line in open(out["grpo"] / "completions.jsonl")][-8:]
    grpo_last = [t for b, t in zip(recorded, trl[1:]) if b["script"] == "grpo"][-2]  # the last rollout
    assert [r["reward"] for r in grpo_logged] == pytest.approx(grpo_last["reward"], abs=1e-4)


# ============================================================================ None, async, and where a bad reward is
def _stops(fn, *args, **kwargs):
    with pytest.raises(SystemExit) as e:
        fn(*args, **kwargs)
    return str(e.value)


def test_no_applicable_reward_grpo_leaves_it_out_others_stop(trl_runs, monkeypatch, capsys):
    from conftest import main_error

    # grpo.py (as TRL): reward NaN, left out of its group's mean and std, advantage 0
    def some(completions, **kwargs):
        return [None, 1.0, 3.0, None]

    scores = common.call_reward_fns([some], ["p"] * 4, list("abcd"), group_size=4, every_row=False)
    reward = common.weighted_rewards(scores, torch.tensor([2.0]))
    assert reward.isnan().tolist() == [True, False, False, True] and reward[1:3].tolist() == [2.0, 6.0]
    std = (2 * 2 ** 2 / 1) ** 0.5  # of 2 and 6 (unbiased)
    assert grpo.group_advantages(reward, 4, "group").tolist() == pytest.approx([0, -2 / (std + grpo.ADV_EPS), 2 / (std + grpo.ADV_EPS), 0])
    # elsewhere: one sentence naming the function(s), which completion of which prompt, and what to do
    msg = _stops(common.call_reward_fns, [some, some], ["p0", "p0", "p1", "p1"], list("abcd"), group_size=2)
    assert "every reward function (some, some) returned None for completion 0 of prompt 0" in msg and "'a'" in msg
    out, _, _ = trl_runs
    none_file = out["grpo"].parent / "none.py"
    none_file.write_text("def never(completions, **kwargs):\n    return [None] * len(completions)\n")
    msg = main_error(ppo, ["--model", str(out["grpo"].parent / "policy"), "--dataset", str(out["grpo"].parent / "prompts.jsonl"),
                           "--reward_fn", f"{none_file}:never", "--max_steps", "1", "--batch_size", "2",
                           "--gradient_accumulation_steps", "1", "--max_completion_length", "4", "--optim", "adamw",
                           "--output_dir", str(out["grpo"].parent / "ppo_none")], monkeypatch, capsys)
    assert "every reward function (never) returned None for prompt 0" in msg and "ppo.py needs a reward for every completion" in msg


def test_a_bad_reward_names_the_completion_and_its_prompt():
    # rows in groups of G completions of one prompt: row 1 is completion 1 of prompt 0 (not "prompt 1")
    msg = _stops(common.call_reward_fns, [lambda completions, **kw: [1.0, float("nan"), 0.0, 0.0]], ["p0", "p0", "p1", "p1"],
                 ["a", "b", "c", "d"], group_size=2)
    assert "returned nan for completion 1 of prompt 0: 'p0'" in msg

    def raises_on_c(completions, **kw):
        return [1 / (c != "c") for c in completions]

    msg = _stops(common.call_reward_fns, [raises_on_c], ["p0", "p0", "p1", "p1"], ["a", "b", "c", "d"], group_size=2)
    assert "raises_on_c raised ZeroDivisionError" in msg and "completion 0 of prompt 1: 'p1'" in msg and "completion: 'c'" in msg
    # a dataset column with the name of one of TRL's keywords cannot reach the function
    msg = _stops(common.call_reward_fns, [lambda completions, **kw: [1.0]], ["p"], ["a"], None, {"completions": ["x"]})
    assert "column 'completions'" in msg and "rename" in msg


def test_async_reward_functions_are_awaited_together():
    import asyncio

    go = {}

    async def waits(completions, **kwargs):  # finishes only once `sets` has run: they must run concurrently
        await asyncio.wait_for(go.setdefault("event", asyncio.Event()).wait(), 2)
        return [1.0] * len(completions)

    async def sets(completions, **kwargs):
        go.setdefault("event", asyncio.Event()).set()
        return [None] * len(completions)

    def plain(completions, **kwargs):
        return [3.0] * len(completions)

    scores = common.call_reward_fns([waits, plain, sets], ["p", "q"], ["a", "b"])
    assert scores[:, :2].tolist() == [[1.0, 3.0], [1.0, 3.0]] and scores[:, 2].isnan().all()


def test_none_is_nan_and_left_out_of_the_weighted_sum():
    """TRL: a None reward is NaN (the function does not apply to that sample); the weighted sum
    is a nansum over the functions that apply, NaN only where none does."""
    def half(completions, **kwargs):
        return [None if c == "b" else 1.0 for c in completions]

    def always(completions, **kwargs):
        return [None if c == "b" else 2.0 for c in completions[:-1]] + [4.0]

    scores = common.call_reward_fns([half, always], ["p"] * 3, ["a", "b", "c"], every_row=False)  # (3, 2)
    assert scores[0].tolist() == [1.0, 2.0] and scores[1].isnan().all() and scores[2].tolist() == [1.0, 4.0]
    reward = common.weighted_rewards(scores, torch.tensor([0.5, 3.0]))
    assert reward[0] == 0.5 + 6.0 and reward[1].isnan() and reward[2] == 0.5 + 12.0
    partial = common.weighted_rewards(torch.tensor([[float("nan"), 2.0]]), torch.tensor([0.5, 3.0]))
    assert partial.tolist() == [6.0]  # the function that returned None is left out, not counted as 0


def test_a_reward_function_returning_the_wrong_count_is_refused():
    with pytest.raises(SystemExit) as e:
        common.call_reward_fns([lambda completions, **kw: [1.0]], ["p", "q"], ["a", "b"])
    assert "returned 1 values for 2 completions" in str(e.value)


# ------------------------------------------------------------------ the sentences and edges a user meets
LONG_P, LONG_C = "P" * 299 + "Q" + "p" * 50, "C" * 299 + "D" + "c" * 50  # cut at 300 characters: Q and D kept, the rest not
RULE = ("rewards must be finite real numbers within float32's range (|r| <= 3.4e+38), or None where the function "
        "does not apply.")
LIST = ("it must return a list with one reward per completion (a float, or None where it does not apply), in the "
        "order of `completions`")


def test_every_refusal_of_a_reward_function_says_its_whole_sentence():
    """Each message of call_reward_fns whole: the function, the row, the prompt and completion cut at 300
    characters, what to do (a substring check would pass a message with the wrong row or a cut one)."""
    def nan_on_long(completions, **kw):
        return [float("nan") if c == LONG_C else 1.0 for c in completions]

    assert _stops(common.call_reward_fns, [nan_on_long], ["ok", LONG_P], ["x", LONG_C]) == (
        f"error: reward function nan_on_long returned nan for prompt 1: {LONG_P[:300]!r}; {RULE}")

    def divides(completions, **kw):
        return [1 / (c != LONG_C) for c in completions]

    assert _stops(common.call_reward_fns, [divides], ["ok", LONG_P], ["x", LONG_C]) == (
        f"error: reward function divides raised ZeroDivisionError: division by zero\n  on prompt 1: {LONG_P[:300]!r}\n"
        f"  completion: {LONG_C[:300]!r}")

    def batch_only(completions, **kw):  # each row alone works
        if len(completions) > 1:
            raise RuntimeError("batch")
        return [1.0]

    assert _stops(common.call_reward_fns, [batch_only], [LONG_P, "q"], ["a", "b"]) == (
        f"error: reward function batch_only raised RuntimeError: batch on a batch of 2 completions (each alone works); "
        f"first prompt: {LONG_P[:300]!r}")

    async def raises_on_bad(completions, **kw):  # async: awaited row by row to find the culprit
        if "bad" in completions:
            raise KeyError("k")
        return [1.0] * len(completions)

    assert _stops(common.call_reward_fns, [raises_on_bad], ["p0", "p1"], ["good", "bad"]) == (
        "error: reward function raises_on_bad raised KeyError: 'k'\n  on prompt 1: 'p1'\n  completion: 'bad'")

    async def agen(completions, **kw):
        yield 1.0

    assert _stops(common.call_reward_fns, [agen], ["p"], ["a"]) == (
        f"error: reward function agen returned a async_generator; {LIST} (an async function returns that list; it does not yield).")
    assert _stops(common.call_reward_fns, [lambda completions, **kw: {"a": 1.0}], ["p"], ["a"]) == (
        f"error: reward function <lambda> returned a dict; {LIST}.")
    assert _stops(common.call_reward_fns, [lambda completions, **kw: 1.0], ["p"], ["a"]) == (
        f"error: reward function <lambda> returned a float; {LIST}.")
    assert _stops(common.call_reward_fns, [lambda completions, **kw: None], ["p"], ["a"]) == (
        "error: reward function <lambda> returned 0 values for 1 completions.")
    msg = _stops(common.call_reward_fns, [lambda completions, **kw: [None]], [LONG_P], [LONG_C])
    assert msg.startswith(f"error: every reward function (<lambda>) returned None for prompt 0: {LONG_P[:300]!r}, "
                          f"completion {LONG_C[:300]!r}; ") and msg.endswith(
        ".py needs a reward for every completion (only grpo.py leaves such a completion out, as TRL does): return a "
        "number there or add a reward function that does.")
    assert _stops(common.call_reward_fns, [lambda completions, **kw: [1.0]], ["p"], ["a"], None, {"log_extra": ["x"]}) == (
        "error: the dataset's column 'log_extra' has the name of an argument TRL passes to reward functions (prompts, "
        "completions, completion_ids, trainer_state, log_extra, log_metric): rename that column.")
    # a callable without __name__ is named by what it prints
    msg = _stops(common.call_reward_fns, [functools.partial(nan_on_long)], [LONG_P], [LONG_C])
    assert msg.startswith("error: reward function functools.partial(<function ") and " returned nan for prompt 0" in msg


def test_what_a_reward_function_receives_and_may_log():
    """TRL's trainer_state (the step and max_steps, 0 and 0 outside a run), log_metric and log_extra
    collected into `logs` (nowhere, without error, when no one asks), no function -> (N, 0), and the largest
    float32 a valid reward."""
    seen = []

    def records(completions, trainer_state, log_extra, log_metric, **kw):
        seen.append((trainer_state.global_step, trainer_state.max_steps))
        log_extra("upper", [c.upper() for c in completions])
        log_metric("calls", 1.0)
        return [3.4028234663852886e38] * len(completions)

    logs = {"metrics": {}, "extra": {}}
    scores = common.call_reward_fns([records], ["p", "q"], ["a", "b"], step=3, max_steps=7, logs=logs)
    assert seen == [(3, 7)] and logs == {"metrics": {"calls": [1.0]}, "extra": {"upper": ["A", "B"]}}
    assert scores[:, 0].tolist() == [torch.finfo(torch.float32).max] * 2
    common.call_reward_fns([records], ["p"], ["a"])
    assert seen[-1] == (0, 0)
    assert common.call_reward_fns([], ["a", "b", "c"], ["x", "y", "z"]).shape == (3, 0)


def test_reward_data_checks_read_parameters_and_the_first_row_only():
    def optional(completions, hint="", **kw):
        return [1.0] * len(completions)

    def needs(completions, answer, **kw):
        return [1.0] * len(completions)

    one = Dataset.from_dict({"prompt": ["a"], "topic": ["b"]})
    common.check_reward_data([optional], one, "--dataset", "d.jsonl")  # a parameter with a default needs no column
    # a function with no signature to read (a builtin) is skipped, and the functions after it are still checked
    assert _stops(common.check_reward_data, [max, needs], one, "--dataset", "d.jsonl") == (
        "error: reward function needs reads the column 'answer', which --dataset d.jsonl does not have (its columns: "
        "prompt, topic); pass data with that column or another reward function (checked before step 1: nothing was "
        "trained).")
    one = one.remove_columns("topic")
    # an --eval_dataset must hold the training data's columns a function reads, defaults or not
    assert "reads the column 'hint', which --eval_dataset e.jsonl does not have (its columns: prompt)" in _stops(
        common.check_reward_data, [optional], one, "--eval_dataset", "e.jsonl", ["hint"])
    post = "POST: alice bought the bike . TL;DR:"  # the embedded world's prompt form
    common.check_reward_data([world.gold_reward], Dataset.from_dict({"prompt": [post, "no post here"]}), "--dataset", "d")
    msg = _stops(common.check_reward_data, [world.gold_reward], Dataset.from_dict({"prompt": ["no post here", post]}),
                 "--dataset", "d")
    assert msg.startswith("error: --dataset d cannot be scored (checked on its first row before step 1: nothing was "
                          "trained): reward function gold_reward raised ValueError")
    # a conversational first row is checked with an empty answer in TRL's form: one assistant message
    chat = {"prompt": [[{"role": "user", "content": post}]], "answer": ["4"]}
    common.check_reward_data([world.gold_reward, world_arith.VERIFIERS["arith_strict"]], Dataset.from_dict(chat), "--dataset", "d")


def test_reward_and_eval_reward_lists_say_their_whole_sentences():
    fns, weights = reward_contract.load_reward_fns("gold,arith_strict", "1,2")
    assert [f.__name__ for f in fns] == ["gold_reward", "arith_strict"] and weights.tolist() == [1.0, 2.0]
    assert _stops(reward_contract.load_reward_fns, "") == (
        "error: --reward_fn is empty: pass gold, arith_strict, arith_lenient or file.py:function (comma-separated).")
    assert _stops(reward_contract.load_reward_fns, "gold,gold") == (
        "error: --reward_fn 'gold,gold': two rewards are named 'gold_reward', and rewards/gold_reward/mean can log only "
        "one of them: rename one of the functions (or pass a function once and give it a weight with --reward_weights).")
    assert _stops(reward_contract.load_reward_fns, "gold,arith_strict", "1") == (
        "error: --reward_weights has 1 values for 2 rewards (gold_reward, arith_strict).")
    assert _stops(reward_contract.load_reward_fns, "gold", "a") == (
        "error: --reward_weights 'a': expected comma-separated numbers.")
    assert list(reward_contract.load_eval_reward_fns("gold,arith_strict")) == ["gold", "arith_strict"]
    assert reward_contract.load_eval_reward_fns("") == {}
    assert _stops(reward_contract.load_eval_reward_fns, "gold,gold") == (
        "error: --eval_reward_fn 'gold': a reward named 'gold' is already in --eval_reward_fn, and eval_rewards/gold/mean "
        "can log only one of them: drop it or rename the function.")
    assert _stops(reward_contract.load_eval_reward_fns, "arith_strict", ("arith_strict",)) == (
        "error: --eval_reward_fn 'arith_strict': a reward named 'arith_strict' is already among the training rewards, "
        "and eval_rewards/arith_strict/mean can log only one of them: drop it or rename the function.")
    assert not reward_contract.is_module_spec("pkg.rewards.py") and reward_contract.is_module_spec("pkg.rewards.fn")
