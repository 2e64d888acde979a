"""Flags that no other test showed to change anything (tests/test_flags_alive.py lists which test
covers each flag): each test here sets the flag to two values and asserts what differs."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import run_main

import common
import eval as eval_script
import sft
from rlhf import data, rollouts, sampling


def test_dataset_split_picks_the_split_of_a_folder(tmp_path):
    """--dataset_split: a folder's train.jsonl or test.jsonl (every script reads --dataset through here)."""
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps({"prompt": f"POST: {split} row . TL;DR:"}) + "\n")
    rows = {split: data.training_data(SimpleNamespace(dataset=str(tmp_path), dataset_split=split, seed=0), "rl")["prompt"]
            for split in ("train", "test")}
    assert rows == {"train": ["POST: train row . TL;DR:"], "test": ["POST: test row . TL;DR:"]}


def test_seed_sets_the_data_order_and_the_samples(tiny_qwen):
    """--seed: the batches' order and the rollout noise (rollouts.sampling_kwargs) both follow it."""
    assert data.batch_indices(100, 8, seed=0, step=0) != data.batch_indices(100, 8, seed=1, step=0)
    tok = common.load_tokenizer(tiny_qwen)
    model = common.load_model(tiny_qwen, sft.Args(model=tiny_qwen, attn_implementation="sdpa"))
    ids, mask = data.encode_prompts(tok, ["POST: alice bought the bike . TL;DR:"] * 4)

    def sample(seed):
        knobs = rollouts.sampling_kwargs(SimpleNamespace(top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, seed=seed), 0)
        return sampling.generate(model, tok, ids, mask, 8, **knobs)[0]

    assert torch.equal(sample(0), sample(0)) and not torch.equal(sample(0), sample(1))


def test_top_p_and_repetition_penalty_reach_generate(tiny_qwen):
    """--top_p near 0 keeps only the most probable token (greedy); --repetition_penalty, passed
    the way the scripts pass it (rollouts.sampling_kwargs), changes the samples."""
    tok = common.load_tokenizer(tiny_qwen)
    model = common.load_model(tiny_qwen, sft.Args(model=tiny_qwen, attn_implementation="sdpa"))
    ids, mask = data.encode_prompts(tok, ["POST: alice bought the bike . TL;DR:", "POST: bob lost it . TL;DR:"])
    greedy = sampling.generate(model, tok, ids, mask, 10, do_sample=False)[0]

    def sample(do_sample=True, **kw):
        knobs = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "seed": 0, **kw}
        return sampling.generate(model, tok, ids, mask, 10, do_sample=do_sample,
                                 **rollouts.sampling_kwargs(SimpleNamespace(**knobs), 0))[0]

    assert torch.equal(sample(top_p=1e-6), greedy) and not torch.equal(sample(), greedy)
    assert torch.equal(sample(False), greedy) and not torch.equal(sample(False, repetition_penalty=1e6), greedy)


