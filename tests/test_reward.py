"""reward.py: the Bradley-Terry loss on hand-built pairs, the shared-prompt batching of chosen and
rejected, block expansion, and the script end to end at tiny size."""

import json
import math
import os

import pytest
import torch
from conftest import run_script

import common
import reward
from rlhf import sampling


def test_bradley_terry_loss_and_accuracy_on_hand_built_pairs():
    chosen, rejected = torch.tensor([2.0, 0.0, 3.0]), torch.tensor([1.0, 1.0, 3.0])
    loss, m = reward.bradley_terry_loss(chosen, rejected)
    # -log sigmoid(d) = log(1 + exp(-d)) for margins d = 1, -1, 0
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1)) + math.log(2)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["accuracy"].item() == pytest.approx(1 / 3)  # a tie is not a correct ranking
    assert m["margin"].item() == pytest.approx(0.0, abs=1e-7)
    # the gradient raises the chosen score and lowers the rejected one
    c, r = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    reward.bradley_terry_loss(c, r)[0].backward()
    assert (c.grad < 0).all() and (r.grad > 0).all() and torch.allclose(c.grad, -r.grad)
    # large margins do not underflow to log(0)
    assert torch.isfinite(reward.bradley_terry_loss(torch.tensor([-200.0]), torch.tensor([200.0]))[0])


def test_pair_scores_match_scoring_each_sequence_alone(tiny_qwen):
    from transformers import AutoModelForSequenceClassification

    class A:
        dtype, attn_implementation, trust_remote_code = "float32", "sdpa", False
        max_prompt_length, max_completion_length = 512, 256

    tok = common.load_tokenizer(tiny_qwen)
    model = common.freeze(common.load_model(tiny_qwen, A, cls=AutoModelForSequenceClassification, num_labels=1))
    triples = [("POST: alice bought the bike . TL;DR:", " alice bought bike .", " bob lost phone . alice sold car ."),
               ("POST: bob lost the phone at the park . it was a long week . TL;DR:", " bob lost phone .", " bob ."),
               ("POST: erin hid the lamp . TL;DR:", " erin hid lamp .", " erin hid the lamp at the park yesterday .")]
    with torch.no_grad():
        chosen, rejected = reward.pair_scores(model, tok, triples, A)
        for i, (p, c, r) in enumerate(triples):
            for text, batched in ((c, chosen[i]), (r, rejected[i])):
                ids = tok(p + text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                alone = sampling.sequence_scores(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
                assert alone.item() == pytest.approx(batched.item(), abs=1e-4)
    loss, m = reward.bradley_terry_loss(chosen, rejected)
    assert loss.item() == pytest.approx(-torch.nn.functional.logsigmoid(chosen - rejected).mean().item(), rel=1e-6)
    # a model whose config lists "." as a stop token (a chat model's end of turn): a response ending in
    # it is scored there, with no EOS added, as the policy's completions end
    dot = tok(" .", add_special_tokens=False)["input_ids"][-1]
    model.config.eos_token_id = [tok.eos_token_id, dot]
    with torch.no_grad():
        chosen, _ = reward.pair_scores(model, tok, triples, A)
        for i, (p, c, _) in enumerate(triples):
            ids = tok(p + c, add_special_tokens=False)["input_ids"]
            assert ids[-1] == dot
            alone = sampling.sequence_scores(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
            assert alone.item() == pytest.approx(chosen[i].item(), abs=1e-4)


def test_expanded_layers_start_as_the_trunk_train_and_load_as_saved(tmp_path, tiny_qwen):
    """Block expansion: a new top layer whose output projections are zero adds nothing, so the
    expanded model scores exactly as the trunk did; the loss reaches the new layers; and the saved
    folder loads with AutoModelForSequenceClassification as the deeper model, scores unchanged."""
    from transformers import AutoModelForSequenceClassification

    class A:
        max_prompt_length, max_completion_length = 512, 256

    tok = common.load_tokenizer(tiny_qwen)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_qwen, num_labels=1).eval()
    triples = [("POST: alice bought the bike . TL;DR:", " alice bought bike .", " alice sold bike ."),
               ("POST: bob lost the phone at the park . erin hid the lamp . TL;DR:", " bob lost phone . erin hid lamp .",
                " bob lost lamp . erin hid lamp .")]
    with torch.no_grad():
        before = reward.pair_scores(model, tok, triples, A)
    reward.expand_layers(model, 2)
    assert model.config.num_hidden_layers == len(model.config.layer_types) == len(model.model.layers) == 4
    after = reward.pair_scores(model, tok, triples, A)
    assert all(torch.equal(b, a) for b, a in zip(before, after))
    reward.bradley_terry_loss(*after)[0].backward()
    top = model.model.layers[-1]
    assert top.self_attn.o_proj.weight.grad.abs().sum() > 0 and top.mlp.down_proj.weight.grad.abs().sum() > 0
    with torch.no_grad():  # as after training: the new layers compute something
        for p in model.model.layers[2:].parameters():
            p.add_(0.05 * torch.randn_like(p))
        trained = reward.pair_scores(model, tok, triples, A)
    assert not torch.equal(trained[0], before[0])
    model.save_pretrained(tmp_path / "rm")
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert loaded.config.num_hidden_layers == 4
    with torch.no_grad():
        for s, t in zip(reward.pair_scores(loaded, tok, triples, A), trained):
            torch.testing.assert_close(s, t)


def test_reward_end_to_end_on_the_embedded_world(tmp_path, tiny_qwen):
    out = str(tmp_path / "rm")
    proc = run_script("reward.py", "--model", tiny_qwen, "--output_dir", out, "--max_steps", "4", "--batch_size", "8",
                      "--eval_steps", "2", "--test_size", "0.02", "--save_steps", "4", "--optim", "adamw")
    assert "15680 train / 320 test pairs" in proc.stdout  # 4000 annotator pairs + 12000 contrast pairs
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    assert all(k in train_rows[0] for k in ("loss", "accuracy", "margin", "mean_reward", "grad_norm", "learning_rate"))
    assert "eval_accuracy" in train_rows[1] and rows[-1]["step"] == 4 and "eval_accuracy" in rows[-1]
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert 0 <= summary["test_accuracy"] <= 1 and 0 <= summary["train_accuracy"] <= 1
    assert summary["prompts_truncated"] == summary["completions_truncated"] == 0
    assert summary["label_ceiling"] == pytest.approx(0.94365625) and 0 <= summary["test_gold_accuracy"] <= 1
    probes = summary["probe_accuracy"]
    assert set(probes) == {"omission", "wrong_object", "wrong_action", "wrong_person"}
    assert all(0 <= v <= 1 for v in probes.values()) and "minimal pairs" in proc.stdout
    # reward_mean travels with the model, and the saved folder loads as a reward model
    rm, tok = common.load_reward_model(out, type("A", (), {"dtype": "float32", "attn_implementation": "sdpa",
                                                            "trust_remote_code": False}))
    assert rm.config.reward_mean == pytest.approx(summary["reward_mean"])
    assert rm.config.num_labels == 1 and os.path.isdir(os.path.join(out, "checkpoint-4"))
    assert rm.config.num_hidden_layers == 3  # the embedded world's reward model: the policy's 2 layers + 1 new


def test_reward_rejects_data_without_pairs(tmp_path, tiny_qwen, monkeypatch, capsys):
    from conftest import main_error

    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "x", "chosen": " y"}\n')
    message = main_error(reward, ["--model", tiny_qwen, "--dataset", str(bad), "--output_dir", str(tmp_path / "o")],
                         monkeypatch, capsys)
    assert "no column 'rejected'" in message
    message = main_error(reward, ["--model", tiny_qwen, "--use_peft", "--expand_layers", "1",
                                  "--output_dir", str(tmp_path / "o")], monkeypatch, capsys)
    assert "--expand_layers" in message and "--use_peft" in message


def test_gradient_checkpointing_shrinks_reward_model_activations(tmp_path, tiny_qwen, monkeypatch):
    """reward.py trains in training mode (dropout zeroed), so --gradient_checkpointing shrinks the
    bytes saved for backward (in eval mode HF layers do not checkpoint)."""
    from conftest import SavedBytes, run_main

    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": f"POST: alice bought the bike {i} . TL;DR:",
                                         "chosen": " alice bought bike ." * 3, "rejected": " bob" * (i + 5)}) + "\n"
                             for i in range(8)))
    forward, saved = reward.pair_scores, []

    def measured(model, tokenizer, triples, args):
        if not torch.is_grad_enabled():
            return forward(model, tokenizer, triples, args)
        with SavedBytes() as s:
            out = forward(model, tokenizer, triples, args)
        saved.append(s.bytes)
        return out

    monkeypatch.setattr(reward, "pair_scores", measured)
    argv = ["--model", tiny_qwen, "--dataset", str(prefs), "--max_steps", "1", "--batch_size", "4", "--eval_steps", "0",
            "--test_size", "0.25", "--optim", "adamw"]
    run_main(reward, argv + ["--output_dir", str(tmp_path / "plain")], monkeypatch)
    run_main(reward, argv + ["--output_dir", str(tmp_path / "ckpt"), "--gradient_checkpointing"], monkeypatch)
    plain, ckpt = saved
    assert ckpt < 0.6 * plain, (plain, ckpt)


