"""ppo.py: GAE and the dual-clip loss against direct transcriptions of their formulas, the
ratio == 1 invariant of the first update, and the script end to end at tiny size."""

import json
import os

import pytest
import torch
from conftest import run_script

import common
from rlhf import data
import ppo
from rlhf import sampling


def random_mask(B, C, gen):
    lengths = torch.randint(1, C + 1, (B,), generator=gen)
    return (torch.arange(C)[None] < lengths[:, None]).float()  # right padding, >= 1 real token


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_vectorised_gae_matches_a_python_loop(gamma, lam):
    gen = torch.Generator().manual_seed(0)
    B, C = 5, 9
    rewards, values = torch.randn(B, C, generator=gen), torch.randn(B, C, generator=gen)
    mask = random_mask(B, C, gen)
    rewards = rewards * mask
    advantages, returns = ppo.gae(rewards, values, mask, gamma, lam)
    for b in range(B):
        T = int(mask[b].sum())
        last = 0.0
        for t in reversed(range(T)):  # Schulman et al. 2016, Eq. 16, one token at a time
            next_value = values[b, t + 1].item() if t + 1 < T else 0.0
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            last = delta + gamma * lam * last
            assert advantages[b, t].item() == pytest.approx(last, abs=1e-5)
            assert returns[b, t].item() == pytest.approx(last + values[b, t].item(), abs=1e-5)
        assert (advantages[b, T:] == 0).all()


def dual_clip_transcription(ratio, A, eps, c):
    """The design document's L_DualClip, token by token: -E_t[max(min(r A, clip(r) A), c A)],
    with the max applied only where A < 0 (Ye et al. 2020)."""
    per_token = []
    for r, a in zip(ratio.tolist(), A.tolist()):
        surrogate = min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
        per_token.append(max(surrogate, c * a) if a < 0 else surrogate)
    return -sum(per_token) / len(per_token)


@pytest.mark.parametrize("c", [3.0, 1.5])
def test_dual_clip_loss_matches_the_formula(c):
    gen = torch.Generator().manual_seed(1)
    B, C = 6, 7
    old_logprobs = -torch.rand(B, C, generator=gen) * 3
    logprobs = old_logprobs + torch.randn(B, C, generator=gen) * 1.5  # ratios from ~0.01 to ~90
    advantages = torch.randn(B, C, generator=gen) * 2
    mask = random_mask(B, C, gen)
    loss, stats = ppo.policy_loss(logprobs, old_logprobs, advantages, mask, 0.2, c)
    keep = mask.bool()
    ratio = torch.exp(logprobs - old_logprobs)[keep]
    assert loss.item() == pytest.approx(dual_clip_transcription(ratio, advantages[keep], 0.2, c), rel=1e-5)
    binds = (advantages[keep] < 0) & (ratio * advantages[keep] < c * advantages[keep])  # r > c: the dual clip binds
    assert binds.any() and stats["dual_clip_frac"].item() == pytest.approx(binds.float().mean().item())
    # where it binds the token's loss is the constant -c*A: no gradient reaches its log-prob
    lp = logprobs.clone().requires_grad_()
    ppo.policy_loss(lp, old_logprobs, advantages, mask, 0.2, c)[0].backward()
    assert (lp.grad[keep][binds] == 0).all() and (lp.grad[keep][~binds & (ratio > 0.8) & (ratio < 1.2)] != 0).all()
    # without the dual clip, the plain clipped surrogate (Schulman et al. 2017, Eq. 7)
    plain, _ = ppo.policy_loss(logprobs, old_logprobs, advantages, mask, 0.2, 0.0)
    assert plain.item() == pytest.approx(dual_clip_transcription(ratio, advantages[keep], 0.2, 1e9), rel=1e-5)


def test_value_loss_matches_the_formula():
    gen = torch.Generator().manual_seed(2)
    values, old_values, returns = (torch.randn(4, 5, generator=gen) for _ in range(3))
    mask = random_mask(4, 5, gen)
    loss, stats = ppo.value_loss(values, old_values, returns, mask, 0.2)
    clipped = old_values + (values - old_values).clamp(-0.2, 0.2)
    expected = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)[mask.bool()].mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6) and 0 < stats["vf_clipfrac"] < 1


