"""main() is checked at its calls: each algorithm's loop runs one tiny step in this process with
spies on its own functions (loss, advantages, GAE, reference pass), and what main() hands them is
compared with a direct computation from the same batch. The unit tests prove each function against
its equation; these prove that main() calls it with the right tensors, in the right order, with the
right flags. Exact invariants of the first step are asserted exactly: pi_old == pi (ratio 1), the
reference == the policy (KL 0)."""

import inspect
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import run_main, uniform_words_model
from transformers import AutoModelForCausalLM

import common
import dpo
import grpo
import kto
import ppo
import reward
import sft
from rlhf import sampling


def spy(monkeypatch, owner, name):
    """Replace owner.name by a wrapper that records every call: its bound arguments (defaults
    filled in) and, under "out", what it returned."""
    calls, fn = [], getattr(owner, name)
    signature = inspect.signature(fn)

    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append({**bound.arguments, "out": out})
        return out

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def losses_checked(monkeypatch):
    """The tensors main() calls common.check_finite("loss", ...) on: the very loss it backpropagates."""
    seen, check = [], common.check_finite
    monkeypatch.setattr(common, "check_finite", lambda name, value, step: (seen.append(value) if name == "loss" else None,
                                                                          check(name, value, step))[1])
    return seen


def initial_logprobs(model_path, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
    """log pi_0(y_t | x, y_<t) of the starting policy, loaded afresh: what pi, pi_old and pi_ref all are at step 1."""
    model = AutoModelForCausalLM.from_pretrained(model_path)
    common.disable_dropout(model)
    with torch.no_grad():
        return sampling.completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature)


def prompts_file(tmp_path, n=8):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:"}) + "\n" for i in range(n)))
    (tmp_path / "r.py").write_text("def length(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    return str(path), f"{tmp_path}/r.py:length"


def test_grpo_main_passes_the_batch_its_advantages_and_its_reference(tmp_path, tiny_qwen, monkeypatch):
    """One GRPO step of 2 micro-batches: the rewards reach batch_advantages as scored, the
    advantages grpo_loss gets are the group-normalised rewards, pi_old is pi detached (ratio
    exactly 1), the reference's log-probs are the starting policy's at --temperature (KL exactly
    0), and the normalisers count the whole optimizer batch."""
    prompts, fn = prompts_file(tmp_path)
    scores, generated = spy(monkeypatch, grpo, "score"), spy(monkeypatch, sampling, "generate")
    advantage_calls, loss_calls = spy(monkeypatch, grpo, "batch_advantages"), spy(monkeypatch, grpo, "grpo_loss")
    G, temperature = 4, 0.8
    run_main(grpo, ["--model", tiny_qwen, "--dataset", prompts, "--reward_fn", fn, "--batch_size", "2",
                    "--num_generations", str(G), "--gradient_accumulation_steps", "2", "--max_steps", "1",
                    "--max_completion_length", "6", "--temperature", str(temperature), "--beta", "0.3",
                    "--scale_rewards", "group", "--optim", "adamw", "--output_dir", str(tmp_path / "out")], monkeypatch)
    assert len(scores) == len(generated) == len(loss_calls) == 2 and len(advantage_calls) == 1
    (adv_call,) = advantage_calls
    assert adv_call["num_generations"] == G and adv_call["scale_rewards"] == "group"
    masks = [g["out"][1] for g in generated]
    for micro, (s, g, call) in enumerate(zip(scores, generated, loss_calls)):
        rewards = s["out"][:, 0]  # one reward function, weight 1
        assert torch.equal(adv_call["rewards"][micro], rewards)
        # A_i = (r_i - mean of its group) / (std of its group + 1e-4), transcribed
        grouped = rewards.view(-1, G)
        expected = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)
        torch.testing.assert_close(call["advantages"], expected, rtol=0, atol=1e-6)
        completion_ids, completion_mask, _ = g["out"]
        assert torch.equal(call["completion_mask"], completion_mask)
        # step 1: pi_old is pi without its gradient, so the ratio is exactly 1
        assert call["logprobs"].requires_grad and not call["old_logprobs"].requires_grad
        assert torch.equal(call["logprobs"].detach(), call["old_logprobs"])
        # the reference is the starting policy at the sampling temperature, on the same tokens and mask
        direct = initial_logprobs(tiny_qwen, g["prompt_ids"], g["prompt_mask"], completion_ids, completion_mask, temperature)
        assert not call["ref_logprobs"].requires_grad
        torch.testing.assert_close(call["ref_logprobs"], direct, rtol=0, atol=1e-5)
        torch.testing.assert_close(call["old_logprobs"], direct, rtol=0, atol=1e-5)
        assert call["out"][1]["kl"] == 0  # k3 at log pi == log pi_ref, exactly
        assert call["num_sequences"] == sum(m.shape[0] for m in masks)
        assert call["num_tokens"] == sum(m.sum() for m in masks)
        assert call["args"].beta == 0.3



