"""The from-scratch builder: tokenizers fitted to a dataset, saved folders that load exactly as
built (plain AutoTokenizer, as TRL, vLLM and lm-eval load them, and the project's loader), a saved model
that reloads with the same log-probs; and sft.py training one on the arithmetic world, which
eval.py then scores with the verifier (accuracy, pass@k)."""

import json

import pytest
import torch
from conftest import run_script
from transformers import AutoTokenizer

import common
from rlhf import data
from rlhf import sampling
from worlds import scratch
from worlds import world
from worlds import world_arith


@pytest.fixture(scope="module")
def arith():
    return world_arith.build_world(seed=0, levels=(1, 2), sizes={"sft": 300, "rl": 10, "test": 50})


def texts_of(ds):
    return [t for row in ds for t in (row["prompt"], row.get("completion") or row.get("reference"))]


def save(tmp_path, tokenizer, hidden_size=32):
    model = scratch.build_model(tokenizer, hidden_size=hidden_size, num_layers=1)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return model


def test_char_tokenizer_loads_exactly_through_auto_tokenizer(tmp_path, arith):
    tok = scratch.fit_tokenizer(texts_of(arith["sft"]), "char")
    assert len(tok) == 3 + 16  # <pad> <eos> <unk> + "0-9 +=:AQ" and the space
    save(tmp_path, tok)
    auto = AutoTokenizer.from_pretrained(tmp_path)  # transformers 5 picks Qwen2Tokenizer for a qwen2 folder
    ours = common.load_tokenizer(str(tmp_path))
    texts = texts_of(arith["test"]) + [arith["test"][0]["prompt"] + arith["test"][0]["reference"]]
    for t in (auto, ours):
        assert (t.eos_token_id, t.pad_token_id, len(t)) == (tok.eos_token_id, tok.pad_token_id, len(tok))
        assert [t(x)["input_ids"] for x in texts] == [tok(x)["input_ids"] for x in texts]
    ids = tok(texts[-1])["input_ids"]
    assert len(ids) == len(texts[-1])  # one token per character
    assert auto.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == texts[-1]
    # completions as the scripts encode and decode them
    c_ids, c_mask = data.encode_completions(auto, [arith["test"][0]["reference"]])
    assert sampling.decode_completions(auto, c_ids, c_mask, torch.tensor([False])) == [arith["test"][0]["reference"]]


def test_word_tokenizer_fitted_to_a_dataset(tmp_path):
    texts = ["POST: a cat sat . TL;DR:", " cat sat .", "Q: what ?", " nothing ."]
    tok = scratch.fit_tokenizer(texts, "word")
    assert tok.convert_ids_to_tokens(tok(" cat sat .")["input_ids"]) == ["Ġcat", "Ġsat", "Ġ."]  # a word: one token
    assert len(tok("POST: a cat")["input_ids"]) == 4  # POST : Ġa Ġcat
    assert len(tok(" dog")["input_ids"]) > 1  # an unseen word: smaller pieces, never <unk>
    save(tmp_path, tok)
    auto = AutoTokenizer.from_pretrained(tmp_path)  # Qwen2Tokenizer, rebuilt from vocab and merges
    ours = common.load_tokenizer(str(tmp_path))
    unseen = ["a dog ate 3 ünïcode bytes\n\nTL;DR:", "  two  spaces"]
    for t in (auto, ours):
        assert [t(x)["input_ids"] for x in texts + unseen] == [tok(x)["input_ids"] for x in texts + unseen]
        assert [t.decode(tok(x)["input_ids"]) for x in texts + unseen] == texts + unseen


def test_the_world_tokenizer_loads_exactly_through_auto_tokenizer(tmp_path):
    """The TL;DR world's runs/sft: AutoTokenizer (what TRL, vLLM and lm-eval call) encodes the
    world's text exactly as the scripts' loader does, one token per word."""
    tok = world.build_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    save(tmp_path, tok)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    ours = common.load_tokenizer(str(tmp_path))
    w = world.build_world()
    texts = [r["prompt"] + r["completion"] for r in w["sft"].select(range(200))]
    texts += [r["prompt"] + r["chosen"] for r in w["prefs"].select(range(100))]
    for t in (auto, ours):
        assert (t.eos_token_id, t.pad_token_id, len(t)) == (tok.eos_token_id, tok.pad_token_id, len(tok))
        assert [t(x)["input_ids"] for x in texts] == [tok(x)["input_ids"] for x in texts]
    assert all(len(tok(" " + v)["input_ids"]) == 1 for v in world.vocabulary() if v not in ("POST:", "TL;DR:"))
    completion = w["test"][0]["reference"]
    assert auto.decode(tok(completion)["input_ids"] + [tok.eos_token_id], skip_special_tokens=True) == completion


