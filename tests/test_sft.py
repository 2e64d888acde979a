"""sft.py end to end at tiny size, through subprocess, as a user runs it."""

import json
import os

import pytest
import torch
from conftest import run_script


def _metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_sft_from_scratch_on_the_embedded_world(tmp_path):
    out = str(tmp_path / "sft")
    run_script("sft.py", "--output_dir", out, "--max_steps", "6", "--batch_size", "8", "--hidden_size", "64",
               "--num_layers", "1", "--save_steps", "3", "--eval_batch_size", "100", "--optim", "adamw")
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(k in rows[0] for k in ("loss", "grad_norm", "learning_rate"))
    assert rows[-1]["loss"] < rows[0]["loss"]
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert -1 <= summary["gold_score"] <= 1 and summary["reference_gold"] == 1.0
    assert 0.5 < summary["label_ceiling"] < 1 and summary["demo_gold"] < 1
    # throughput (rlhf/throughput.py): every step's, and the run's after its first step
    assert all(r["step_time"] > 0 and r["tokens_per_second"] > 0 and 0 < r["mfu"] < 1 for r in rows)
    assert 0 < summary["step_time"] <= summary["seconds_per_step"] and "rollout_tokens_per_second" not in summary
    read = summary["tokens_per_second"] * summary["step_time"]  # a step's tokens the model read
    batch = (rows[-1]["num_tokens"] - rows[0]["num_tokens"]) / 5  # a step's tokens in the batch (TRL's num_tokens)
    assert batch - 8 - 1e-6 <= read <= batch - 1 + 1e-6  # each completion but its last token, a label only: the widest lose it
    assert summary["mfu"] == pytest.approx(summary["flops_per_step"] / summary["step_time"] / summary["peak_flops"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import common
    from worlds import world

    texts = [r["prompt"] + r["completion"] for r in world.build_world()["sft"].select(range(50))]
    for folder in (out, os.path.join(out, "checkpoint-3"), os.path.join(out, "checkpoint-6")):
        model = AutoModelForCausalLM.from_pretrained(folder)
        tok = AutoTokenizer.from_pretrained(folder)  # as TRL, vLLM and lm-eval load it: the scripts' tokens
        assert tok.pad_token_id != tok.eos_token_id
        assert tok(texts)["input_ids"] == common.load_tokenizer(folder)(texts)["input_ids"]
        assert model.config.model_type == "qwen2"
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


def test_sft_any_model_on_conversational_jsonl(tmp_path, tiny_llama):
    data = tmp_path / "chat.jsonl"
    with open(data, "w") as f:
        for i in range(12):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": "POST: alice bought the bike . TL;DR:"},
                {"role": "assistant", "content": "alice bought bike ."}]}) + "\n")
    out = str(tmp_path / "sft_llama")
    proc = run_script("sft.py", "--model", tiny_llama, "--dataset", str(data), "--output_dir", out,
                      "--max_steps", "4", "--batch_size", "4", "--learning_rate", "1e-3")
    assert "12 examples" in proc.stdout
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import common

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama"
    text = "<|user|> POST: alice bought the bike . TL;DR: <|assistant|> alice bought bike . <eos> "
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == common.load_tokenizer(out)(text)["input_ids"]
    assert json.load(open(os.path.join(out, "summary.json")))["final_loss"] > 0
    before = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, before.model.layers[0].mlp.up_proj.weight)


def test_sft_rejects_bad_input_with_a_clear_message(tmp_path, tiny_llama, monkeypatch, capsys):
    import sft
    from conftest import main_error

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "completion": " y"}\n{"prompt": "x"\n')
    out = ["--output_dir", str(tmp_path / "o")]
    assert "bad.jsonl, line 2" in main_error(sft, ["--model", tiny_llama, "--dataset", str(bad), *out], monkeypatch, capsys)
    assert "--optim 'sgd'" in main_error(sft, ["--optim", "sgd", *out], monkeypatch, capsys)
    assert "does not exist" in main_error(sft, ["--model", str(tmp_path / "nope"), *out], monkeypatch, capsys)


def test_two_micro_batches_train_like_one_of_twice_the_size(tmp_path, tiny_qwen, sft_data, monkeypatch):
    """Gradient accumulation: the loss is one token mean over the optimizer batch (TRL), not a mean of
    per-micro-batch means, so 2 micro-batches of 4 train like 1 of 8 (completions differ in length)."""
    from conftest import run_main
    from safetensors.torch import load_file

    import sft

    argv = ["--model", tiny_qwen, "--dataset", sft_data, "--max_steps", "3", "--learning_rate", "1e-2",
            "--warmup_steps", "0", "--optim", "adamw"]
    run_main(sft, argv + ["--batch_size", "8", "--output_dir", str(tmp_path / "one")], monkeypatch)
    run_main(sft, argv + ["--batch_size", "4", "--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "two")],
             monkeypatch)
    a, b = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    for ra, rb in zip(a, b):
        assert ra["num_tokens"] == rb["num_tokens"]
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5) and rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)
    wa, wb = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-4, rtol=0)