@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp"])
def test_grpo_main_advantage_estimator_reaches_the_loss(estimator, tmp_path, tiny_qwen, monkeypatch):
    """--advantage_estimator: the advantages grpo_loss gets over 2 micro-batches are the scored
    rewards under RLOO's leave-one-out baseline, or REINFORCE++'s whitening over every trained
    token of the step (both micro-batches), transcribed here."""
    prompts, fn = prompts_file(tmp_path)
    scores, loss_calls = spy(monkeypatch, grpo, "score"), spy(monkeypatch, grpo, "grpo_loss")
    G = 4
    run_main(grpo, ["--model", tiny_qwen, "--dataset", prompts, "--reward_fn", fn, "--batch_size", "2",
                    "--num_generations", str(G), "--gradient_accumulation_steps", "2", "--max_steps", "1",
                    "--max_completion_length", "6", "--advantage_estimator", estimator, "--optim", "adamw",
                    "--output_dir", str(tmp_path / "out")], monkeypatch)
    rewards = torch.cat([s["out"][:, 0] for s in scores]).double()  # (16,)
    lengths = torch.cat([c["completion_mask"].sum(1) for c in loss_calls]).double()
    if estimator == "rloo":  # r_i - mean of the other G-1 of its group
        grouped = rewards.view(-1, G)
        expected = (grouped - (grouped.sum(1, keepdim=True) - grouped) / (G - 1)).reshape(-1)
    else:  # (r_i - mu) / sqrt(var + 1e-8), moments weighted by each completion's tokens
        mu = (lengths * rewards).sum() / lengths.sum()
        expected = (rewards - mu) / ((lengths * (rewards - mu) ** 2).sum() / lengths.sum() + 1e-8).sqrt()
    assert rewards.std() > 0  # the lengths differ, so the advantages are not all 0
    torch.testing.assert_close(torch.cat([c["advantages"] for c in loss_calls]).double(), expected, rtol=0, atol=1e-5)



