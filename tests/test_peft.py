"""LoRA and QLoRA (--use_peft, --load_in_4bit): only the adapters (and a score head) train, the
reference is the base with the adapters off, the merged model equals the adapter model, 4-bit
bases train on the CPU through sft.py, dpo.py and grpo.py, resume restores adapters exactly, and
the memory plan matches what a LoRA / 4-bit run holds. In-process, on tiny models."""

import json
import math
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlhf import checkpoints
import common
import dpo
import grpo
from rlhf import lora
from rlhf import memory
import reward
from rlhf import sampling
import sft
from conftest import SavedBytes


def _args(model, **kw):
    kw = {"use_peft": True, "lora_dropout": 0.0, "attn_implementation": "sdpa", "optim": "adamw", "learning_rate": 1e-2, **kw}
    return sft.Args(model=model, **kw)


def _batch(vocab, seed=0, n=3, prompt_length=5, completion_length=4):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(2, vocab, (n, prompt_length), generator=g)
    completion_ids = torch.randint(2, vocab, (n, completion_length), generator=g)
    return prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids)


def _logprobs(model, batch):
    with torch.no_grad():
        return sampling.completion_logprobs(model, *batch)


def _train(model, args, steps=3):
    """A few optimizer steps of the SFT loss, so every adapter's B moves away from 0."""
    optimizer = common.make_optimizer(model, args)
    for step in range(steps):
        batch = _batch(model.config.vocab_size, step)
        logprobs = sampling.completion_logprobs(model, *batch)
        (-logprobs.mean()).backward()
        common.optimizer_step(optimizer, 1.0)
    return optimizer


def _frozen_and_trained(model):
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return frozen, trained


def test_only_adapters_train_and_the_base_stays_bit_identical(tiny_qwen):
    model = common.load_model(tiny_qwen, _args(tiny_qwen), adapters=True)
    frozen, trained = _frozen_and_trained(model)
    assert trained and all("lora_" in n for n in trained)
    _train(model, _args(tiny_qwen))
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
        elif "lora_B" in n:  # B starts at 0 and must have moved
            assert not torch.equal(p, trained[n]), n


def test_reward_model_trains_adapters_and_a_copy_of_the_score_head(tiny_qwen):
    from transformers import AutoModelForSequenceClassification

    args = reward.Args(model=tiny_qwen, use_peft=True, lora_dropout=0.0, attn_implementation="sdpa", optim="adamw",
                       learning_rate=1e-2)
    model = common.load_model(tiny_qwen, args, cls=AutoModelForSequenceClassification, num_labels=1, adapters=True)
    frozen, trained = _frozen_and_trained(model)
    assert any("score" in n for n in trained) and all("lora_" in n or "score" in n for n in trained)
    ids = torch.randint(2, model.config.vocab_size, (4, 7))
    with lora.adapters_off(model):
        base_scores = sampling.sequence_scores(model, ids, torch.ones_like(ids)).detach()
    optimizer = common.make_optimizer(model, args)
    for _ in range(3):
        scores = sampling.sequence_scores(model, ids, torch.ones_like(ids))
        reward.bradley_terry_loss(scores[:2], scores[2:])[0].backward()
        common.optimizer_step(optimizer, 1.0)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n  # the original score head included
        elif "score" in n:
            assert not torch.equal(p, trained[n]), n
    # with the adapters off it is the untouched model again (PPO's reward model next to its critic)
    with lora.adapters_off(model):
        assert torch.equal(sampling.sequence_scores(model, ids, torch.ones_like(ids)), base_scores)


def test_reference_is_the_base_with_adapters_off(tiny_qwen):
    """Step 0: the adapter-disabled reference gives exactly the policy's log-probs (GRPO KL 0,
    DPO loss ln 2). After training: it still gives the base's, not the policy's."""
    args = _args(tiny_qwen)
    model = common.load_model(tiny_qwen, args, adapters=True)
    base = common.freeze(common.load_model(tiny_qwen, args))  # a plain copy, to compare with
    ref_model = common.reference_of(model, args)
    assert ref_model is model  # no second copy
    batch = _batch(model.config.vocab_size)
    with lora.adapters_off(ref_model):
        ref_logprobs = _logprobs(ref_model, batch)
    logprobs = _logprobs(model, batch)
    assert torch.equal(ref_logprobs, logprobs)
    g = grpo.Args(beta=0.04)
    _, metrics = grpo.grpo_loss(logprobs, logprobs, ref_logprobs, torch.randn(3), batch[3], g)
    assert metrics["kl"] == 0
    losses, _, _ = dpo.dpo_loss(logprobs[:2].sum(1), logprobs[1:].sum(1), ref_logprobs[:2].sum(1),
                                ref_logprobs[1:].sum(1), 0.1)
    assert torch.allclose(losses, torch.full_like(losses, math.log(2)), atol=0, rtol=0)

    _train(model, args)
    with lora.adapters_off(ref_model):
        ref_logprobs = _logprobs(ref_model, batch)
    assert torch.equal(ref_logprobs, _logprobs(base, batch))
    assert not torch.allclose(_logprobs(model, batch), ref_logprobs, atol=1e-3)
    assert model.training  # adapters_off restores the mode it found


