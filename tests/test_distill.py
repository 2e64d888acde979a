"""distill.py: the divergence against a direct transcription of GKD's Eq. 1 (TRL's ends), the
chunked head against full logits, and the script through main() on the embedded world with a
student and a teacher built from it: its first loss is the transcription's on the very batches it
trained on, the student moves toward the teacher, the run leaves what a run leaves; a teacher with
another tokenizer is refused."""

import json
from types import SimpleNamespace
import os

import pytest
import torch
from conftest import main_error, run_main

import distill


def _softmax_kl(p, q):
    """KL(p || q) of probability rows, summed over the vocabulary: (n, V) -> (n,)."""
    return (p * (p.log() - q.log())).sum(-1)


def _transcribed(student_logits, teacher_logits, beta, temperature):
    """GKD Eq. 1 in probability space, its ends the two KLs as TRL's generalized_jsd_loss has them."""
    p_s, p_t = (torch.softmax(x.double() / temperature, -1) for x in (student_logits, teacher_logits))
    if beta == 0:
        return _softmax_kl(p_t, p_s)
    if beta == 1:
        return _softmax_kl(p_s, p_t)
    m = beta * p_t + (1 - beta) * p_s
    return beta * _softmax_kl(p_t, m) + (1 - beta) * _softmax_kl(p_s, m)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generalized_jsd_matches_the_equation(beta, temperature):
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, 11, generator=g) * 3, torch.randn(6, 11, generator=g) * 3
    ours = distill.generalized_jsd(student, teacher, beta, temperature)
    torch.testing.assert_close(ours.double(), _transcribed(student, teacher, beta, temperature), rtol=1e-5, atol=1e-6)
    assert (ours > 0).all()
    assert torch.allclose(distill.generalized_jsd(student, student, beta, temperature), torch.zeros(6), atol=1e-6)