def test_kto_main_passes_its_weights_and_the_reference(tmp_path, tiny_qwen, monkeypatch):
    """One KTO step: kto_loss gets --beta, --desirable_weight, --undesirable_weight and the rows'
    labels; the precomputed reference log-probs of the rows and of their mismatched pairs are the
    starting policy's (so at step 1 every log-ratio is 0); prompts are cut to --max_prompt_length (4 of their 9 tokens)."""
    rows = [{"prompt": f"POST: bob sold the car {i} . TL;DR:", "completion": " bob sold a car" * (1 + i % 2),
             "label": bool(i % 3)} for i in range(6)]
    (tmp_path / "u.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loss_calls, forwards = spy(monkeypatch, kto, "kto_loss"), spy(monkeypatch, kto, "row_logps")
    run_main(kto, ["--model", tiny_qwen, "--dataset", str(tmp_path / "u.jsonl"), "--batch_size", "3", "--max_steps", "1",
                   "--beta", "0.3", "--desirable_weight", "1.5", "--undesirable_weight", "0.5", "--max_prompt_length", "4",
                   "--optim", "adamw", "--output_dir", str(tmp_path / "out")], monkeypatch)
    (call,) = loss_calls
    assert (call["beta"], call["desirable_weight"], call["undesirable_weight"]) == (0.3, 1.5, 0.5)
    blocks = kto.kl_blocks(6, 3, 0)
    block = [b for b in blocks.tolist() if [bool(i % 3) for i in b] == call["labels"].tolist()]
    assert block, (blocks, call["labels"])  # the labels are those of one of the run's blocks
    torch.testing.assert_close(call["ref_logps"], call["logps"].detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(call["ref_kl_logps"], call["kl_logps"].detach(), rtol=0, atol=1e-5)
    # the mismatched pairs are each prompt with another row's completion (the rows' lengths alternate): not a
    # second forward of the matched pairs, which would differ from logps by float rounding only
    assert (call["logps"] - call["kl_logps"]).abs().max() > 0.1
    assert forwards and all(f["batch"]["prompt_ids"].shape[1] == 4 for f in forwards)


def test_ppo_main_passes_rewards_gae_targets_and_loss_weights(tmp_path, monkeypatch):
    """One PPO step: the score with the missing-EOS penalty and the KL coefficient reach the
    per-token rewards, whose policy and reference log-probs are the starting policy's (KL exactly
    0); GAE gets those rewards (whitened with --whiten_rewards), the rollout's values, --gamma and --lam; the policy loss gets the
    whitened advantages, pi_old == pi (ratio exactly 1) and --cliprange; the critic regresses onto
    GAE's returns from the rollout's values with --cliprange_value; the loss backpropagated is
    pg_loss + --vf_coef * vf_loss."""
    prompts, fn = prompts_file(tmp_path)
    model = str(tmp_path / "model")
    uniform_words_model(model)  # stops with probability ~0.2 per token: some completions end, some are cut
    scores, generated = spy(monkeypatch, ppo, "score"), spy(monkeypatch, sampling, "generate")
    rewards_calls, gae_calls = spy(monkeypatch, ppo, "per_token_rewards"), spy(monkeypatch, ppo, "gae")
    pg_calls, vf_calls = spy(monkeypatch, ppo, "policy_loss"), spy(monkeypatch, ppo, "value_loss")
    losses = losses_checked(monkeypatch)
    temperature = 1.5
    run_main(ppo, ["--model", model, "--dataset", prompts, "--reward_fn", fn, "--batch_size", "8",
                   "--gradient_accumulation_steps", "1", "--num_mini_batches", "1", "--num_ppo_epochs", "1",
                   "--max_steps", "1", "--max_completion_length", "6", "--temperature", str(temperature),
                   "--missing_eos_penalty", "2.0", "--kl_coef", "0.37", "--gamma", "0.9", "--lam", "0.8",
                   "--cliprange", "0.15", "--cliprange_value", "0.25", "--vf_coef", "0.3", "--dual_clip_c", "2.5",
                   "--whiten_rewards", "--optim", "adamw", "--output_dir", str(tmp_path / "out")], monkeypatch)
    (s,), (g,), (r,), (a,), (pg,), (vf,), (loss,) = scores, generated, rewards_calls, gae_calls, pg_calls, vf_calls, losses
    completion_ids, completion_mask, truncated = g["out"]
    mask = completion_mask.float()
    # 2. the score (no EOS: -missing_eos_penalty) and the per-token KL penalty's inputs
    assert truncated.any() and not truncated.all()  # both branches of the penalty are seen
    assert torch.equal(r["scores"], torch.where(truncated, -2.0, s["out"]))
    assert r["kl_coef"] == 0.37 and torch.equal(r["completion_mask"], mask)
    direct = initial_logprobs(model, g["prompt_ids"], g["prompt_mask"], completion_ids, completion_mask, temperature)
    torch.testing.assert_close(r["logprobs"], direct, rtol=0, atol=1e-5)
    torch.testing.assert_close(r["ref_logprobs"], direct, rtol=0, atol=1e-5)
    assert torch.equal(r["out"][1], torch.zeros_like(mask))  # KL exactly 0 at step 1
    # 3. GAE on those rewards, scaled to unit variance over the batch (--whiten_rewards, mean kept), and the rollout's values

    def whiten(x):  # (x - mean) / std over the real tokens (biased variance, as masked_whiten)
        mean = (x * mask).sum() / mask.sum()
        return (x - mean) * torch.rsqrt(((x - mean) ** 2 * mask).sum() / mask.sum() + 1e-8)

    rewards = r["out"][0]
    torch.testing.assert_close(a["rewards"], (whiten(rewards) + (rewards * mask).sum() / mask.sum()) * mask, rtol=0, atol=1e-6)
    assert torch.equal(a["mask"], mask)
    assert a["gamma"] == 0.9 and a["lam"] == 0.8
    advantages, returns = a["out"]
    whitened = whiten(advantages) * mask
    # 4. the minibatch: the rollout's rows in the epoch's shuffled order (ppo.main's seed), cut to its width
    perm = torch.randperm(8, generator=torch.Generator().manual_seed((0 * 100_003 + 0) * 101 + 0))
    width = pg["mask"].shape[1]

    def rows(x):
        return x[perm][:, :width]

    assert torch.equal(pg["mask"], rows(mask)) and torch.equal(vf["mask"], rows(mask))
    # the policy loss: whitened advantages, pi_old == pi exactly, the clip ranges
    assert pg["logprobs"].requires_grad and not pg["old_logprobs"].requires_grad
    assert torch.equal(pg["logprobs"].detach(), pg["old_logprobs"])
    torch.testing.assert_close(pg["old_logprobs"], rows(direct), rtol=0, atol=1e-5)
    torch.testing.assert_close(pg["advantages"], rows(whitened), rtol=0, atol=1e-5)
    assert pg["cliprange"] == 0.15 and pg["dual_clip_c"] == 2.5 and pg["num_tokens"] == mask.sum()
    # the critic: from the rollout's values onto GAE's returns
    assert vf["values"].requires_grad and not vf["old_values"].requires_grad
    assert torch.equal(vf["old_values"], rows(a["values"])) and torch.equal(vf["values"].detach(), vf["old_values"])
    assert torch.equal(vf["returns"], rows(returns)) and vf["cliprange_value"] == 0.25
    assert torch.equal(loss, pg["out"][0] + 0.3 * vf["out"][0])


def preference_file(tmp_path, n=8):
    """Pairs whose chosen and rejected differ (so a swap changes every log-prob)."""
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"POST: alice bought the bike {i} . TL;DR:",
                                        "chosen": " alice bought bike ." + " now" * (i % 3),
                                        "rejected": " bob lost the phone ."}) + "\n" for i in range(n)))
    return str(path)