def test_dtype_and_trust_remote_code_reach_from_pretrained(tiny_qwen, monkeypatch):
    """--dtype sets the loaded weights' dtype; --trust_remote_code is what from_pretrained is told."""
    from transformers import AutoModelForCausalLM

    seen, load = [], AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs["trust_remote_code"])
        return load(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    for dtype, trust in (("bfloat16", False), ("float32", True)):
        model = common.load_model(tiny_qwen, sft.Args(model=tiny_qwen, dtype=dtype, trust_remote_code=trust))
        assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    assert seen == [False, True]


def test_lora_flags_shape_the_adapters(tiny_qwen):
    """--lora_r, --lora_alpha, --lora_dropout, --lora_target_modules: the adapters' rank, scale
    (alpha / r), dropout and the modules that get them."""
    model = common.load_model(tiny_qwen, sft.Args(model=tiny_qwen, use_peft=True, lora_r=4, lora_alpha=12,
                                                  lora_dropout=0.25, lora_target_modules="q_proj,v_proj"),
                              adapters=True)
    adapted = {name.split(".")[-1]: m for name, m in model.named_modules() if hasattr(m, "lora_A") and m.lora_A}
    assert set(adapted) == {"q_proj", "v_proj"}
    for m in adapted.values():
        assert m.lora_A["default"].out_features == 4 and m.scaling["default"] == 3.0
        assert m.lora_dropout["default"].p == 0.25


def test_learning_rate_schedule_and_warmup(tiny_qwen):
    """--learning_rate, --lr_scheduler_type, --warmup_steps: the learning rate at every step."""
    def lrs(**kw):
        args = SimpleNamespace(**{"learning_rate": 1e-3, "weight_decay": 0.0, "optim": "adamw", "max_steps": 10,
                                  "lr_scheduler_type": "linear", "warmup_steps": 0, **kw})
        optimizer = common.make_optimizer(torch.nn.Linear(2, 2), args)
        scheduler = common.make_scheduler(optimizer, args)
        out = []
        for _ in range(10):
            out.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return out

    assert lrs() == pytest.approx([1e-3 * (10 - i) / 10 for i in range(10)])
    assert lrs(learning_rate=2e-3) == pytest.approx([2e-3 * (10 - i) / 10 for i in range(10)])
    assert lrs(warmup_steps=4)[:5] == pytest.approx([0, 2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lrs(lr_scheduler_type="constant") == pytest.approx([1e-3] * 10)


def test_max_grad_norm_clips_the_gradient_before_the_step():
    """--max_grad_norm: the step sees the gradient scaled to that norm (0: not clipped)."""
    def step(max_grad_norm):
        w = torch.nn.Parameter(torch.zeros(2))
        w.grad = torch.tensor([3.0, 4.0])  # norm 5
        norm = common.optimizer_step(torch.optim.SGD([w], lr=1.0), max_grad_norm, step=1)
        return norm, w.detach()

    norm, w = step(1.0)
    assert float(norm) == 5.0 and torch.allclose(w, torch.tensor([-0.6, -0.8]))
    assert torch.allclose(step(0.0)[1], torch.tensor([-3.0, -4.0]))


@pytest.mark.parametrize("max_grad_norm", [0.5, 100.0, 0.0])
def test_fused_adamw_clips_inside_its_kernel_as_clip_grad_norm_then_step(max_grad_norm):
    """torch's fused AdamW clips by dividing the gradients in its kernel (grad_scale): the weights
    and moments of two steps are clip_grad_norm_ followed by the unfused AdamW's, at a norm above
    --max_grad_norm (clipped), below it (not), and with clipping off."""
    torch.manual_seed(0)
    start = [torch.randn(5, 3), torch.randn(3)]
    grads = [[torch.randn(5, 3), torch.randn(3)] for _ in range(2)]
    runs = []
    for fused in (True, False):
        params = [torch.nn.Parameter(x.clone()) for x in start]
        optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, fused=fused)
        norms = []
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            if fused:
                norms.append(float(common.optimizer_step(optimizer, max_grad_norm, step=1)))
            else:  # the plain recipe
                limit = max_grad_norm if max_grad_norm > 0 else float("inf")
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, limit)))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in params) and not hasattr(optimizer, "grad_scale")
        runs.append((norms, [p.detach() for p in params], [optimizer.state[p]["exp_avg_sq"] for p in params]))
    (norms, weights, moments), (plain_norms, plain_weights, plain_moments) = runs
    assert norms == pytest.approx(plain_norms, rel=1e-6) and (max(norms) > max_grad_norm > 0) == (max_grad_norm == 0.5)
    for a, b in zip(weights + moments, plain_weights + plain_moments):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_logging_steps_save_steps_and_save_total_limit_through_sft(tmp_path, tiny_qwen, sft_data, monkeypatch):
    """--logging_steps: metrics rows every 2 steps (and the last); --save_steps 1 with
    --save_total_limit 2: only the newest two checkpoints stay."""
    out = tmp_path / "out"
    run_main(sft, ["--model", tiny_qwen, "--dataset", sft_data, "--max_steps", "5", "--batch_size", "2",
                   "--logging_steps", "2", "--save_steps", "1", "--save_total_limit", "2", "--optim", "adamw",
                   "--output_dir", str(out)], monkeypatch)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows if "loss" in r] == [2, 4, 5]
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-4", "checkpoint-5"]