def test_multi_turn_sft_trains_only_the_assistant_turns(tmp_path, tiny_llama, monkeypatch):
    """sft.main on two-assistant-turn conversations: the mask the loss gets is the loss mask (the
    user turn between the assistant turns is a hole of zeros), not the completion mask (ones up to
    EOS), and the logged loss is the token mean over the assistant tokens only."""
    import sft
    from conftest import run_main

    u, a = (lambda c: {"role": "user", "content": c}), (lambda c: {"role": "assistant", "content": c})
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [u(f"alice bought the bike {i}"), a("alice bought bike ."),
                                                     u("what did bob do ?"), a("bob lost phone .")]}) + "\n"
                            for i in range(4)))
    seen, loss = [], sft.sft_loss

    def spy(logprobs, completion_mask, num_tokens):
        seen.append((logprobs.detach(), completion_mask.detach().clone(), num_tokens))
        return loss(logprobs, completion_mask, num_tokens)

    monkeypatch.setattr(sft, "sft_loss", spy)
    out = tmp_path / "sft"
    run_main(sft, ["--model", tiny_llama, "--dataset", str(path), "--output_dir", str(out), "--max_steps", "1",
                   "--batch_size", "4", "--optim", "adamw"], monkeypatch)
    (logprobs, mask, num_tokens), = seen
    for row in mask.tolist():  # 1s (assistant), a hole of 0s (the user turn), 1s again, then padding
        n = max(i for i, m in enumerate(row) if m) + 1
        assert 0 in row[:n] and row[0] == 1, row
    assert int(mask.sum()) == int(num_tokens)  # the normaliser counts the trained tokens, as the mask does
    logged = json.loads(open(out / "metrics.jsonl").readline())["loss"]
    assert logged == pytest.approx(float(-(logprobs * mask).sum() / mask.sum()), rel=1e-5)


def test_main_takes_the_gradient_of_the_full_log_softmax_loss(tmp_path, tiny_llama, monkeypatch):
    """sft.main's first step: the loss and the gradient norm (before clipping) it logs are those of
    the loss written with the model's full logits and torch's log_softmax on the same batch at the
    initial weights: the head's log-prob and its backward (sampling.LabelLogprob), the completion's
    states, the mask and the token mean, all through main()."""
    import sft
    from conftest import run_main
    from transformers import AutoModelForCausalLM

    from rlhf import sampling

    batches, completion_logprobs = [], sampling.completion_logprobs
    monkeypatch.setattr(sampling, "completion_logprobs", lambda *a, **kw: batches.append(a[1:]) or completion_logprobs(*a, **kw))
    out = tmp_path / "sft"
    run_main(sft, ["--model", tiny_llama, "--output_dir", str(out), "--max_steps", "1", "--batch_size", "4",
                   "--optim", "adamw", "--dataset", "embedded"], monkeypatch)
    (p_ids, p_mask, c_ids, c_mask), = batches
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)  # the weights of step 1
    ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=sampling.position_ids(mask)).logits
    logprobs = torch.log_softmax(logits[:, p_ids.shape[1] - 1:-1].float(), -1).gather(-1, c_ids[..., None]).squeeze(-1)
    loss = -(logprobs * c_mask).sum() / c_mask.sum()
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    logged = json.loads(open(out / "metrics.jsonl").readline())
    assert logged["loss"] == pytest.approx(float(loss), rel=1e-5) and logged["grad_norm"] == pytest.approx(float(norm), rel=1e-4)