def test_dpo_main_passes_policy_and_reference_log_probs_in_order(tmp_path, tiny_qwen, monkeypatch):
    """One offline DPO step of 2 micro-batches (reference precomputed): dpo_loss gets the
    policy's chosen and rejected sequence log-probs (with gradient) and the reference's (without),
    each equal to the starting policy's on the batch's own rows, with --beta and --label_smoothing;
    RPO's NLL reads the chosen rows; the loss backpropagated is the mean loss + --rpo_alpha * NLL."""
    batches, loss_calls = spy(monkeypatch, dpo, "encode_pairs"), spy(monkeypatch, dpo, "dpo_loss")
    nll_calls, losses = spy(monkeypatch, dpo, "chosen_nll"), losses_checked(monkeypatch)
    run_main(dpo, ["--model", tiny_qwen, "--dataset", preference_file(tmp_path), "--batch_size", "2",
                   "--gradient_accumulation_steps", "2", "--max_steps", "1", "--beta", "0.3", "--label_smoothing", "0.1",
                   "--rpo_alpha", "0.5", "--optim", "adamw", "--output_dir", str(tmp_path / "out")], monkeypatch)
    train_batches = [b["out"] for b in batches if b["out"]["prompt_ids"].shape[0] == 2][-2:]  # after the precompute pass
    assert len(loss_calls) == len(nll_calls) == len(losses) == 2
    for batch, call, nll, loss in zip(train_batches, loss_calls, nll_calls, losses):
        B = batch["prompt_ids"].shape[0]
        ids, mask = batch["completion_ids"], batch["completion_mask"]  # (2B, C): chosen rows first
        per_token = initial_logprobs(tiny_qwen, batch["prompt_ids"].repeat(2, 1), batch["prompt_mask"].repeat(2, 1), ids, mask)
        chosen, rejected = per_token.sum(1)[:B], per_token.sum(1)[B:]
        assert call["chosen_logps"].requires_grad and call["rejected_logps"].requires_grad
        assert not call["ref_chosen_logps"].requires_grad and not call["ref_rejected_logps"].requires_grad
        for name, direct in [("chosen_logps", chosen), ("rejected_logps", rejected),
                             ("ref_chosen_logps", chosen), ("ref_rejected_logps", rejected)]:
            torch.testing.assert_close(call[name].detach(), direct, rtol=0, atol=1e-4, msg=name)
        assert call["beta"] == 0.3 and call["label_smoothing"] == 0.1 and call["loss_type"] == "sigmoid"
        assert torch.equal(nll["chosen_logps"], call["chosen_logps"]) and torch.equal(nll["chosen_mask"], mask[:B])
        assert torch.equal(loss, call["out"][0].mean() + 0.5 * nll["out"])