def _full_divergence(model, teacher, batch, beta, temperature):
    """D_t from each model's whole forward (model(...).logits, no chunks): (B, C), 0 off the mask."""
    from rlhf import sampling

    def logits(m):
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["attention_mask"]], 1)
        out = m(input_ids=ids, attention_mask=mask, position_ids=sampling.position_ids(mask)).logits.float()
        return out[:, batch["prompt_ids"].shape[1] - 1:-1]  # (B, C, V): what predicts each completion token
    student, teach = logits(model), logits(teacher).detach()
    B, C, V = student.shape
    d = _transcribed(student.reshape(-1, V), teach.reshape(-1, V), beta, temperature).view(B, C)
    return d * batch["completion_mask"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A student and a teacher built from the embedded world (its tokenizer, tiny Qwen2s of seeds 0
    and 1) and a model of another tokenizer (the chat tokenizer's extra tokens)."""
    from conftest import chat_tokenizer, save_tiny
    from worlds import world

    tok, out = world.build_tokenizer(), {}
    for name, seed in (("student", 0), ("teacher", 1)):
        folder = tmp_path_factory.mktemp(name)
        world.build_model(tok, hidden_size=64, num_layers=2, seed=seed).save_pretrained(folder)
        tok.save_pretrained(folder)
        out[name] = str(folder)
    out["foreign"] = save_tiny(tmp_path_factory.mktemp("foreign"), "Qwen2", chat_tokenizer(), hidden_size=64,
                               intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    return out


def test_chunked_heads_equal_full_logits_and_their_gradient(pair):
    """token_divergence (hidden states, heads on kept tokens only, checkpointed chunks of 3 tokens)
    equals the divergence of the models' whole forwards, and so does the student's gradient."""
    from rlhf import data
    import common

    tokenizer = common.load_tokenizer(pair["student"])
    args = common.ModelArgs(model=pair["student"], dtype="float32")
    student, teacher = common.load_model(pair["student"], args), common.freeze(common.load_model(pair["teacher"], args))
    prompt_ids, prompt_mask = data.encode_prompts(tokenizer, ["POST: bob sold the car . TL;DR:", "POST: alice ate . TL;DR:"])
    completion_ids, attention_mask = data.encode_completions(tokenizer, [" bob sold car .", " alice ate an apple today ."])
    completion_mask = attention_mask.clone()
    completion_mask[0, 0] = 0  # a masked token inside a completion (a tool reply, a user turn)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
             "attention_mask": attention_mask, "completion_mask": completion_mask}
    grads = []
    for chunked in (True, False):
        student.zero_grad()
        d = (distill.token_divergence(student, teacher, batch, 0.3, 0.8, chunk_tokens=3)[0] if chunked
             else _full_divergence(student, teacher, batch, 0.3, 0.8))
        d.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None]))
        if chunked:
            ours = d.detach()
        else:
            torch.testing.assert_close(ours.double(), d.detach(), rtol=1e-4, atol=1e-6)
    assert ours[0, 0] == 0 and (ours[completion_mask.bool()] > 0).all()
    torch.testing.assert_close(grads[0].double(), grads[1].double(), rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("lmbda, beta, temperature, extra", [(0.5, 0.3, 0.8, []), (0.0, 1.0, 1.0, ["--use_peft"])],
                         ids=["mixed_jsd_tempered", "off_policy_reverse_kl_lora"])
def test_distill_main_on_the_embedded_world(pair, tmp_path, monkeypatch, lmbda, beta, temperature, extra):
    """distill.main() on the embedded world (its SFT split: prompts and the demonstrator's
    completions), 2 micro-batches a step: the first step's loss is the sum of the transcribed D_t
    of the initial student and the teacher's whole forwards over both micro-batches' completion
    tokens, divided by their number; each micro-batch is the student's sample or the dataset's as
    the seeded --lmbda draw says; the divergence falls (the student moves toward the teacher); the
    run writes metrics.jsonl, summary.json (gold scores of the student before and after and of the
    teacher) and a model folder AutoModelForCausalLM loads. With --use_peft the student is LoRA."""
    import common
    from transformers import AutoModelForCausalLM

    seen = []
    real_micro_batch = distill.micro_batch

    def recording(sampler, model, world, step, micro):
        batch = real_micro_batch(sampler, model, world, step, micro)
        seen.append((step, micro, {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}))
        return batch

    monkeypatch.setattr(distill, "micro_batch", recording)
    out = str(tmp_path / "out")
    run_main(distill, ["--model", pair["student"], "--teacher", pair["teacher"], "--max_steps", "4", "--batch_size", "4",
                       "--gradient_accumulation_steps", "2", "--max_completion_length", "24", "--max_prompt_length", "24",
                       "--learning_rate", "3e-3", "--optim", "adamw", "--lmbda", str(lmbda), "--beta", str(beta),
                       "--temperature", str(temperature), "--output_dir", out, *extra], monkeypatch)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]

    # each micro-batch: sampled by the student exactly where the seeded draw says, else the dataset's
    draws = [distill.is_on_policy(SimpleNamespace(seed=0, lmbda=lmbda), s, m) for s, m, _ in seen]
    assert [b["on_policy"] for _, _, b in seen] == draws and [r["on_policy"] for r in rows] == [
        sum(draws[2 * s:2 * s + 2]) / 2 for s in range(4)]
    assert (0 < sum(draws) < 8) if 0 < lmbda < 1 else sum(draws) == 8 * lmbda
    # prompts keep their last --max_prompt_length tokens, completions (sampled or the dataset's) at most --max_completion_length
    # (24 tokens: the dataset's completions are shorter and padded, the untrained student's samples reach it)
    assert all(b["prompt_ids"].shape[1] <= 24 and b["completion_ids"].shape[1] <= 24 for _, _, b in seen)
    assert max(b["prompt_ids"].shape[1] for _, _, b in seen) == 24
    assert all(b["completion_ids"].shape[1] == 24 for _, _, b in seen if b["on_policy"])
    assert any((b["attention_mask"] == 0).any() for _, _, b in seen if not b["on_policy"])  # padding the loss must skip

    # step 1's loss from the whole forwards of the initial student and the teacher
    args = common.ModelArgs(model=pair["student"], dtype="float32")
    student, teacher = (common.freeze(common.load_model(pair[n], args)) for n in ("student", "teacher"))
    first = [b for s, _, b in seen if s == 0]
    with torch.no_grad():
        total = sum(_full_divergence(student, teacher, b, beta, temperature).sum() for b in first)
    tokens = sum(b["completion_mask"].sum() for b in first)
    assert rows[0]["loss"] == pytest.approx(float(total / tokens), rel=1e-4)
    assert rows[-1]["divergence"] < rows[0]["divergence"]  # the student moved toward the teacher

    summary = json.load(open(os.path.join(out, "summary.json")))
    for key in ("gold_score", "init_gold_score", "teacher_gold_score", "final_loss", "completions_truncated"):
        assert key in summary, key
    assert summary["tokens_per_second"] > 0 and 0 < summary["mfu"] < 1  # the student's update only (rlhf/throughput.py)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen2"


