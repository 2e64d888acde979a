"""--use_vllm (vllm_rollouts.py) against the project's own sampler and trainer, on vLLM's CPU build.

The tests that start an engine run only where vLLM imports: `make vllm-env`, then
`.venv-vllm/bin/python -m pytest tests/test_vllm.py` (.ci/run does this after `make test`).
Elsewhere they are skipped with that reason; the formula tests run everywhere.
Fixtures have head_dim 32: vLLM's CPU attention refuses 16.
"""

import importlib.util
import json
import os
import types

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU build (default 4)

from rlhf import data  # noqa: E402
import grpo  # noqa: E402
from rlhf import sampling  # noqa: E402
from rlhf import throughput  # noqa: E402
from rlhf import vllm_rollouts  # noqa: E402
from conftest import chat_tokenizer, run_main, save_tiny  # noqa: E402

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed here: `make vllm-env`, then .venv-vllm/bin/python -m pytest tests/test_vllm.py")

PROMPTS = ["POST: alice bought the bike . TL;DR:", "POST: bob sold a red car to carol yesterday . TL;DR:",
           "POST: dan lost his keys . TL;DR:"]


@pytest.fixture(scope="module")
def llama32(tmp_path_factory):
    """A tiny Llama (GQA, untied head) with head_dim 32."""
    return save_tiny(tmp_path_factory.mktemp("llama32"), "Llama", chat_tokenizer(), hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     max_position_embeddings=256)


def _args(**kw):
    return types.SimpleNamespace(**{"vllm_dtype": "float32", "vllm_gpu_memory_utilization": 0.3, "seed": 0, **kw})


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def _rollout(llm, model, tok, n=3, tokens=12, **knobs):
    ids, mask = data.encode_prompts(tok, PROMPTS)
    out = vllm_rollouts.generate(llm, model, tok, ids, mask, tokens, num_return_sequences=n, seed=7, **knobs)
    return (ids, mask, *out)


def _gap(llm, model, tok):
    """max |vLLM log-prob - trainer log-prob| over the sampled tokens of one rollout."""
    ids, mask, completion, completion_mask, truncated, vllm_logprobs = _rollout(llm, model, tok)
    with torch.no_grad():
        logprobs = sampling.completion_logprobs(model, ids, mask, completion, completion_mask)
    assert completion_mask.sum() > len(PROMPTS)  # something was sampled
    return float(((logprobs - vllm_logprobs) * completion_mask).abs().max())