def test_reward_main_passes_chosen_then_rejected_scores(tmp_path, tiny_qwen, monkeypatch):
    """One reward-model step: bradley_terry_loss gets pair_scores' chosen scores first and its
    rejected second, both with gradient, on triples whose chosen is the dataset's chosen; the
    loss backpropagated is -log sigmoid(r_w - r_l), mean over the pairs."""
    score_calls, loss_calls = spy(monkeypatch, reward, "pair_scores"), spy(monkeypatch, reward, "bradley_terry_loss")
    losses = losses_checked(monkeypatch)
    run_main(reward, ["--model", tiny_qwen, "--dataset", preference_file(tmp_path), "--batch_size", "3", "--max_steps", "1",
                      "--eval_steps", "0", "--test_size", "0.25", "--optim", "adamw", "--output_dir", str(tmp_path / "out")],
             monkeypatch)
    train = [c for c in score_calls if c["out"][0].requires_grad]
    (s,), (loss,) = train, losses
    call = next(c for c in loss_calls if c["chosen_rewards"].requires_grad)
    assert call["chosen_rewards"] is s["out"][0] and call["rejected_rewards"] is s["out"][1]
    assert all("alice bought bike" in c and "bob lost" in r for _, c, r in s["triples"])
    margin = s["out"][0] - s["out"][1]
    assert torch.equal(loss, -F.logsigmoid(margin).mean())


def test_sft_main_passes_the_loss_mask_and_the_step_token_count(tmp_path, tiny_qwen, sft_data, monkeypatch):
    """One SFT step of 2 micro-batches: sft_loss gets the policy's log-probs of each micro-batch
    (the starting policy's, with gradient), its loss mask, and the token count of the whole
    optimizer batch, so the two parts sum to one token mean."""
    calls, losses = spy(monkeypatch, sft, "sft_loss"), losses_checked(monkeypatch)
    encoded = spy(monkeypatch, sft.data, "encode_turns")
    prompts = spy(monkeypatch, sft.data, "encode_prompts")
    run_main(sft, ["--model", tiny_qwen, "--dataset", sft_data, "--batch_size", "3", "--gradient_accumulation_steps", "2",
                   "--max_steps", "1", "--optim", "adamw", "--output_dir", str(tmp_path / "out")], monkeypatch)
    assert len(calls) == 2
    train = list(zip(prompts, encoded))[-2:]
    total = sum(e["out"][2].sum() for _, e in train)
    for (p, e), call, loss in zip(train, calls, losses):
        (prompt_ids, prompt_mask), (ids, mask, loss_mask) = p["out"], e["out"]
        assert call["logprobs"].requires_grad and torch.equal(call["completion_mask"], loss_mask)
        torch.testing.assert_close(call["logprobs"].detach(), initial_logprobs(tiny_qwen, prompt_ids, prompt_mask, ids, mask),
                                   rtol=0, atol=1e-5)
        assert call["num_tokens"] == total
        assert torch.equal(loss, -(call["logprobs"] * loss_mask).sum() / total)