def test_bad_input_stops_with_a_clear_message(pair, tmp_path, monkeypatch, capsys):
    message = main_error(distill, ["--model", pair["student"], "--teacher", pair["foreign"],
                                   "--output_dir", str(tmp_path / "o")], monkeypatch, capsys)
    assert f"--teacher {pair['foreign']}: its tokenizer is not the student's" in message and "one vocabulary" in message
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "POST: bob sold the car . TL;DR:"}) + "\n")
    message = main_error(distill, ["--model", pair["student"], "--teacher", pair["teacher"], "--dataset", str(prompts),
                                   "--lmbda", "0.5", "--output_dir", str(tmp_path / "o2")], monkeypatch, capsys)
    assert "--lmbda 0.5" in message and "prompt-only rows" in message
    message = main_error(distill, ["--model", pair["student"], "--teacher", pair["teacher"], "--beta", "1.5",
                                   "--output_dir", str(tmp_path / "o3")], monkeypatch, capsys)
    assert "--beta 1.5" in message and "[0, 1]" in message


def test_a_world_without_completions_gives_its_rl_prompts():
    """--dataset embedded:ifeval (prompts and verifiers, no completions): the student samples on its rl
    split's prompts, every one; the summarization world keeps its sft split (prompts with completions
    for --lmbda < 1); --lmbda < 1 on prompts alone is refused."""
    from rlhf import data
    from worlds import world_ifeval

    assert distill.prompt_split("embedded") == "sft" and distill.prompt_split("embedded:ifeval") == "rl"
    ds = data.named_data("embedded:ifeval", "train", distill.prompt_split("embedded:ifeval"), 0)
    rows = distill.distill_rows(ds, "embedded:ifeval", 1.0)
    assert len(rows) == world_ifeval.RL_SIZE and rows[0] == (ds[0]["prompt"], None)
    with pytest.raises(SystemExit):
        distill.distill_rows(ds, "embedded:ifeval", 0.5)


def test_the_memory_plan_holds_the_teacher(pair, tmp_path, monkeypatch, capsys):
    """--estimate_memory: a row for the frozen teacher, its weights counted from its config."""
    from transformers import AutoModelForCausalLM

    with pytest.raises(SystemExit) as e:
        run_main(distill, ["--model", pair["student"], "--teacher", pair["teacher"], "--dtype", "float32",
                           "--estimate_memory", "--output_dir", str(tmp_path / "o")], monkeypatch)
    assert e.value.code in (0, None)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("teacher model"))
    numel = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(pair["teacher"]).parameters())
    assert float(row.split()[3]) == pytest.approx(numel * 4 / 2**20, abs=0.1)