def test_scratch_tokenizer_fits_chars_or_words(tmp_path, sft_data, monkeypatch):
    """--scratch_tokenizer char | word: the from-scratch model's tokenizer splits a word into
    letters or keeps it whole; --hidden_size and --num_layers size its model."""
    vocab = {}
    for level in ("char", "word"):
        out = tmp_path / level
        run_main(sft, ["--dataset", sft_data, "--scratch_tokenizer", level, "--hidden_size", "32", "--num_layers", "1",
                       "--max_steps", "1", "--batch_size", "2", "--optim", "adamw", "--output_dir", str(out)], monkeypatch)
        vocab[level] = len(common.load_tokenizer(str(out)).tokenize(" alice bought"))
        config = json.load(open(out / "config.json"))  # --hidden_size, --num_layers (defaults 192, 2)
        assert (config["hidden_size"], config["num_hidden_layers"]) == (32, 1)
    assert vocab["char"] > vocab["word"]


def test_prompt_and_reference_columns_are_read_by_name(tmp_path, tiny_qwen, monkeypatch, capsys):
    """eval.py --prompt_column / --reference_column: the columns named are required (and the
    default 'reference' is optional), so a file with other names is read only when they are passed."""
    from conftest import main_error

    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "POST: alice bought the bike . TL;DR:", "gold": " alice bought bike ."}) + "\n")
    argv = [tiny_qwen, "--dataset", str(path), "--output_dir", str(tmp_path / "out")]
    assert "'prompt'" in main_error(eval_script, argv, monkeypatch, capsys)
    message = main_error(eval_script, argv + ["--prompt_column", "question", "--reference_column", "answer"], monkeypatch, capsys)
    assert "'answer'" in message and "'prompt'" not in message


def test_mask_truncated_completions_zeroes_the_loss_mask_of_cut_completions(tmp_path, monkeypatch):
    """grpo.py --mask_truncated_completions: grpo_loss gets completion_mask 0 on every row that
    reached --max_completion_length without EOS, and the sampled mask on the others."""
    import grpo
    from conftest import uniform_words_model
    from test_main_calls import prompts_file, spy

    model = str(tmp_path / "model")
    uniform_words_model(model)  # some completions end with EOS, others are cut
    prompts, fn = prompts_file(tmp_path)
    generated, losses = spy(monkeypatch, sampling, "generate"), spy(monkeypatch, grpo, "grpo_loss")
    run_main(grpo, ["--model", model, "--dataset", prompts, "--reward_fn", fn, "--batch_size", "2", "--num_generations", "4",
                    "--gradient_accumulation_steps", "1", "--max_steps", "1", "--max_completion_length", "6",
                    "--temperature", "1.5", "--beta", "0", "--mask_truncated_completions", "--optim", "adamw",
                    "--output_dir", str(tmp_path / "out")], monkeypatch)
    (g,), (call,) = generated, losses
    _, mask, truncated = g["out"]
    assert truncated.any() and not truncated.all()
    assert torch.equal(call["completion_mask"], mask * (~truncated[:, None]).long())


def test_online_dpo_samples_with_max_new_tokens_and_temperature(tmp_path, tiny_qwen, monkeypatch):
    """dpo.py --online --max_new_tokens / --temperature: what its sampler is asked for, and the
    completions are no longer than that."""
    import dpo
    from test_main_calls import prompts_file, spy

    prompts, fn = prompts_file(tmp_path)
    generated = spy(monkeypatch, sampling, "generate")
    run_main(dpo, ["--online", "--model", tiny_qwen, "--dataset", prompts, "--reward_fn", fn, "--batch_size", "2",
                   "--max_steps", "1", "--max_new_tokens", "5", "--temperature", "0.55", "--optim", "adamw",
                   "--output_dir", str(tmp_path / "out")], monkeypatch)
    assert generated and all(g["max_new_tokens"] == 5 and g["temperature"] == 0.55 for g in generated)
    assert all(g["out"][0].shape[1] <= 5 for g in generated) and any(g["out"][0].shape[1] == 5 for g in generated)


