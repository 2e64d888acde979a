"""What changes between the embedded world's tiny policy and a pretrained model: the defaults
(common.apply_defaults: TRL's values for a pretrained model, the tuned ones for the embedded
world, an explicit flag always wins) and the refusal of text the tokenizer cannot read.
`grpo.py --model <Qwen2.5-1.5B config> --estimate_memory` is run by tests/test_memory.py, which
checks its startup line."""

import sys

import pytest
from transformers import Qwen2Config

import common
from rlhf import data
import grpo
from worlds import world


@pytest.fixture
def qwen15_config(tmp_path):
    """A folder holding only the config.json of Qwen2.5-1.5B (no weights, no tokenizer)."""
    Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True).save_pretrained(tmp_path)
    return str(tmp_path)


def test_the_embedded_policy_keeps_its_tuned_defaults_and_flags_win(monkeypatch, tiny_qwen, qwen15_config):
    assert common.is_embedded_policy("") and common.is_embedded_policy(tiny_qwen)
    assert not common.is_embedded_policy(qwen15_config) and not common.is_embedded_policy("Qwen/Qwen2.5-1.5B")
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--model", tiny_qwen, "--temperature", "0.9"])
    args = common.apply_defaults(common.parse_args(grpo.Args), grpo.EMBEDDED_DEFAULTS)
    assert (args.learning_rate, args.max_completion_length, args.temperature) == (5e-5, 32, 0.9)
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--model", qwen15_config, "--learning_rate", "3e-6"])
    args = common.apply_defaults(common.parse_args(grpo.Args), grpo.EMBEDDED_DEFAULTS)
    assert (args.learning_rate, args.max_completion_length, args.temperature) == (3e-6, 256, 1.0)
    assert (args.batch_size, args.gradient_accumulation_steps) == (1, 1)  # one prompt x 8 completions a step, as TRL


def test_text_the_tokenizer_cannot_read_is_refused():
    tok = world.build_tokenizer()
    data.check_readable(tok, ["POST: alice bought the bike .\nTL;DR:"], "runs/sft", "embedded")  # its own words
    with pytest.raises(SystemExit, match="unknown or single letters to the tokenizer of runs/sft .*--model is probably missing"):
        data.check_readable(tok, ["What is 10 plus 4? ", "What is 3 plus 5? "], "runs/sft", "math.jsonl")


def test_optim_default_follows_the_device_and_lines_print_on_rank_0_only(monkeypatch, capsys, tmp_path):
    """--optim auto: torch AdamW on a CPU, the 8-bit one on CUDA (not under FSDP2) and for the embedded
    worlds' policies, said in one line;
    an explicit --optim wins; under torchrun only rank 0 prints the startup lines."""
    import torch

    def parse(*argv):
        monkeypatch.setattr(sys, "argv", ["grpo.py", "--output_dir", str(tmp_path / "o"), *argv])
        return common.apply_defaults(common.parse_args(grpo.Args), grpo.EMBEDDED_DEFAULTS)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capsys.readouterr()
    assert parse().optim == "adamw"
    assert "grpo: --optim adamw (torch AdamW: no CUDA, where 8-bit only costs time; pass --optim to choose)" in capsys.readouterr().out
    assert parse("--optim", "adamw_8bit").optim == "adamw_8bit" and "--optim" not in capsys.readouterr().out
    tiny = tmp_path / "tiny"  # an embedded world's policy keeps 8-bit on a CPU: its results were measured with it
    tiny.mkdir()
    (tiny / "config.json").write_text('{"from_scratch": true}')
    assert parse("--model", str(tiny)).optim == "adamw_8bit"
    assert "--optim adamw_8bit (8-bit AdamW: the embedded world's results were measured with it" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parse().optim == "adamw_8bit" and parse("--parallel", "fsdp2").optim == "adamw"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("RANK", "1")  # torchrun's second process, before the process group exists
    capsys.readouterr()
    assert parse().optim == "adamw" and capsys.readouterr().out == ""
