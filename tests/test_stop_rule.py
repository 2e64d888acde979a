"""One stop rule in every path (sampling.stop_token_ids): on an instruct layout whose end-of-turn
token is not the tokenizer's EOS (Llama-3-Instruct: EOS <|end_of_text|>, the template ends a turn
with <|eot_id|>, generation_config.eos_token_id lists both; Gemma-it and Phi-3 alike), the
evaluation losses, margins and truncation counts encode rows exactly as training does: no EOS
after the end-of-turn token."""

import json
import os

import pytest
import torch

from rlhf import data
import dpo
from rlhf import sampling
import sft
from conftest import chat_tokenizer, run_main

# the template ends an assistant turn with <|eot|>, not with the tokenizer's EOS (<eos>)
INSTRUCT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% if m['role'] == 'assistant' %}<|eot|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = ["alice bought the bike .", "bob lost the phone .", "alice lost it .", "bob bought it now .",
         "nobody knows .", "alice bought bike . now now"]


@pytest.fixture(scope="module")
def instruct_llama(tmp_path_factory):
    """A tiny Llama-3-Instruct-shaped folder: EOS <eos>, end of turn <|eot|>, generation_config [eos, eot]."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("instruct_llama")
    tok = chat_tokenizer()
    tok.add_tokens(["<|eot|>"], special_tokens=True)
    tok.chat_template = INSTRUCT_TEMPLATE
    eot = tok.convert_tokens_to_ids("<|eot|>")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = [tok.eos_token_id, eot]
    model.save_pretrained(path)
    tok.save_pretrained(path)
    assert sampling.stop_token_ids(LlamaForCausalLM.from_pretrained(path), tok) == sorted([tok.eos_token_id, eot])
    return str(path), tok


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _log(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _summary(folder):
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)


def test_sft_eval_loss_and_truncation_count_follow_the_training_rule(tmp_path, instruct_llama, monkeypatch):
    model, tok = instruct_llama
    rows = [{"messages": [{"role": "user", "content": f"POST: {w} TL;DR:"}, {"role": "assistant", "content": w}]}
            for w in WORDS]
    path = _write(tmp_path / "sft.jsonl", rows)
    # what training encodes: each completion ends with <|eot|>, no EOS after it
    pairs = data.sft_pairs(data.load_data(path), path)
    turns = [data.render_turns(tok, p, c) for p, c in pairs]
    stops = sampling.stop_token_ids(sft.common.load_model(model, sft.Args(model=model)), tok)
    lengths = data.encode_turns(tok, turns, None, stops)[1].sum(1)
    limit = int(lengths.median())  # some rows fit exactly, the longer ones are cut
    cut_by_training = int((lengths > limit).sum())
    out = str(tmp_path / "out")
    run_main(sft, ["--model", model, "--dataset", path, "--eval_dataset", path, "--batch_size", str(len(rows)),
                   "--eval_batch_size", "4", "--max_steps", "1", "--learning_rate", "1e-12",
                   "--max_completion_length", str(limit), "--output_dir", out], monkeypatch)
    log = _log(out)
    train_loss = next(r["loss"] for r in log if "loss" in r)
    eval_loss = next(r["eval_loss"] for r in log if "eval_loss" in r)
    assert eval_loss == pytest.approx(train_loss, rel=1e-5, abs=1e-5)  # before: +EOS after <|eot|> in eval only
    assert _summary(out)["completions_truncated"] == cut_by_training
    assert 0 < cut_by_training < len(rows)


def test_dpo_eval_margins_are_zero_at_step_one_and_truncation_counts_match(tmp_path, instruct_llama, monkeypatch):
    model, tok = instruct_llama
    rows = [{"prompt": [{"role": "user", "content": f"POST: {w} TL;DR:"}],
             "chosen": [{"role": "assistant", "content": w}],
             "rejected": [{"role": "assistant", "content": WORDS[(i + 1) % len(WORDS)]}]} for i, w in enumerate(WORDS)]
    path = _write(tmp_path / "prefs.jsonl", rows)
    triples = data.preference_triples(data.load_data(path), path)
    _, chosen, rejected = dpo.render_triples(tok, triples)
    stops = sampling.stop_token_ids(dpo.common.load_model(model, dpo.Args(model=model)), tok)
    lengths = data.encode_completions(tok, chosen + rejected, None, stops)[1].sum(1)
    limit = int(lengths.median())
    cut_by_training = int((lengths > limit).sum())
    for precompute in ("--precompute_ref_logps", "--no_precompute_ref_logps"):
        out = str(tmp_path / precompute)
        run_main(dpo, ["--model", model, "--dataset", path, "--eval_dataset", path, "--batch_size", "2",
                       "--eval_batch_size", "4", "--max_steps", "1", "--learning_rate", "1e-12", precompute,
                       "--max_completion_length", str(limit), "--output_dir", out], monkeypatch)
        summary = _summary(out)
        for key in ("eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins", "eval_rewards/accuracies"):
            assert summary[key] == 0.0, (precompute, key, summary[key])  # before: margins != 0
        assert summary["completions_truncated"] == cut_by_training
    assert 0 < cut_by_training < 2 * len(rows)