def test_merged_model_equals_the_adapter_model(tiny_qwen, tmp_path):
    """The final save: <output_dir>/ loads with AutoModelForCausalLM and gives the adapter model's
    log-probs; <output_dir>/adapter/ loads through common.load_model (what eval.py calls)."""
    from transformers import AutoModelForCausalLM

    args = _args(tiny_qwen, output_dir=str(tmp_path))
    model = common.load_model(tiny_qwen, args, adapters=True)
    _train(model, args)
    tokenizer = common.load_tokenizer(tiny_qwen)
    checkpoints.save_final(model, tokenizer, args)
    assert os.path.isfile(tmp_path / "adapter" / "adapter_config.json")
    assert os.path.isfile(tmp_path / "adapter" / "args.json")
    assert not os.path.exists(tmp_path / "adapter_config.json")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not any("lora" in n for n in merged.state_dict())
    from_adapter = common.freeze(common.load_model(str(tmp_path / "adapter"), _args(tiny_qwen, use_peft=False)))
    batch = _batch(model.config.vocab_size, seed=7)
    model.eval()
    want = _logprobs(model, batch)
    assert (_logprobs(merged, batch) - want).abs().max() < 1e-5
    assert (_logprobs(from_adapter, batch) - want).abs().max() < 1e-5
    assert (want - _logprobs(common.load_model(tiny_qwen, args), batch)).abs().max() > 1e-3  # training did something


def _run(module, monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    module.main()


@pytest.fixture
def pref_data(tmp_path):
    path = tmp_path / "prefs.jsonl"
    with open(path, "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:", "chosen": " bob sold car .",
                                "rejected": " alice lost phone . now"}) + "\n")
    return str(path)