def test_saved_model_reloads_with_the_same_logprobs(tmp_path, arith):
    from transformers import AutoModelForCausalLM

    tok = scratch.fit_tokenizer(texts_of(arith["sft"]), "char")
    model = save(tmp_path, tok, hidden_size=64).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    auto = AutoTokenizer.from_pretrained(tmp_path)
    rows = arith["sft"].select(range(4))

    def logprobs(m, t):
        p_ids, p_mask = data.encode_prompts(t, rows["prompt"])
        c_ids, c_mask = data.encode_completions(t, rows["completion"])
        with torch.no_grad():
            return sampling.completion_logprobs(m, p_ids, p_mask, c_ids, c_mask)

    assert torch.equal(logprobs(model, tok), logprobs(reloaded, auto))


def test_sft_from_scratch_on_the_arithmetic_world_then_pass_at_k(tmp_path):
    out = tmp_path / "sft_arith"
    run_script("sft.py", "--dataset", "embedded:arith", "--hidden_size", "32", "--num_layers", "1", "--max_steps", "3",
               "--batch_size", "8", "--output_dir", str(out))
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    assert len(common.load_tokenizer(str(out))) == 19  # fitted to the characters of the world
    proc = run_script("eval.py", str(out), "--dataset", "embedded:arith", "--reward_fn", "arith_strict", "--num_prompts", "6",
                      "--num_samples", "4", "--pass_k", "1,4", "--group_by", "carry_trap", "--num_bootstrap", "50",
                      "--max_completion_length", "8", "--output_dir", str(tmp_path / "eval"),
                      "--cache_dir", str(tmp_path / "cache"))
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["settings"]["judge_name"] == "arith_strict" and results["settings"]["verifier"]
    p = results["policies"]["sft_arith"]
    assert set(p["pass_at_k"]) == {"pass@1", "pass@4"} and "mean_length" not in p
    assert results["reference"]["score"] == 1.0  # the references are right
    assert "# eval: judge arith_strict" in proc.stdout and "mean words" not in proc.stdout and "| pass@1 | pass@4 |" in proc.stdout
    cached = [json.loads(f.read_text()) for f in (tmp_path / "cache").glob("sft_arith-*.json")]
    assert sorted(len(c["responses"]) for c in cached) == [6, 24]  # greedy, then 4 samples per prompt


def test_tokens_the_training_text_never_contains_start_at_zero_and_move_as_one():
    """scratch.build_model(texts=...): the rows of tokens absent from the text (bytes) start at
    zero, so they share logits, gradients and Adam updates and stay one direction; the text's own
    rows keep their random init. (Random rows there made the TL;DR
    world's SFT policy copy facts wrongly: docs/worlds.md.)"""
    tok = world.build_tokenizer()
    texts = [r["prompt"] + r["completion"] for r in common.embedded_world()["sft"].select(range(200))]
    used = {i for t in texts for i in tok(t)["input_ids"]} | set(tok.all_special_ids)
    model = scratch.build_model(tok, hidden_size=32, num_layers=1, texts=texts)
    rows = model.get_input_embeddings().weight
    unused = sorted(set(range(len(tok))) - used)
    assert len(unused) > 250 and len(used) < 120  # the world's vocabulary: mostly bytes the text never holds
    assert rows[unused].abs().sum() == 0
    assert rows[sorted(used - {tok.pad_token_id})].abs().min(dim=1).values.gt(0).all()  # (pad's row: zero in any Qwen2)
    arith = [r["prompt"] + r["completion"] for r in world_arith.build_world(seed=0, sizes={"sft": 50, "rl": 1, "test": 1})["sft"]]
    char = scratch.fit_tokenizer(arith, "char")  # every token of a char-level one is in the text: nothing at zero
    assert torch.equal(scratch.build_model(char, hidden_size=32, num_layers=1, texts=arith).get_input_embeddings().weight,
                       scratch.build_model(char, hidden_size=32, num_layers=1).get_input_embeddings().weight)
    assert model.lm_head.weight is rows  # tied: the output rows are the same tensor
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ids = tok(texts[:4], return_tensors="pt", padding=True)["input_ids"]
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    moved = rows[unused].detach()
    assert moved.abs().sum() > 0 and torch.equal(moved, moved[:1].expand_as(moved))  # moved, as one row
    assert not torch.equal(scratch.build_model(tok, hidden_size=32, num_layers=1).get_input_embeddings().weight[unused],
                           torch.zeros(len(unused), 32))  # without texts: the usual random init