@torch.no_grad()
def test_packed_rows_give_the_unpacked_loss(tiny_llama):
    """--packing: examples of different lengths packed into rows (position ids restarting with each)
    give, token for token, the log-probs of the prompt/completion path on the same rows; with
    positions that do not restart (no bounds between examples) they would not."""
    from rlhf import data
    from rlhf import sampling

    import common
    import sft

    tok = common.load_tokenizer(tiny_llama)
    model = common.load_model(tiny_llama, sft.Args(model=tiny_llama, dtype="float32", attn_implementation="sdpa"))
    u, a = (lambda c: {"role": "user", "content": c}), (lambda c: {"role": "assistant", "content": c})
    pairs = [([u("alice bought the bike" + " now" * i)], [a("alice bought bike ." + " now" * (3 - i))]) for i in range(4)]
    pairs.append(([u("what did bob do ?")], [a("bob lost phone ."), u("and alice ?"), a("alice bought bike .")]))
    prompts = [data.render_prompt(tok, p) for p, _ in pairs]
    turns = [data.render_turns(tok, p, c) for p, c in pairs]
    stops = sampling.stop_token_ids(model, tok)

    prompt_ids, prompt_mask = data.encode_prompts(tok, prompts)
    completion_ids, completion_mask, loss_mask = data.encode_turns(tok, turns, None, stops)
    unpacked = sampling.completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    want = sft.sft_loss(unpacked, loss_mask, loss_mask.sum())

    ids, masks, cut = data.encode_examples(tok, prompts, turns, 64, stops)
    assert cut == 0 and [sum(m) for m in masks] == loss_mask.sum(1).tolist()
    rows = data.pack([len(x) for x in ids], 64)
    assert len(rows) < len(pairs) and sorted(i for r in rows for i in r) == list(range(len(pairs)))
    assert all(sum(len(ids[i]) for i in r) <= 64 for r in rows)
    input_ids, position_ids, real, packed_mask = data.packed_batch(rows, ids, masks, tok.pad_token_id)
    packed = sampling.packed_logprobs(model, input_ids, position_ids, packed_mask)
    got = sft.sft_loss(packed, packed_mask, packed_mask.sum())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed[packed_mask.bool()].sort().values, unpacked[loss_mask.bool()].sort().values,
                               rtol=1e-4, atol=1e-5)
    # the control: one position sequence per row lets each example attend to the ones before it
    running = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    leaked = sft.sft_loss(sampling.packed_logprobs(model, input_ids, running, packed_mask), packed_mask, packed_mask.sum())
    assert abs(float(leaked - want)) > 1e-3


def test_sft_max_length_packing_and_epochs_through_main(tmp_path, tiny_llama, monkeypatch):
    """sft.main on conversations: --max_length with --packing (rows of packed examples, --num_train_epochs
    counting them) logs the first step's loss and token count that unpacked rows give on the same examples."""
    from conftest import run_main

    import sft

    u, a = (lambda c: {"role": "user", "content": c}), (lambda c: {"role": "assistant", "content": c})
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [u("alice bought the bike" + " now" * i), a("alice bought bike ."),
                                                     u("what did bob do ?"), a("bob lost phone ." + " now" * i)]}) + "\n"
                            for i in range(4)))
    flags = ["--model", tiny_llama, "--dataset", str(path), "--optim", "adamw", "--dtype", "float32",
             "--attn_implementation", "sdpa", "--max_length", "128"]
    run_main(sft, [*flags, "--batch_size", "4", "--max_steps", "1", "--output_dir", str(tmp_path / "rows")], monkeypatch)
    run_main(sft, [*flags, "--packing", "--batch_size", "2", "--num_train_epochs", "1",
                   "--output_dir", str(tmp_path / "packed")], monkeypatch)
    rows, packed = _metrics(tmp_path / "rows"), _metrics(tmp_path / "packed")
    assert len(packed) == 1  # 4 examples in 2 rows of 128 tokens: one epoch of batch 2 is one step
    assert packed[0]["num_tokens"] == rows[0]["num_tokens"]
    assert packed[0]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-5)
    summary = json.load(open(tmp_path / "packed" / "summary.json"))
    assert summary["examples_truncated"] == 0


@pytest.mark.parametrize("rows, flags, expected", [
    ([[("user", None), ("assistant", "bob sold car .")]], [],
     "row 0, column 'messages', message 0 (user): the content is NoneType None, not text"),
    ([[("user", "alice bought the bike"), ("assistant", [{"type": "text", "text": "alice bought bike ."}])]], [],
     "row 0, column 'messages', message 1 (assistant): the content is list [{'type': 'text', 'text': 'alice bought bike .'}], "
     "not text; write each message's content as one string"),
    ([[("user", "a b"), ("assistant", "bob ."), ("user", "c d"), ("assistant", "e .")],
      [("user", "alice bought the bike"), ("assistant", " "), ("user", "what did bob do ?"), ("assistant", "bob lost phone .")]],
     [], "row 1, column 'messages', message 1: an assistant message before the last one is empty; it would train on the "
         "end-of-turn token alone"),
    ([[("user", "alice bought the bike ."), ("assistant", "bob .")], [("user", "alice bought the bike" + " bike" * 40),
                                                                     ("assistant", "bob lost phone .")]],
     ["--max_length", "16"], "row 1: no token of its completion is left within --max_length 16 (the prompt alone has "),
], ids=["content null", "content a list of parts", "an empty assistant turn before the last", "nothing left after --max_length"])
def test_sft_refuses_messages_it_would_train_wrongly(tmp_path, tiny_llama, monkeypatch, capsys, rows, flags, expected):
    import sft
    from conftest import main_error

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in row]}) + "\n" for row in rows))
    message = main_error(sft, ["--model", tiny_llama, "--dataset", str(path), "--optim", "adamw", "--max_steps", "1",
                               "--output_dir", str(tmp_path / "o"), *flags], monkeypatch, capsys)
    first = message.splitlines()[0]  # then the datasets progress lines on stderr
    assert first.startswith(f"error: {path}, ") and expected in first and first.endswith(".")