def test_eval_generation_flags_change_the_responses(tmp_path, tiny_qwen):
    """eval.py --max_completion_length, --do_sample, --temperature, --top_p, --top_k: the
    responses' length bound, sampled against greedy, and each knob at its extreme gives greedy back."""
    from rlhf.evaluation import policies

    prompts = [f"POST: alice bought the bike {i} . TL;DR:" for i in range(4)]

    def ids(**kw):
        args = eval_script.Args(model="", dataset="embedded", cache_dir=str(tmp_path / f"cache{len(os.listdir(tmp_path))}"),
                                **{"max_completion_length": 6, **kw})
        return policies.generate_responses(tiny_qwen, "pi", prompts, args)[2]

    greedy = ids()
    assert max(len(c) for c in greedy) == 6 and max(len(c) for c in ids(max_completion_length=3)) == 3
    assert ids(do_sample=True) != greedy
    assert ids(do_sample=True, temperature=1e-4) == greedy
    assert ids(do_sample=True, top_p=1e-6) == greedy
    assert ids(do_sample=True, top_k=1) == greedy


@pytest.mark.parametrize("script", ["sft", "reward", "dpo", "ppo"])
def test_length_flags_cut_what_each_script_encodes(script, tmp_path, tiny_qwen, sft_data, monkeypatch):
    """--max_prompt_length / --max_completion_length of sft.py, reward.py, dpo.py (offline) and
    ppo.py: the prompts each script encodes are cut to the first, the completions (encoded or
    sampled) to the second, and both cuts bind on this data."""
    import importlib

    from test_main_calls import preference_file, prompts_file, spy

    module = importlib.import_module(script)
    prompts = spy(monkeypatch, data, "encode_prompts")
    completions = spy(monkeypatch, data, "encode_turns" if script == "sft" else "encode_completions")
    sampled = spy(monkeypatch, sampling, "generate")
    dataset = {"sft": sft_data, "reward": preference_file(tmp_path), "dpo": preference_file(tmp_path),
               "ppo": prompts_file(tmp_path)[0]}[script]
    extra = {"ppo": ["--reward_fn", prompts_file(tmp_path)[1], "--num_mini_batches", "1", "--batch_size", "4",
                     "--gradient_accumulation_steps", "1", "--num_ppo_epochs", "1"],
             "reward": ["--eval_steps", "0"]}.get(script, [])
    run_main(module, ["--model", tiny_qwen, "--dataset", dataset, "--max_steps", "1", "--batch_size", "2",
                      "--max_prompt_length", "4", "--max_completion_length", "3", "--optim", "adamw", *extra,
                      "--output_dir", str(tmp_path / "out")], monkeypatch)
    # (truncation_counts encodes the prompts whole, without max_length, to count the long ones)
    widths = [c["out"][0].shape[1] for c in prompts if c["max_length"] is not None]
    assert widths and max(widths) == 4 and all(c["max_length"] == 4 for c in prompts if c["max_length"] is not None)
    if script == "ppo":
        cut = [c["out"][0].shape[1] for c in sampled]
    else:  # (and the completions, to count the long ones)
        cut = [c["out"][0].shape[1] for c in completions if c["max_length"] is not None]
        assert all(c["max_length"] == 3 for c in completions if c["max_length"] is not None)
    assert cut and max(cut) == 3


def test_expand_layers_adds_decoder_layers_to_the_reward_model(tmp_path, tiny_qwen, monkeypatch):
    """reward.py --expand_layers: the saved reward model has the policy's 2 layers plus this many."""
    from test_main_calls import preference_file

    import reward

    for n in (0, 2):
        out = tmp_path / f"expand{n}"
        run_main(reward, ["--model", tiny_qwen, "--dataset", preference_file(tmp_path), "--batch_size", "2", "--max_steps", "1",
                          "--eval_steps", "0", "--expand_layers", str(n), "--optim", "adamw", "--output_dir", str(out)],
                 monkeypatch)
        assert json.load(open(out / "config.json"))["num_hidden_layers"] == 2 + n