@needs_vllm
@pytest.mark.parametrize("fixture", ["llama32", "tiny_qwen"])
def test_fp32_logprobs_equal_the_policy_at_step_0_after_3_steps_and_with_lora(fixture, request):
    """In fp32 the engine's log-probs of its own samples are the trainer's to 1e-5: at the start,
    after 3 optimizer steps whose weights reach it through sync_weights, and for a LoRA policy
    whose merged weights it receives."""
    from rlhf import lora

    model, tok = _load(request.getfixturevalue(fixture))
    llm = vllm_rollouts.start_engine(model, tok, _args(), max_model_len=128)
    try:
        assert _gap(llm, model, tok) < 1e-5
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(3):  # any loss moves every weight
            ids, mask, completion, completion_mask, _, _ = _rollout(llm, model, tok)
            loss = -sampling.completion_logprobs(model, ids, mask, completion, completion_mask).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            assert vllm_rollouts.sync_weights(llm, model) >= 0
        assert _gap(llm, model, tok) < 1e-5

        peft_model = lora.add_adapters(model, types.SimpleNamespace(
            lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all-linear"))
        with torch.no_grad():  # B = 0 at the start: give the adapters a non-zero delta
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        vllm_rollouts.sync_weights(llm, peft_model)
        assert _gap(llm, peft_model, tok) < 1e-5
    finally:
        vllm_rollouts.shutdown(llm)


KNOBS = [{"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.8}, {"min_p": 0.2}, {"repetition_penalty": 1.5},
         {"temperature": 0.8, "top_k": 8, "top_p": 0.9, "repetition_penalty": 1.2}]


@needs_vllm
def test_each_sampling_knob_gives_the_project_samplers_distribution(tiny_qwen):
    """For every knob, the log-prob vLLM reports for each token it sampled (its processed
    distribution: after penalty, temperature and filters) equals the log-prob of that token under
    sampling.processed_logits, the distribution the project's sampler draws from."""
    model, tok = _load(tiny_qwen)
    llm = vllm_rollouts.start_engine(model, tok, _args(), max_model_len=128)
    try:
        for knobs in KNOBS:
            ids, mask, completion, completion_mask, _, vllm_logprobs = _rollout(llm, model, tok, n=4, **knobs)
            k = completion.shape[0] // ids.shape[0]
            full = torch.cat([ids.repeat_interleave(k, 0), completion], 1)  # (B*k, P+C)
            full_mask = torch.cat([mask.repeat_interleave(k, 0), completion_mask], 1)
            with torch.no_grad():
                logits = model(input_ids=full, attention_mask=full_mask,
                               position_ids=sampling.position_ids(full_mask)).logits.float()
            P, worst = ids.shape[1], 0.0
            for t in range(completion.shape[1]):
                rows = completion_mask[:, t].bool()
                if not rows.any():
                    break
                seen = None
                if knobs.get("repetition_penalty", 1.0) != 1.0:  # tokens of the prompt and the completion so far
                    seen = torch.zeros(logits.shape[0], logits.shape[-1]).scatter_add_(
                        1, full[:, :P + t], full_mask[:, :P + t].float()) > 0
                processed = sampling.processed_logits(logits[:, P + t - 1], knobs.get("temperature", 1.0),
                                                      knobs.get("top_p", 1.0), knobs.get("top_k", 0),
                                                      knobs.get("min_p", 0.0), knobs.get("repetition_penalty", 1.0), seen)
                ours = torch.log_softmax(processed, -1).gather(1, completion[:, t:t + 1]).squeeze(1)
                worst = max(worst, float((ours - vllm_logprobs[:, t])[rows].abs().max()))
            assert worst < 1e-4, (knobs, worst)
    finally:
        vllm_rollouts.shutdown(llm)


@needs_vllm
def test_seeded_samples_of_long_prompts_come_back_on_a_cpu(tiny_qwen):
    """vLLM's CPU build raises ("CPU Generator does not use offset") when it discards the token sampled
    for a seeded request whose prompt was prefilled in chunks; start_engine prefills whole prompts on
    a CPU, so 64 seeded samples of 8 prompts of 80-110 tokens (over 5,000 prompt tokens, more than the
    CPU build's default 4,096 a step) all come back, the same on a second call with the same seed."""
    model, tok = _load(tiny_qwen)
    llm = vllm_rollouts.start_engine(model, tok, _args(), max_model_len=128)
    try:
        prompts = [" ".join(f"{w} {i}" for w in ["alpha", "beta", "gamma", "delta"] * 3) for i in range(8)]
        ids, mask = data.encode_prompts(tok, prompts)
        assert 80 <= ids.shape[1] <= 110 and ids.numel() * 8 > 4096, ids.shape
        first = vllm_rollouts.generate(llm, model, tok, ids, mask, 8, num_return_sequences=8, seed=5, temperature=1.0)
        again = vllm_rollouts.generate(llm, model, tok, ids, mask, 8, num_return_sequences=8, seed=5, temperature=1.0)
        assert first[0].shape[0] == 64 and first[1].sum() > 64
        assert torch.equal(first[0], again[0])
    finally:
        vllm_rollouts.shutdown(llm)


def _trl_weights(old, sampled, mask, mode, cap):
    """TRL's vLLM importance-sampling correction (GRPOTrainer, 1.x), transcribed from its
    definition: rho = exp(old - sampled) per token (masked), or exp of its sum per sequence;
    *_truncate caps rho at cap, *_mask zeroes it above cap."""
    diff = (old - sampled) * mask
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(-1, keepdim=True)
    rho = diff.exp()
    if mode in ("sequence_truncate", "token_truncate"):
        return rho.clamp(max=cap)
    return torch.where(rho > cap, torch.zeros_like(rho), rho)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_sampling_weights_equal_trls(mode):
    torch.manual_seed(0)
    old, sampled = -torch.rand(6, 9) * 3, -torch.rand(6, 9) * 3
    mask = (torch.rand(6, 9) > 0.2).long()
    got = grpo.importance_sampling_weights(old, sampled, mask, mode, 3.0)
    assert torch.equal(got, _trl_weights(old, sampled, mask, mode, 3.0))
    assert got.max() <= 3.0 and (got > 0).any()


def test_is_weights_multiply_the_policy_loss_before_the_kl():
    """grpo_loss with weights w: the surrogate term of every token is scaled by w, the KL term is not."""
    torch.manual_seed(0)
    args = types.SimpleNamespace(epsilon=0.2, epsilon_high=0.0, dual_clip_c=3.0, beta=0.1, loss_type="dapo",
                                 importance_sampling_level="token", max_completion_length=5)
    logprobs, ref = -torch.rand(4, 5), -torch.rand(4, 5)
    adv, mask = torch.randn(4), torch.ones(4, 5)
    w = torch.rand(4, 5) * 2
    loss, _ = grpo.grpo_loss(logprobs, logprobs, ref, adv, mask, args, is_weights=w)
    kl = torch.exp(ref - logprobs) - (ref - logprobs) - 1
    expected = (-(adv[:, None] * w) + 0.1 * kl).sum() / mask.sum()  # ratio 1: the surrogate is A
    assert torch.allclose(loss, expected)


def test_use_vllm_without_vllm_says_how_to_install():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(SystemExit, match="make vllm-env"):
        vllm_rollouts.check_args(types.SimpleNamespace(min_p=0.0, top_p=1.0))


def test_min_p_with_top_p_is_refused():
    """vLLM applies min-p before top-p, the project after: the two cannot both be mapped."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here (check_args stops earlier, at the install)")
    with pytest.raises(SystemExit, match="min-p before top-p"):
        vllm_rollouts.check_args(types.SimpleNamespace(min_p=0.1, top_p=0.9))


@needs_vllm
def test_grpo_use_vllm_end_to_end_with_a_bf16_engine(tiny_qwen, tmp_path, monkeypatch):
    """grpo.py --use_vllm through main(): a bf16 engine beside the fp32 trainer gives a non-zero
    logged sampler-trainer gap, and the truncated correction keeps every weight <= the cap."""
    out = tmp_path / "grpo"
    run_main(grpo, ["--model", tiny_qwen, "--use_vllm", "--vllm_dtype", "bfloat16", "--max_steps", "3",
                    "--num_generations", "4", "--max_completion_length", "8", "--batch_size", "2",
                    "--learning_rate", "1e-3", "--optim", "adamw", "--num_iterations", "1",
                    "--vllm_importance_sampling_mode", "token_truncate", "--vllm_importance_sampling_cap", "1.01",
                    "--output_dir", str(out)], monkeypatch)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if "sampling/sampling_logp_difference/mean" in r]
    assert len(train) == 3
    for r in train:
        assert r["sampling/sampling_logp_difference/mean"] > 1e-4  # bf16 vs fp32: the gap is there
        assert r["sampling/sampling_logp_difference/max"] >= r["sampling/sampling_logp_difference/mean"]
        assert r["sampling/importance_sampling_ratio/max"] <= 1.01 + 1e-6  # and the correction bounds it
        assert r["sampling/kl"] >= 0 and r["vllm/sync_seconds"] >= 0
    assert (out / "summary.json").exists()


@needs_vllm
def test_dpo_online_use_vllm_end_to_end(tiny_qwen, tmp_path, monkeypatch):
    """dpo.py --online --use_vllm through main(): pairs sampled by the engine, weights synced every step."""
    import dpo

    out = tmp_path / "dpo"
    run_main(dpo, ["--model", tiny_qwen, "--online", "--use_vllm", "--max_steps", "2", "--batch_size", "4",
                   "--max_new_tokens", "8", "--optim", "adamw", "--output_dir", str(out)], monkeypatch)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 2 and all(r["vllm/sync_seconds"] >= 0 for r in rows)


@needs_vllm
def test_ppo_use_vllm_end_to_end(tiny_qwen, tmp_path, monkeypatch):
    """ppo.py --use_vllm through main(): at every step the fp32 engine's log-probs of its samples
    equal the trainer's pi_old to 1e-5 (the weights of the last optimizer step were synced in),
    logged under TRL's names; the policy did move away from the reference."""
    import ppo

    out = tmp_path / "ppo"
    run_main(ppo, ["--model", tiny_qwen, "--reward_fn", "gold", "--use_vllm", "--vllm_dtype", "float32",
                   "--max_steps", "3", "--batch_size", "4", "--max_completion_length", "8", "--optim", "adamw",
                   "--learning_rate", "1e-3", "--output_dir", str(out)], monkeypatch)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["sampling/sampling_logp_difference/max"] <= 1e-5 and r["sampling/kl"] <= 1e-6
        assert r["vllm/sync_seconds"] >= 0
    # the policy moved (kl is the sampled k1 estimate, which can be negative): an engine left at step 0
    # would fail the 1e-5 above
    assert abs(rows[-1]["kl"]) > 1e-3
    assert (out / "summary.json").exists()


@needs_vllm
def test_eval_use_vllm_greedy_responses_equal_the_projects(tiny_qwen, tmp_path, monkeypatch):
    """eval.py --use_vllm: an fp32 engine's greedy responses are the project sampler's, word for
    word, on a policy whose greedy output varies from prompt to prompt."""
    import eval as eval_script

    model, tok = _load(tiny_qwen)
    torch.manual_seed(0)
    with torch.no_grad():  # large random weights: peaked, varied next-token distributions
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.5)
    sharp = str(tmp_path / "sharp")
    model.save_pretrained(sharp)
    tok.save_pretrained(sharp)
    out = {}
    for name, flags in (("project", []), ("vllm", ["--use_vllm", "--vllm_dtype", "float32"])):
        run_main(eval_script, [f"a={sharp}", "--num_prompts", "24", "--max_completion_length", "12",
                               "--output_dir", str(tmp_path / name), *flags], monkeypatch)
        out[name] = [json.loads(line)["responses"]["a"] for line in open(tmp_path / name / "generations.jsonl")]
    assert len(out["vllm"]) == 24 and len(set(out["vllm"])) > 12  # varied, not one repeated string
    assert out["vllm"] == out["project"]


def test_sleep_mode_is_refused_where_the_platform_has_none():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here (check_args stops earlier, at the install)")
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        pytest.skip(f"{current_platform.device_name} has vLLM's sleep mode")
    with pytest.raises(SystemExit, match="no sleep mode on this platform"):
        vllm_rollouts.check_args(types.SimpleNamespace(min_p=0.0, top_p=1.0, vllm_enable_sleep_mode=True))


@needs_vllm
def test_two_gloo_ranks_with_fsdp2_match_the_trainer_and_resume_exactly(tiny_qwen, tmp_path):
    """grpo.py --use_vllm under torchrun, 2 gloo ranks, the policy sharded with FSDP2 (gathered for
    the engine every step): every rank's fp32 engine matches the trainer to 1e-5 after each
    optimizer step, and a run resumed from checkpoint-1 samples and trains exactly as the
    uninterrupted one (the rewards' weights included: they once took the IS weights' name)."""
    from safetensors.torch import load_file
    from test_distributed import _finish, _launch, _metrics

    argv = ["grpo.py", "--model", tiny_qwen, "--use_vllm", "--vllm_dtype", "float32", "--max_steps", "3",
            "--num_generations", "4", "--max_completion_length", "8", "--learning_rate", "1e-3", "--optim", "adamw",
            "--batch_size", "2", "--save_steps", "1", "--eval_batch_size", "200", "--parallel", "fsdp2"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    assert _finish(_launch(argv + ["--output_dir", full], nproc=2, env=env)).count("grpo: ") >= 1
    rows = [r for r in _metrics(full) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sampling/sampling_logp_difference/max"] <= 1e-5 for r in rows)
    assert rows[-1]["kl"] > 0  # the policy moved, and the engines followed it
    out = _finish(_launch(argv + ["--output_dir", resumed, "--resume_from_checkpoint", f"{full}/checkpoint-1"],
                          nproc=2, env=env))
    assert "at step 1" in out
    drop = (*throughput.TIMED, "num_tokens", "vllm/sync_seconds")
    assert [{k: v for k, v in r.items() if k not in drop} for r in _metrics(resumed)] == \
           [{k: v for k, v in r.items() if k not in drop} for r in _metrics(full)[1:]]
    wa, wb = load_file(f"{full}/model.safetensors"), load_file(f"{resumed}/model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # summary.json is rank 0's, its counts summed over both ranks (16 completions a step): the engine's
    # shutdown destroys the process group, so it comes after (once both ranks wrote, one failing)
    for folder, steps in ((full, rows), (resumed, [r for r in _metrics(resumed) if "loss" in r])):
        with open(f"{folder}/summary.json") as f:
            total = json.load(f)["completions_truncated"]
        assert total == round(sum(r["completions/clipped_ratio"] for r in steps) * 16) > 0