def test_4bit_trains_on_the_cpu_through_sft_dpo_and_grpo(tiny_qwen, sft_data, pref_data, tmp_path, monkeypatch):
    """QLoRA: a 4-bit NF4 base (bitsandbytes' CPU kernels) under LoRA adapters, a few steps of
    each script; the adapters move, the base stays 4-bit, and the merged output loads."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TQDM_DISABLE", "1")
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def length(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:"}) + "\n" for i in range(4)))
    common_flags = ["--model", tiny_qwen, "--use_peft", "--load_in_4bit", "--max_steps", "2", "--learning_rate", "1e-2",
                    "--batch_size", "2", "--optim", "adamw"]
    runs = {"sft": (sft, ["--dataset", sft_data]),
            "dpo": (dpo, ["--dataset", pref_data, "--no_precompute_ref_logps", "--max_steps", "3"]),
            "grpo": (grpo, ["--dataset", str(prompts), "--reward_fn", f"{rewards}:length", "--num_generations", "2",
                            "--max_completion_length", "4"])}
    for name, (module, flags) in runs.items():
        out = tmp_path / name
        _run(module, monkeypatch, *common_flags, *flags, "--output_dir", str(out))
        adapter = load_file(out / "adapter" / "adapter_model.safetensors")
        assert adapter and all("lora_" in k for k in adapter), name
        assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k), name  # B moved from 0
        merged = AutoModelForCausalLM.from_pretrained(out)
        assert {p.dtype for p in merged.parameters()} == {torch.float32}, name  # merged into the unquantised base
        assert json.load(open(out / "memory.json"))["components"]["policy weights"] > 0
    # dpo's live reference (--no_precompute_ref_logps) is the base with the adapters off: once they
    # moved (step 2; step 1's learning rate is 0, the warm-up's start), the implicit rewards beta * log pi/pi_ref leave 0; with the adapters on, the
    # reference would be the policy and every margin 0
    rows = [json.loads(line) for line in open(tmp_path / "dpo" / "metrics.jsonl")]
    assert rows[0]["rewards/margins"] == 0 and abs(rows[-1]["rewards/margins"]) > 1e-6, rows


def test_resume_with_adapters_ends_where_the_uninterrupted_run_ends(tiny_qwen, sft_data, tmp_path, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    flags = ["--model", tiny_qwen, "--dataset", sft_data, "--use_peft", "--batch_size", "2", "--learning_rate", "1e-2",
             "--save_steps", "2", "--no_merge_adapters", "--optim", "adamw_8bit"]
    _run(sft, monkeypatch, *flags, "--max_steps", "4", "--output_dir", str(tmp_path / "full"))
    _run(sft, monkeypatch, *flags, "--max_steps", "2", "--output_dir", str(tmp_path / "cut"))
    assert not os.path.exists(tmp_path / "cut" / "model.safetensors")  # --no_merge_adapters: adapters only
    _run(sft, monkeypatch, *flags, "--max_steps", "4", "--output_dir", str(tmp_path / "cut"), "--resume")
    full = load_file(tmp_path / "full" / "adapter" / "adapter_model.safetensors")
    resumed = load_file(tmp_path / "cut" / "adapter" / "adapter_model.safetensors")
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k


@pytest.mark.parametrize("quant", ["", "4bit", "8bit"])
def test_static_plan_matches_measured_with_adapters(tiny_qwen, tmp_path, quant):
    """Planned vs measured bytes of the (maybe quantised) base, the adapters, their gradients and
    8-bit AdamW states, within 5%."""
    args = sft.Args(model=tiny_qwen, use_peft=True, lora_r=8, load_in_4bit=quant == "4bit", load_in_8bit=quant == "8bit",
                    attn_implementation="sdpa", output_dir=str(tmp_path), learning_rate=1e-3, optim="adamw_8bit")
    plan = {name: n for name, n, _ in memory.estimate_memory(args, train_sequences=2, prompt_length=6, completion_length=6)}
    model = common.load_model(tiny_qwen, args, adapters=True)
    optimizer = common.make_optimizer(model, args)
    ids = torch.randint(2, model.config.vocab_size, (2, 12))
    batch = (ids[:, :6], torch.ones_like(ids[:, :6]), ids[:, 6:], torch.ones_like(ids[:, 6:]))
    for _ in range(2):  # optimizer states exist after the first step
        (-sampling.completion_logprobs(model, *batch).mean()).backward()
        memory.log_memory(args.output_dir, model, optimizer)
        common.optimizer_step(optimizer, 1.0)
    measured = json.load(open(tmp_path / "memory.json"))["components"]
    for name in ("policy weights", "adapter weights", "gradients", "optimizer states"):
        got, want = measured[name], plan[name]
        assert abs(got - want) <= 0.05 * want, f"{name}: measured {got} bytes, planned {want}"


def test_activation_plan_with_adapters_bounds_the_saved_tensors():
    """LoRA's activations (peft's fp32 input copies, A's outputs) on top of the base's: the plan
    is an upper bound within 30% of the bytes autograd saves (no dropout: on the CPU, dropout keeps
    4-byte noise where a GPU keeps a 1-byte mask)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from peft import LoraConfig, get_peft_model

    config = Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=320, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = get_peft_model(Qwen2ForCausalLM(config).to(dtype),
                               LoraConfig(r=16, target_modules="all-linear", lora_dropout=0.0)).train()
        ids = torch.randint(0, 300, (3, 40))
        with SavedBytes(exclude=model.parameters()) as s:
            sampling.backbone(model)(input_ids=ids, use_cache=False)
        saved = s.bytes
        args = sft.Args(use_peft=True, lora_r=16, lora_dropout=0.0)
        per_layer = memory.peft_plan(args, config, "lm", dtype.itemsize)[3]
        plan = memory.activation_plan(config, ids.numel(), dtype.itemsize, False, per_layer)
        assert saved <= plan <= 1.3 * saved, (dtype, saved, plan)


@pytest.mark.parametrize("argv, message", [(["--load_in_4bit"], "add --use_peft"),
                                           (["--use_peft", "--load_in_4bit", "--load_in_8bit"], "not both"),
                                           (["--use_peft", "--parallel", "fsdp2", "--optim", "adamw"], "ddp only")])
def test_quantisation_flags_fail_with_one_sentence(monkeypatch, argv, message):
    monkeypatch.setattr(sys, "argv", ["sft.py", *argv])
    with pytest.raises(SystemExit, match=message):
        common.parse_args(sft.Args)