def test_reward_models_read_the_whole_completion_in_grpo_and_ppo(tiny_qwen):
    """grpo.score and ppo.score cut only the prompt (--max_prompt_length): two 64-token completions
    that differ after their 60th token score differently at --max_prompt_length 32 (they were both
    cut at 32 tokens and scored identically)."""
    from types import SimpleNamespace

    import grpo
    import ppo
    from transformers import AutoModelForSequenceClassification

    tok = common.load_tokenizer(tiny_qwen)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_qwen, num_labels=1).eval()
    texts = [" alice" * 61 + " bob lost phone", " alice" * 61 + " bob bought bike"]
    assert [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts] == [64, 64]
    prompts = ["POST: alice bought the bike . TL;DR:"] * 2
    args = SimpleNamespace(max_prompt_length=32, max_completion_length=64, eval_batch_size=8, max_steps=1)
    by_grpo = grpo.score([{"model": rm, "tokenizer": tok, "name": "rm"}], prompts, texts, None, {}, args)[:, 0]
    by_ppo = ppo.score(None, rm, tok, prompts, texts, None, {}, args)
    whole = sampling.reward_model_scores(rm, tok, prompts, texts)  # nothing cut
    torch.testing.assert_close(by_grpo, whole)
    torch.testing.assert_close(by_ppo, whole)
    assert abs(float(whole[0] - whole[1])) > 1e-4
