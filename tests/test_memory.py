"""The memory plan (--estimate_memory) against measurements: static components (weights,
gradients, optimizer states) within 5% on tiny models for both optimizers and both dtypes, the
activation formula against the tensors autograd actually saves, and the command line of every
training script on a config-only Qwen2.5-1.5B folder."""

import json
import os
import re
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config

import common
from rlhf import memory
from rlhf import sampling
import sft
from conftest import ROOT, SavedBytes

STATIC = ("policy weights", "gradients", "optimizer states")


@pytest.mark.parametrize("optim", ["adamw_8bit", "adamw"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_static_plan_matches_measured(tiny_qwen, tmp_path, optim, dtype):
    args = sft.Args(model=tiny_qwen, optim=optim, dtype=dtype, attn_implementation="sdpa",
                    learning_rate=1e-3, output_dir=str(tmp_path))
    plan = {name: n for name, n, _ in memory.estimate_memory(args, train_sequences=2, prompt_length=6, completion_length=6)}
    model = common.load_model(tiny_qwen, args)
    assert any(p.numel() >= 4096 for p in model.parameters())  # 8-bit states really engage
    assert any(p.numel() < 4096 for p in model.parameters())  # and so do the small fp32 ones
    optimizer = common.make_optimizer(model, args)
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    for _ in range(2):  # first call: optimizer states do not exist yet, so nothing is final
        model(input_ids=ids, labels=ids).loss.backward()
        memory.log_memory(args.output_dir, model, optimizer)
        common.optimizer_step(optimizer, 1.0)
    with open(tmp_path / "memory.json") as f:
        measured = json.load(f)
    assert measured["complete"] and measured["peak_bytes"] > 0
    for name in STATIC:
        got, want = measured["components"][name], plan[name]
        assert abs(got - want) <= 0.05 * want, f"{name}: measured {got} bytes, planned {want}"


def test_activation_plan_matches_saved_tensors():
    """Count the bytes autograd saves for backward (not the weights) in a Qwen2 forward."""
    from transformers import Qwen2ForCausalLM

    for dtype in (torch.float32, torch.bfloat16):
        config = Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=320, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        config._attn_implementation = "sdpa"
        model = Qwen2ForCausalLM(config).to(dtype).train()
        ids = torch.randint(0, 300, (3, 40))
        with SavedBytes(exclude=model.parameters()) as s:
            sampling.backbone(model)(input_ids=ids, use_cache=False)
        saved = s.bytes
        plan = memory.activation_plan(config, ids.numel(), dtype.itemsize, checkpointing=False)
        assert abs(saved - plan) <= 0.05 * plan, (dtype, saved, plan)


@pytest.fixture(scope="module")
def qwen15_config(tmp_path_factory):
    """A folder holding only the config.json of Qwen2.5-1.5B (no weights, no tokenizer)."""
    path = tmp_path_factory.mktemp("qwen2.5-1.5b-config")
    Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                max_position_embeddings=32768).save_pretrained(path)
    assert os.listdir(path) == ["config.json"]
    return str(path)


def test_estimate_memory_command_line(qwen15_config, monkeypatch, capsys):
    import importlib

    from conftest import run_main

    scripts = ["sft", "dpo", "grpo", "ppo"]
    flags = ["--model", qwen15_config, "--dtype", "bfloat16", "--batch_size", "2", "--estimate_memory"]
    extra = {"ppo": ["--reward_model", qwen15_config]}  # a policy-shaped reward model (and critic)
    procs = {}
    for s in scripts:  # in this process: the plan loads no weights and exits 0
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            run_main(importlib.import_module(s), [*flags, *extra.get(s, [])], monkeypatch)
        assert e.value.code == 0
        procs[s] = SimpleNamespace(stdout=capsys.readouterr().out)
    tables = {}
    for script, proc in procs.items():
        lines = proc.stdout.strip().splitlines()
        assert lines[-1].startswith("total"), proc.stdout
        rows = [re.match(r"(.+?)\s{2,}(\d+\.\d+)\s+\d+\.\d+", line) for line in lines]
        tables[script] = {m.group(1): float(m.group(2)) for m in rows if m}
    # 1.544B parameters: 2.88 GB of bf16 weights, as many of gradients, ~2.9 GB of 8-bit states
    assert tables["sft"]["policy weights"] == pytest.approx(2.875, abs=0.01)
    assert tables["dpo"]["reference model"] == 0  # log-probs precomputed by default
    assert tables["grpo"]["reference model"] == pytest.approx(2.875, abs=0.01)  # beta 0.04
    assert tables["ppo"]["critic weights"] > 2.8 and tables["ppo"]["reward model"] > 2.8
    # a model that is not the embedded world's gets the pretrained (TRL) defaults; --batch_size 2 was passed
    assert "grpo: defaults for a pretrained model: learning_rate 1e-06, temperature 1, max_completion_length 256, " \
           "batch_size 2, gradient_accumulation_steps 1" in procs["grpo"].stdout
    assert "2 x 512 + 16 x 256 tokens" in procs["grpo"].stdout  # each prompt once, its 8 completions after it
    assert not os.path.exists(os.path.join(qwen15_config, "model.safetensors"))


def test_estimate_memory_with_dtype_auto_plans_for_the_gpu(qwen15_config, monkeypatch, capsys):
    """--dtype auto (the default) plans in bf16, what it loads on the GPU the plan is for, even on a
    machine without one (it planned fp32 there: twice the weights), and says so."""
    from conftest import run_main

    out = {}
    for dtype in ([], ["--dtype", "bfloat16"]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            run_main(sft, ["--model", qwen15_config, "--batch_size", "2", "--estimate_memory", *dtype], monkeypatch)
        assert e.value.code == 0
        out[bool(dtype)] = capsys.readouterr().out
    table = lambda text: [line for line in text.splitlines() if not line.startswith("--dtype auto")]
    assert table(out[False]) == table(out[True]) and "torch.bfloat16" in out[False]
    if not torch.cuda.is_available():
        assert "--dtype auto planned in bf16" in out[False] and "pass --dtype float32" in out[False]


def test_log_memory_splits_one_optimizer_by_module(tmp_path):
    """ppo.py's single optimizer over actor and critic: each model's states are measured apart."""

    actor, critic = torch.nn.Linear(64, 128), torch.nn.Linear(64, 1)
    both = torch.nn.ModuleDict({"actor": actor, "critic": critic})
    optimizer = common.make_optimizer(both, SimpleNamespace(learning_rate=1e-3, weight_decay=0.0, optim="adamw"))
    frozen = {"reward model": None, "frozen": [torch.nn.Linear(4, 4)]}
    memory.log_memory(str(tmp_path), actor, optimizer, critic, frozen)  # before the first step: no states yet, not final
    assert not json.load(open(tmp_path / "memory.json"))["complete"]
    (actor(torch.randn(2, 64)).sum() + critic(torch.randn(2, 64)).sum()).backward()
    common.optimizer_step(optimizer)
    memory.log_memory(str(tmp_path), actor, optimizer, critic, frozen)
    measured = json.load(open(tmp_path / "memory.json"))["components"]
    assert measured["optimizer states"] == 2 * 4 * (64 * 128 + 128) + 2 * 4  # two fp32 moments + steps
    assert measured["critic optimizer states"] == 2 * 4 * (64 + 1) + 2 * 4
    assert "reward model" not in measured and measured["frozen"] == 4 * (16 + 4)  # an absent model has no row


def test_a_fork_plans_and_trains_under_its_own_name(tmp_path, tiny_qwen):
    """cp grpo.py gspo.py: --estimate_memory plans what the fork holds (no shared code knows its
    name), and two training steps go to runs/gspo, the folder named after the file."""
    import shutil
    import subprocess
    import sys

    fork = tmp_path / "gspo.py"
    shutil.copy(os.path.join(ROOT, "grpo.py"), fork)
    env = {**os.environ, "PYTHONPATH": ROOT, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}

    def run(*flags):
        proc = subprocess.run([sys.executable, str(fork), "--model", tiny_qwen, *flags], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    plan = run("--estimate_memory", "--beta", "0")
    assert "gspo.py memory plan" in plan and "none: --beta 0" in plan and plan.strip().splitlines()[-1].startswith("total")
    assert not os.path.exists(tmp_path / "runs")  # the plan loads nothing and writes nothing
    run("--max_steps", "2", "--batch_size", "2", "--num_generations", "2", "--max_completion_length", "8",
        "--eval_batch_size", "200")
    out = tmp_path / "runs" / "gspo"
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
    assert os.path.exists(out / "summary.json") and os.path.exists(out / "model.safetensors")


def test_estimate_memory_with_use_vllm_shows_the_engine(qwen15_config, monkeypatch, capsys):
    """--use_vllm: the engine gets its row (its weights + one rollout's KV cache here, without a
    GPU; the share of the GPU on one), and the project's own sampler no longer counts. The plan
    needs no vLLM (it exits before the engine is imported)."""
    import grpo
    from conftest import run_main

    def plan(*flags):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            run_main(grpo, ["--model", qwen15_config, "--dtype", "bfloat16", "--batch_size", "2",
                            "--max_completion_length", "4096", "--gradient_checkpointing", "--estimate_memory", *flags],
                     monkeypatch)
        assert e.value.code == 0
        out = capsys.readouterr().out
        return out, {m.group(1): float(m.group(2)) for m in
                     (re.match(r"(.+?)\s{2,}(\d+\.\d+)\s+\d+\.\d+", line) for line in out.splitlines()) if m}

    plain, rows = plan()
    engine, vrows = plan("--use_vllm", "--vllm_dtype", "float32")
    assert "vLLM engine" not in rows and "vLLM engine" in vrows
    # fp32 engine: 1.544B x 4 bytes = 5.75 GB, plus 16 x 4608 tokens x 28 layers x 2 x 256 x 4 bytes of cache
    kv = 2 * 28 * 256 * 4 * 16 * (512 + 4096) / 2**30
    if not torch.cuda.is_available():
        assert vrows["vLLM engine"] == pytest.approx(5.75 + kv, abs=0.02)
        assert "--vllm_gpu_memory_utilization 0.3" in engine
    assert vrows["activations"] <= rows["activations"] and "generation: KV cache" not in engine  # the engine's now
    assert {k: v for k, v in vrows.items() if k not in ("vLLM engine", "activations", "total")} == \
           {k: v for k, v in rows.items() if k not in ("activations", "total")}


def test_estimate_memory_with_optim_auto_plans_the_gpus_8bit_adamw(qwen15_config, monkeypatch, capsys):
    """--optim auto resolves to torch AdamW on a CPU, but the plan is for the GPU: 8-bit states, said."""
    from conftest import run_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = {}
    for optim in ([], ["--optim", "adamw"]):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            run_main(sft, ["--model", qwen15_config, "--batch_size", "2", "--estimate_memory", *optim], monkeypatch)
        out[bool(optim)] = capsys.readouterr().out
    assert "--optim adamw_8bit" in out[False] and "--optim auto planned 8-bit AdamW" in out[False]
    assert "--optim adamw," in out[True] and "--optim auto planned" not in out[True]


def test_a_script_started_by_a_large_process_reports_its_own_peak():
    """getrusage's ru_maxrss survives exec: a script started by a 1.5 GiB process (a test worker, a
    notebook) reported that size as its own peak, and an fp32 plan on a CPU counted it too."""
    import subprocess
    import sys

    big = bytearray(3 * 2**29)  # 1.5 GiB, touched so it is resident
    for i in range(0, len(big), 4096):
        big[i] = 1
    code = "import sys; sys.path.insert(0, '.'); from rlhf import memory; print(memory.peak_memory_bytes())"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    peak = int(subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout)
    assert peak < 2**30, peak / 2**30