def test_kl_penalty_and_score_placement():
    logprobs, ref = torch.tensor([[-1.0, -2.0, -0.5, 0.0]]), torch.tensor([[-1.5, -1.0, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    rewards, kl, non_score = ppo.per_token_rewards(torch.tensor([2.0]), logprobs, ref, mask, kl_coef=0.1)
    assert torch.allclose(kl, torch.tensor([[0.5, -1.0, 0.0, 0.0]]))
    assert torch.allclose(rewards, torch.tensor([[-0.05, 0.1, 2.0, 0.0]]))  # the score sits on the last real token


def test_first_minibatch_has_ratio_one(tiny_qwen):
    from transformers import AutoModelForSequenceClassification

    class A:
        dtype, attn_implementation, trust_remote_code = "float32", "sdpa", False

    torch.manual_seed(0)
    tok = common.load_tokenizer(tiny_qwen)
    policy = common.load_model(tiny_qwen, A).eval()
    critic = common.load_model(tiny_qwen, A, cls=AutoModelForSequenceClassification, num_labels=1).eval()
    prompts = ["POST: alice bought the bike . TL;DR:", "POST: bob lost the phone at the park . TL;DR:",
               "POST: erin hid the lamp . nobody knows why . TL;DR:", "POST: dave sold a car . TL;DR:"] * 2
    p_ids, p_mask = data.encode_prompts(tok, prompts)
    c_ids, c_mask, _ = sampling.generate(policy, tok, p_ids, p_mask, 10)
    batch = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": c_ids, "completion_mask": c_mask}
    with torch.no_grad():  # the rollout pass, in micro-batches of 4 as ppo.main runs it
        parts = [ppo.policy_and_values(policy, critic, {k: v[s:s + 4] for k, v in batch.items()}, 0.7) for s in (0, 4)]
    batch["old_logprobs"] = torch.cat([p[0] for p in parts])
    batch["values"] = torch.cat([p[2] for p in parts])
    mb = ppo.slice_batch(batch, torch.tensor([6, 1, 3]))  # a shuffled minibatch, trimmed to its own width
    logprobs, _, values = ppo.policy_and_values(policy, critic, mb, 0.7)
    mask = mb["completion_mask"].float()
    _, stats = ppo.policy_loss(logprobs, mb["old_logprobs"], torch.randn_like(mask), mask, 0.2, 3.0)
    assert stats["ratio"].item() == pytest.approx(1.0, abs=1e-5)
    assert stats["approx_kl"].item() == pytest.approx(0.0, abs=1e-9)
    assert stats["clipfrac"].item() == 0 and stats["dual_clip_frac"].item() == 0
    assert torch.allclose(values, mb["values"], atol=1e-5) and logprobs.requires_grad


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory, tiny_qwen):
    """What reward.py saves, without training it: tiny_qwen with a scalar head and reward_mean."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = str(tmp_path_factory.mktemp("tiny_rm"))
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_qwen, num_labels=1)
    rm.config.reward_mean = 0.25
    rm.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_qwen).save_pretrained(path)
    return path


METRICS = ("reward", "reward_std", "non_score_reward", "rlhf_reward", "kl", "pg_loss", "vf_loss", "loss", "clipfrac",
           "dual_clip_frac", "vf_clipfrac", "approx_kl", "entropy", "ratio", "explained_variance", "value",
           "completions/mean_length", "completions/clipped_ratio", "grad_norm", "learning_rate", "episode", "step_time")


def test_ppo_end_to_end_with_a_reward_model(tmp_path, tiny_qwen, tiny_reward_model):
    out = str(tmp_path / "ppo")
    proc = run_script("ppo.py", "--model", tiny_qwen, "--reward_model", tiny_reward_model, "--output_dir", out,
                      "--max_steps", "2", "--batch_size", "4", "--num_mini_batches", "2", "--num_ppo_epochs", "2",
                      "--max_completion_length", "6", "--eval_batch_size", "200", "--save_steps", "2",
                      "--offload_frozen", "--optim", "adamw")
    assert "centred by 0.250" in proc.stdout and "critic from " + tiny_reward_model in proc.stdout
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2] and all(k in rows[0] for k in METRICS)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # the first rollout comes from pi_ref itself
    assert rows[1]["episode"] == 16 and 0 <= rows[0]["completions/clipped_ratio"] <= 1
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert -1 <= summary["gold_score"] <= 1 and "test_kl" in summary
    assert set(summary["memory_bytes"]) == {"policy", "ref_policy", "critic", "reward_model", "optimizer", "peak"}
    # every sampled completion without EOS is counted (8 per rollout)
    assert summary["completions_truncated"] == round(sum(8 * r["completions/clipped_ratio"] for r in rows))
    assert summary["prompts_truncated"] == 0
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2"
    assert os.path.isdir(os.path.join(out, "checkpoint-2"))


def test_ppo_with_a_reward_function_on_any_causal_lm(tmp_path, tiny_llama, monkeypatch, capsys):
    import ppo
    from conftest import main_error

    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as f:
        for i in range(6):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"say {i}"}], "target": str(i)}) + "\n")
    fn = tmp_path / "rewards.py"
    fn.write_text("def score(prompts, completions, target, **kw):\n"
                  "    assert len(target) == len(completions) and isinstance(completions[0], list)\n"
                  "    return [float(t in c[-1]['content']) - 0.01 * len(c[-1]['content']) for t, c in zip(target, completions)]\n")
    out = str(tmp_path / "ppo_llama")
    proc = run_script("ppo.py", "--model", tiny_llama, "--dataset", str(data), "--reward_fn", f"{fn}:score",
                      "--output_dir", out, "--max_steps", "2", "--batch_size", "3", "--num_mini_batches", "2",
                      "--max_completion_length", "5", "--optim", "adamw", "--missing_eos_penalty", "0.5")
    assert "6 prompts" in proc.stdout and "critic from " + tiny_llama in proc.stdout
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert len(rows) == 2 and all(k in rows[-1] for k in METRICS)
    assert "gold_score" not in json.load(open(os.path.join(out, "summary.json")))
    bad = main_error(ppo, ["--model", tiny_llama, "--dataset", str(data), "--reward_fn", f"{fn}:nope", "--output_dir", out,
                           "--overwrite_output_dir"], monkeypatch, capsys)
    assert "defines no function 'nope'" in bad


def test_gradient_checkpointing_shrinks_ppo_activations(tmp_path, tiny_qwen, monkeypatch):
    """ppo.py keeps its trained models in training mode (dropout zeroed), so HF layers really
    checkpoint: the bytes saved for backward in the update's forward shrink with the flag (they
    did not when the models ran in eval mode)."""
    from conftest import SavedBytes, run_main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:"}) + "\n" for i in range(4)))
    (tmp_path / "r.py").write_text("def length(prompts, completions, **kw):\n    return [0.1 * len(c) for c in completions]\n")
    forward, saved = ppo.policy_and_values, []

    def measured(policy, critic, mb, temperature):
        if not torch.is_grad_enabled():
            return forward(policy, critic, mb, temperature)
        with SavedBytes() as s:
            out = forward(policy, critic, mb, temperature)
        saved.append(s.bytes)
        return out

    monkeypatch.setattr(ppo, "policy_and_values", measured)
    argv = ["--model", tiny_qwen, "--dataset", str(prompts), "--reward_fn", f"{tmp_path}/r.py:length", "--max_steps", "1",
            "--batch_size", "4", "--num_mini_batches", "1", "--num_ppo_epochs", "1", "--max_completion_length", "24",
            "--max_prompt_length", "64", "--temperature", "2.0", "--optim", "adamw"]
    run_main(ppo, argv + ["--output_dir", str(tmp_path / "plain")], monkeypatch)
    run_main(ppo, argv + ["--output_dir", str(tmp_path / "ckpt"), "--gradient_checkpointing"], monkeypatch)
    plain, ckpt = saved
    assert ckpt < 0.6 * plain, (plain, ckpt)


@pytest.mark.parametrize("use_peft", [False, True])
def test_critic_starts_centred_like_the_score(tiny_qwen, tiny_reward_model, use_peft):
    """PPO scores R_psi(x, y) - reward_mean; the critic from the same reward model must start shifted
    the same way (it started off by reward_mean): its values are the reward model's minus reward_mean,
    with --use_peft too (there the critic was left uncentred), whose R_psi (the critic's base with
    its adapters off) stays the reward model itself."""
    from transformers import AutoModelForSequenceClassification

    args = ppo.Args(model=tiny_qwen, reward_model=tiny_reward_model, dtype="float32", attn_implementation="sdpa",
                    use_peft=use_peft, lora_dropout=0.0)
    tok = common.load_tokenizer(tiny_qwen)
    critic = ppo.centre_critic(ppo.load_critic(tiny_reward_model, args), 0.25)
    raw = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model, num_labels=1)
    p_ids, p_mask = data.encode_prompts(tok, ["POST: alice bought the bike . TL;DR:", "POST: bob lost it . TL;DR:"])
    c_ids, c_mask = data.encode_completions(tok, [" alice bought bike .", " bob"])
    with torch.no_grad():
        values = ppo.token_values(critic, p_ids, p_mask, c_ids, c_mask)
        expected = ppo.token_values(raw, p_ids, p_mask, c_ids, c_mask) * c_mask
        torch.testing.assert_close(values, (expected - 0.25) * c_mask)
        if use_peft:  # R_psi is the critic's base: uncentred (ppo.score subtracts reward_mean)
            with ppo.lora.adapters_off(critic):
                torch.testing.assert_close(ppo.token_values(critic, p_ids, p_mask, c_ids, c_mask), expected)
    assert critic.score.bias.requires_grad  # the critic learns its own offset from there


def test_use_peft_starts_the_critic_where_full_training_does(tmp_path, tiny_qwen, tiny_reward_model, monkeypatch):
    """One rollout with and without --use_peft (zero-initialised adapters: the same policy, the same
    samples): the critic's first values and value loss agree (with peft they were off by reward_mean)."""
    from conftest import run_main

    rows = {}
    for peft in ([], ["--use_peft", "--lora_dropout", "0"]):
        out = str(tmp_path / f"ppo{len(peft)}")
        run_main(ppo, ["--model", tiny_qwen, "--reward_model", tiny_reward_model, "--output_dir", out, "--max_steps", "1",
                       "--batch_size", "4", "--num_mini_batches", "1", "--num_ppo_epochs", "1", "--max_completion_length",
                       "6", "--optim", "adamw", "--attn_implementation", "sdpa", *peft], monkeypatch)
        rows[bool(peft)] = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
    for key in ("reward", "value", "vf_loss"):
        assert rows[True][key] == pytest.approx(rows[False][key], abs=1e-4), key


def test_masked_whiten_over_real_tokens():
    """Advantages (and --whiten_rewards) are whitened over the real tokens only: padding neither
    shifts the mean nor the variance; shift_mean=False keeps the mean (rewards keep their sign)."""
    gen = torch.Generator().manual_seed(3)
    x, mask = torch.randn(5, 6, generator=gen) * 3 + 2, random_mask(5, 6, gen)
    x = x + (1 - mask) * 100  # garbage in the padding
    real = x[mask.bool()]
    expected = (real - real.mean()) / real.var(unbiased=False).sqrt()  # direct transcription
    torch.testing.assert_close(ppo.masked_whiten(x, mask)[mask.bool()], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ppo.masked_whiten(x, mask, shift_mean=False)[mask.bool()], expected + real.mean(),
                               atol=1e-5, rtol=1e-5)


def test_a_completion_without_eos_scores_minus_the_penalty(tmp_path, tiny_qwen, monkeypatch):
    """ppo.main itself: every completion that reaches --max_completion_length without EOS gets the
    score -missing_eos_penalty in place of the reward function's (5 here), so the logged reward is
    5 * (1 - clipped) - 1 * clipped; every log-prob (rollout, reference, update) is taken at the
    sampling temperature; and the reference is pi_ref, not the policy (the KL moves after an update)."""
    from conftest import run_main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:"}) + "\n" for i in range(4)))
    (tmp_path / "r.py").write_text("def five(prompts, completions, **kw):\n    return [5.0] * len(completions)\n")
    temperatures, logprobs = [], sampling.completion_logprobs

    def spy(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0, **kw):
        temperatures.append(temperature)
        return logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, **kw)

    monkeypatch.setattr(sampling, "completion_logprobs", spy)
    out = tmp_path / "ppo"
    run_main(ppo, ["--model", tiny_qwen, "--dataset", str(prompts), "--reward_fn", f"{tmp_path}/r.py:five",
                   "--max_steps", "2", "--batch_size", "4", "--num_mini_batches", "1", "--max_completion_length", "3",
                   "--missing_eos_penalty", "1.0", "--temperature", "0.6", "--learning_rate", "1e-3", "--optim", "adamw",
                   "--output_dir", str(out)], monkeypatch)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert any(r["completions/clipped_ratio"] > 0 for r in rows)  # a random policy rarely says EOS in 3 tokens
    for r in rows:
        clipped = r["completions/clipped_ratio"]
        assert r["reward"] == pytest.approx(5 * (1 - clipped) - 1 * clipped, abs=1e-5)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-5) and abs(rows[1]["kl"]) > 1e-4
    assert temperatures and set(temperatures) == {0.6}


def test_eval_reward_fn_scores_the_eval_completions_apart(tmp_path, tiny_qwen, monkeypatch):
    """--eval_reward_fn: every --eval_steps the same greedy eval completions are also scored by a
    function the run does not train on, logged as eval_rewards/<name>/mean and kept out of
    eval_reward (which holds the missing-EOS penalty, the eval function's mean does not) and training."""
    from conftest import check_eval_reward_fn, eval_reward_files

    f = eval_reward_files(tmp_path)
    argv = ["--model", tiny_qwen, "--dataset", f["prompts.jsonl"], "--reward_fn", f"{f['r.py']}:length",
            "--eval_dataset", f["eval.jsonl"], "--eval_steps", "2", "--max_steps", "4", "--batch_size", "4",
            "--num_mini_batches", "1", "--max_completion_length", "6", "--learning_rate", "1e-3", "--optim", "adamw"]
    check_eval_reward_fn(ppo, argv, f, str(tmp_path), monkeypatch)
