"""Shared fixtures: tiny models and tokenizers built locally (nothing is downloaded)."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from worlds import world  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% if m['role'] == 'assistant' %}<eos> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# words outside the world that the tests' prompts for "any causal LM" use ("say 3", "write f that
# adds 1"): a pretrained tokenizer has them, and without them data.check_readable rightly stops
# those runs (most of their tokens would be single letters)
FOREIGN_WORDS = ["say", "write", "f", "adds"]


def chat_tokenizer():
    """The world's tokenizer with role tokens, a few words outside the world and CHAT_TEMPLATE: an
    instruct model's tokenizer in small."""
    from tokenizers import AddedToken

    tok = world.build_tokenizer()
    tok.add_tokens([AddedToken(" " + w, normalized=False) for w in FOREIGN_WORDS])
    tok.add_tokens(["<|system|>", "<|user|>", "<|assistant|>"], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def bos_tokenizer():
    """The chat tokenizer, adding <bos> in front of every encoded text, as Llama's and Gemma's do."""
    from tokenizers import processors

    tok = chat_tokenizer()
    tok.add_special_tokens({"bos_token": "<bos>"})
    bos = tok.convert_tokens_to_ids("<bos>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    assert tok("alice")["input_ids"][0] == bos and tok("alice", add_special_tokens=False)["input_ids"][0] != bos
    return tok, bos


def uniform_words_model(path):
    """A tiny Llama with the chat tokenizer that samples every token uniformly and stops with
    probability ~0.2 per token (so completions vary in length and many end with EOS); greedy
    decoding stops at once. Built from zeroed weights: the residual stream's dimension 0 is
    constant, the final norm keeps only it, and the head reads it into the EOS logit alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = chat_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.eos_token_id, 0] = 0.9  # EOS logit ~5, every other 0
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return tok


def run_script(*argv, timeout=600, check=True):
    """Run one of the project's scripts as a user would, in a subprocess."""
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}")
    return proc


def save_tiny(path, architecture, tok, **config):
    """Save a tiny model of a real architecture ("Llama", "Qwen2") with random weights (seed 0) and
    `tok` to `path`: the shared shape of the tests' foreign fixtures. `config`: the layer sizes."""
    import transformers

    config = getattr(transformers, f"{architecture}Config")(
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, **config)
    torch.manual_seed(0)
    getattr(transformers, f"{architecture}ForCausalLM")(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A local tiny LlamaForCausalLM folder whose tokenizer has a chat template."""
    return save_tiny(tmp_path_factory.mktemp("tiny_llama"), "Llama", chat_tokenizer(), hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=256)


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory):
    """A local tiny Qwen2 folder with the world tokenizer (random weights)."""
    path = tmp_path_factory.mktemp("tiny_qwen")
    tok = world.build_tokenizer()
    world.build_model(tok, hidden_size=64, num_layers=2).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture
def sft_data(tmp_path):
    """A small prompt+completion .jsonl whose completions differ in length (token-mean losses
    must still match across ranks and across a resume)."""
    path = tmp_path / "sft.jsonl"
    with open(path, "w") as f:
        for i in range(24):
            f.write(json.dumps({"prompt": f"POST: alice bought the bike {i % 7} . TL;DR:",
                                "completion": " alice bought bike ." + " now" * (i % 4)}) + "\n")
    return str(path)


class SavedBytes:
    """Bytes autograd saves for backward while it is active (torch.autograd.graph.saved_tensors_hooks).
    With `exclude` (a model's parameters) it counts the activations alone, as memory.activation_plan
    plans them: each storage once, and none of those parameters'."""

    def __init__(self, exclude=None):
        self.bytes = 0
        self._skip = None if exclude is None else {p.untyped_storage().data_ptr() for p in exclude}

    def __enter__(self):
        def pack(t):
            if self._skip is None:
                self.bytes += t.numel() * t.element_size()
            elif t.untyped_storage().data_ptr() not in self._skip:
                self._skip.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def trl_python():
    """The Python of .venv-bench, where TRL lives (bench/requirements.txt); skip the test without it."""
    path = os.path.join(ROOT, ".venv-bench", "bin", "python")
    if not os.path.exists(path):
        pytest.skip("TRL's virtualenv .venv-bench is absent (make it as bench/trl_quality.py says: "
                    "python -m venv --system-site-packages .venv-bench && .venv-bench/bin/pip install -r bench/requirements.txt)")
    return path


def run_main(module, argv, monkeypatch):
    """Run a script's main() in this process with this command line (cheaper than a subprocess)."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    monkeypatch.setenv("TQDM_DISABLE", "1")
    try:
        module.main()
    finally:  # as when a process exits: its <output_dir>/.lock is free again
        from rlhf import checkpoints

        if checkpoints._LOCK is not None:
            checkpoints._LOCK.close()


def main_error(module, argv, monkeypatch, capsys):
    """Run main() in this process and expect it to stop as the command line would: the message
    of its SystemExit (common.fail) or what argparse printed to stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(module, argv, monkeypatch)
    assert e.value.code not in (0, None), "the run did not fail"
    return f"{e.value}\n{capsys.readouterr().err}"


def eval_reward_files(folder, train_prompts=8, eval_prompts=5):
    """For --eval_reward_fn tests: train and eval prompt files (the eval rows carry a `bonus`
    column), and a rewards file with `length` (to train on: the completion's characters) and
    `longer` (to evaluate with: characters + bonus); both append every call (function, step,
    completions) to <folder>/calls.jsonl, so a test can recompute what was logged."""
    with open(os.path.join(folder, "prompts.jsonl"), "w") as f:
        for i in range(train_prompts):
            f.write(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:"}) + "\n")
    with open(os.path.join(folder, "eval.jsonl"), "w") as f:
        for i in range(eval_prompts):
            f.write(json.dumps({"prompt": f"POST: alice bought the bike {i} . TL;DR:", "bonus": 100 + 10 * i}) + "\n")
    with open(os.path.join(folder, "r.py"), "w") as f:
        f.write("import json, os\n"
                "LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'calls.jsonl')\n"
                "def record(fn, completions, trainer_state):\n"
                "    with open(LOG, 'a') as f:\n"
                "        f.write(json.dumps({'fn': fn, 'step': trainer_state.global_step, 'completions': completions}) + '\\n')\n"
                "def length(completions, trainer_state, **kw):\n"
                "    record('length', completions, trainer_state)\n"
                "    return [float(len(c)) for c in completions]\n"
                "def longer(completions, bonus, trainer_state, **kw):\n"
                "    record('longer', completions, trainer_state)\n"
                "    return [len(c) + b for c, b in zip(completions, bonus)]\n")
    return {k: os.path.join(folder, k) for k in ("prompts.jsonl", "eval.jsonl", "r.py", "calls.jsonl")}


def check_eval_reward_fn(module, argv, files, folder, monkeypatch, eval_steps=(2, 4), num_eval=5,
                         bonus=(100, 110, 120, 130, 140)):
    """Run the script's main() on `argv` (eval_reward_files' data, training on `length`) without and
    with --eval_reward_fn `longer`; then the second run's metrics against the first's and the
    recorded reward calls: eval_rewards/longer/mean at every eval step is the mean of
    len(completion) + bonus over the very completions the training reward `length` scored for
    eval_reward there (one greedy generation), and nothing else the run logs changes."""
    run_main(module, argv + ["--output_dir", os.path.join(folder, "plain")], monkeypatch)
    os.remove(files["calls.jsonl"])
    run_main(module, argv + ["--eval_reward_fn", f"{files['r.py']}:longer", "--output_dir", os.path.join(folder, "gold")],
             monkeypatch)
    with open(files["calls.jsonl"]) as f:
        calls = [json.loads(line) for line in f]
    rows, plain = ([json.loads(line) for line in open(os.path.join(folder, out, "metrics.jsonl"))] for out in ("gold", "plain"))
    eval_steps = list(eval_steps)
    evals = [r for r in rows if "eval_reward" in r]
    assert [r["step"] for r in evals] == eval_steps
    assert [c["step"] for c in calls if c["fn"] == "longer"] == eval_steps  # evaluation only, never in training
    for r in evals:
        (mine,) = [c["completions"] for c in calls if c["fn"] == "longer" and c["step"] == r["step"]]
        theirs = [c["completions"] for c in calls if c["fn"] == "length" and c["step"] == r["step"] and len(c["completions"]) == num_eval]
        assert len(mine) == num_eval and theirs[-1] == mine  # the same greedy completions
        assert r["eval_rewards/longer/mean"] == pytest.approx(sum(len(c) + b for c, b in zip(mine, bonus)) / num_eval, abs=1e-4)

    def rest(rows):  # everything but the new metric and clock readings (throughput.TIMED: times, tokens/s, MFU)
        from rlhf import throughput

        return [{k: v for k, v in r.items() if k != "eval_rewards/longer/mean" and "time" not in k and k not in throughput.TIMED}
                for r in rows]

    assert rest(rows) == rest(plain)