def test_8bit_base_computes_the_same_function_in_train_and_eval_mode(tiny_qwen):
    """The policy runs in training mode, the reference (adapters off) and the sampler in eval mode:
    with zero-initialised adapters their log-probs must be equal, so KL at step 1 is exactly 0.
    (bitsandbytes' 8-bit layers on the CPU dequantise the weights in training mode but also
    round the activations to int8 in eval mode: up to 5.5e-4 nats apart. 4-bit layers agree.)"""
    model = common.load_model(tiny_qwen, _args(tiny_qwen, load_in_8bit=True), adapters=True).train()
    batch = _batch(model.config.vocab_size, n=4, prompt_length=9, completion_length=7)
    logprobs = _logprobs(model, batch)  # training mode
    with lora.adapters_off(model):
        assert not model.training
        ref_logprobs = _logprobs(model, batch)  # eval mode
    model.eval()
    eval_logprobs = _logprobs(model, batch)
    assert torch.equal(logprobs, ref_logprobs) and torch.equal(logprobs, eval_logprobs)


def test_adding_adapters_prints_no_future_warning(tiny_qwen):
    """peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model: a
    FutureWarning printed on every LoRA run, which lora.add_adapters silences there alone."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        common.load_model(tiny_qwen, _args(tiny_qwen), adapters=True)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]


def test_grpo_main_takes_the_reference_with_the_adapters_off(tiny_qwen, tmp_path, monkeypatch):
    """grpo.main with --use_peft: the reference pass runs inside lora.adapters_off, so once the
    adapters have moved (step 1) the logged KL is > 0; with the adapters on, the reference would be
    the policy and the KL silently 0 for the whole run. And every log-prob it takes (reference and
    update) is at the sampling temperature, as the ratio and the KL need."""
    monkeypatch.setenv("TQDM_DISABLE", "1")
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def length(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:"}) + "\n" for i in range(4)))
    temperatures, logprobs, turned_off = [], sampling.completion_logprobs, []
    adapters_off = lora.adapters_off

    def spy(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0, **kw):
        temperatures.append(temperature)
        return logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, **kw)

    def counted(model):
        turned_off.append(lora.is_peft(model))
        return adapters_off(model)

    monkeypatch.setattr(sampling, "completion_logprobs", spy)
    monkeypatch.setattr(lora, "adapters_off", counted)
    out = tmp_path / "grpo"
    _run(grpo, monkeypatch, "--model", tiny_qwen, "--dataset", str(prompts), "--reward_fn", f"{rewards}:length",
         "--use_peft", "--learning_rate", "1e-2", "--max_steps", "3", "--batch_size", "2", "--num_generations", "4",
         "--max_completion_length", "6", "--temperature", "0.8", "--optim", "adamw", "--output_dir", str(out))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # the adapters start at B = 0: the policy is the base
    assert rows[-1]["kl"] > 1e-5, [r["kl"] for r in rows]
    assert turned_off and all(turned_off)  # every reference pass switched a peft model's adapters off
    assert set(temperatures) == {0.8}


def test_dpo_held_out_metrics_read_the_reference_with_the_adapters_off(tiny_qwen, pref_data, tmp_path, monkeypatch):
    """dpo.py --use_peft --eval_dataset: the held-out loss and margins are the same whether the
    reference log-probs are precomputed or come from the live reference (the policy with its
    adapters off), and the trained policy is not its own reference (eval_loss is not ln 2)."""
    from conftest import run_main

    argv = ["--model", tiny_qwen, "--dataset", pref_data, "--eval_dataset", pref_data, "--use_peft", "--max_steps", "2",
            "--learning_rate", "5e-2", "--warmup_steps", "0", "--batch_size", "4", "--optim", "adamw"]
    evals = {}
    for flag in ("--precompute_ref_logps", "--no_precompute_ref_logps"):
        out = tmp_path / flag.strip("-")
        run_main(dpo, argv + [flag, "--output_dir", str(out)], monkeypatch)
        evals[flag] = json.load(open(out / "summary.json"))
    on, off = evals["--precompute_ref_logps"], evals["--no_precompute_ref_logps"]
    assert abs(on["eval_loss"] - math.log(2)) > 1e-4
    assert off["eval_loss"] == pytest.approx(on["eval_loss"], abs=1e-5)
    assert off["eval_rewards/margins"] == pytest.approx(on["eval_rewards/margins"], abs=1e-5)
