"""grpo.py: group advantages and the loss against direct transcriptions of the design document's
formulas, the first-step invariants, user reward functions, and the script end to end."""

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import run_script

import grpo


def _metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------ advantages
def test_group_advantages_on_hand_built_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0,   0.3, 0.3, 0.3, 0.3,   0.0, 1.0, 2.0, 3.0])
    adv = grpo.group_advantages(rewards, 4, "group")
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: all equal -> no signal; group 3: mean 1.5
    s1, s3 = math.sqrt(1 / 3), math.sqrt(5 / 3)
    expected = [0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1, 0, 0, 0, 0, -1.5 / s3, -0.5 / s3, 0.5 / s3, 1.5 / s3]
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-3, rtol=1e-3)
    assert adv[4:8].abs().max() < 1e-6
    for g in range(3):  # every group's advantages sum to zero
        assert abs(float(adv[4 * g:4 * g + 4].sum())) < 1e-5
    # none: centred only; batch: one std for all twelve rewards
    torch.testing.assert_close(grpo.group_advantages(rewards, 4, "none"),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -1.5, -0.5, 0.5, 1.5]))
    torch.testing.assert_close(grpo.group_advantages(rewards, 4, "batch"),
                               grpo.group_advantages(rewards, 4, "none") / (rewards.std() + grpo.ADV_EPS))



def test_rloo_advantages_leave_each_sample_out():
    """RLOO: A_i = r_i - mean of the other G-1 rewards, transcribed as a loop; a NaN reward is out
    of its siblings' baselines with A = 0, and a group's only scorable reward gets A = 0 (TRL)."""
    G = 4
    rewards = torch.randn(12, generator=torch.Generator().manual_seed(0))
    rewards[5] = rewards[9] = rewards[10] = rewards[11] = float("nan")  # group 2: one NaN; group 3: one scorable
    expected = torch.zeros(12)
    for i in range(12):
        others = [float(rewards[j]) for j in range(i // G * G, i // G * G + G) if j != i and not rewards[j].isnan()]
        if not rewards[i].isnan() and others:
            expected[i] = float(rewards[i]) - sum(others) / len(others)
    torch.testing.assert_close(grpo.rloo_advantages(rewards, G), expected, rtol=0, atol=1e-6)
    # without NaNs: G/(G-1) times GRPO's unscaled advantages
    clean = torch.randn(8, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(grpo.rloo_advantages(clean, G), grpo.group_advantages(clean, G, "none") * G / (G - 1))


def test_reinforce_pp_advantages_are_openrlhfs_token_whitening():
    """REINFORCE++ (OpenRLHF's reinforce, KL in the loss): each token's return is its completion's
    reward (gamma 1), whitened by the mean and variance over every completion token of the batch,
    transcribed on an (N, C) grid of tokens; a NaN reward is left out and gets A = 0."""
    gen = torch.Generator().manual_seed(2)
    rewards = torch.randn(6, generator=gen) * 3 + 1
    lengths = torch.tensor([1, 7, 3, 7, 2, 5])
    mask = (torch.arange(7)[None, :] < lengths[:, None]).float()  # (N, C)
    returns = rewards[:, None] * mask  # (N, C): r_i on every token of y_i
    mean = (returns * mask).sum() / mask.sum()
    var = (((returns - mean) * mask) ** 2).sum() / mask.sum()
    per_token = (returns - mean) * torch.rsqrt(var + 1e-8)
    torch.testing.assert_close(grpo.reinforce_pp_advantages(rewards, lengths), per_token[:, 0], rtol=1e-6, atol=1e-6)
    # a NaN reward: out of the moments, A = 0
    with_nan = torch.cat([rewards, torch.tensor([float("nan")])])
    got = grpo.reinforce_pp_advantages(with_nan, torch.cat([lengths, torch.tensor([4])]))
    torch.testing.assert_close(got, torch.cat([per_token[:, 0], torch.zeros(1)]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("estimator, scale", [("rloo", "none"), ("rloo", "batch"), ("reinforce_pp", "none")])
def test_batch_wide_estimators_span_the_optimizer_batch(estimator, scale):
    """Split into micro-batches, --advantage_estimator rloo (with TRL's normalize_advantages: batch)
    and reinforce_pp give the advantages of one micro-batch of everything."""
    rewards = torch.randn(16, generator=torch.Generator().manual_seed(3)) * torch.arange(16) / 4
    lengths = torch.arange(16) % 5 + 1
    parts = [slice(0, 8), slice(8, 16)]
    whole = grpo.batch_advantages([rewards], 4, scale, estimator, [lengths])[0]
    split = torch.cat(grpo.batch_advantages([rewards[s] for s in parts], 4, scale, estimator, [lengths[s] for s in parts]))
    torch.testing.assert_close(split, whole)
    if scale == "batch":  # TRL's normalize_advantages: mean 0 and std 1 over the batch
        assert abs(float(whole.mean())) < 1e-5 and abs(float(whole.std()) - 1) < 1e-3


# ------------------------------------------------------------------ loss
def _args(**kw):
    # max_completion_length 10 > the batches' width 7, as when no sample reaches the limit:
    # dr_grpo's constant normaliser is the flag, not the padded width
    base = dict(epsilon=0.2, epsilon_high=0.28, dual_clip_c=3.0, beta=0.04, loss_type="grpo",
                max_completion_length=10)
    return SimpleNamespace(**{**base, **kw})


def _random_batch(seed=0, N=8, C=7):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(N, C, generator=g) * 3
    old_logprobs = logprobs + torch.randn(N, C, generator=g) * 1.2  # ratios from ~0.03 to ~30: every clip binds
    ref_logprobs = logprobs + torch.randn(N, C, generator=g) * 0.5
    advantages = torch.randn(N, generator=g)
    lengths = torch.randint(1, C + 1, (N,), generator=g)
    mask = (torch.arange(C)[None] < lengths[:, None]).long()
    return logprobs, old_logprobs, ref_logprobs, advantages, mask


def _design_doc_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, a):
    """The design document's GRPO objective with dual clip, token by token, in plain Python."""
    N, C = logprobs.shape
    per_seq, total, n_tokens = [], 0.0, 0
    for i in range(N):
        A, seq = float(advantages[i]), 0.0
        for t in range(C):
            if not mask[i, t]:
                continue
            lp, old, ref = float(logprobs[i, t]), float(old_logprobs[i, t]), float(ref_logprobs[i, t])
            r = math.exp(lp - old)
            s = min(r * A, min(max(r, 1 - a.epsilon), 1 + a.epsilon_high) * A)
            if a.dual_clip_c and A < 0:
                s = max(s, a.dual_clip_c * A)
            kl = math.exp(ref - lp) - (ref - lp) - 1
            seq += -(s - a.beta * kl)
            n_tokens += 1
        per_seq.append(seq / max(int(mask[i].sum()), 1))
        total += seq
    if a.loss_type == "grpo":
        return sum(per_seq) / N
    if a.loss_type == "dr_grpo":
        return total / (N * a.max_completion_length)
    return total / n_tokens


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_loss_matches_the_formula(loss_type):
    a = _args(loss_type=loss_type)
    logprobs, old, ref, adv, mask = _random_batch()
    loss, metrics = grpo.grpo_loss(logprobs, old, ref, adv, mask, a)
    assert math.isclose(float(loss), _design_doc_loss(logprobs, old, ref, adv, mask, a), rel_tol=1e-5, abs_tol=1e-6)
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    assert metrics["clip_ratio/dual_mean"] > 0 and metrics["kl"] > 0
    # gradient accumulation: micro-batches with the whole batch's normalisers sum to the batch loss
    parts = [grpo.grpo_loss(logprobs[s], old[s], ref[s], adv[s], mask[s], a, num_sequences=8, num_tokens=mask.sum())[0]
             for s in (slice(0, 3), slice(3, 8))]
    torch.testing.assert_close(sum(parts), loss)


def test_dual_clip_bounds_negative_advantages():
    a = _args(beta=0.0, loss_type="dapo")
    logprobs = torch.zeros(2, 2, requires_grad=True)
    old = torch.log(torch.tensor([[1 / 5.0, 1 / 2.0], [1 / 5.0, 1 / 2.0]]))  # ratios 5 (> c) and 2 (< c)
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.ones(2, 2, dtype=torch.long)
    loss, metrics = grpo.grpo_loss(logprobs, old, None, adv, mask, a)
    loss.backward()
    loss = loss.detach()
    # A < 0, ratio 5: the bound c*A = -3 binds (loss 3, no gradient); ratio 2: the unclipped r*A = -2
    # A > 0: both ratios are above 1 + epsilon_high, so the clip binds at 1.28 (no gradient)
    assert math.isclose(float(loss), (3 + 2 - 1.28 - 1.28) / 4, rel_tol=1e-6)
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 1] != 0 and (logprobs.grad[1] == 0).all()
    assert metrics["clip_ratio/dual_mean"] == 0.25 and metrics["clip_ratio/high_mean"] == 0.5
    # without the dual clip the same token has an unbounded loss r*|A| = 5 and a gradient
    logprobs.grad = None
    loss, _ = grpo.grpo_loss(logprobs, old, None, adv, mask, _args(beta=0.0, loss_type="dapo", dual_clip_c=0))
    loss.backward()
    assert math.isclose(float(loss.detach()), (5 + 2 - 1.28 - 1.28) / 4, rel_tol=1e-6) and logprobs.grad[0, 0] != 0


def test_on_policy_ratio_is_one_and_kl_zero_at_the_reference():
    logprobs, _, _, adv, mask = _random_batch(1)
    logprobs.requires_grad_(True)
    loss, metrics = grpo.grpo_loss(logprobs, logprobs.detach(), logprobs.detach(), adv, mask, _args())
    assert metrics["kl"] == 0 and metrics["clip_ratio"] == 0 and metrics["clip_ratio/dual_mean"] == 0
    loss.backward()  # the gradient is the plain policy gradient: -A_i / |y_i| / N per token (grpo)
    expected = -adv[:, None] / mask.sum(1, keepdim=True) / mask.shape[0] * mask
    torch.testing.assert_close(logprobs.grad, expected)


# ------------------------------------------------------------------ rewards
def test_user_reward_fn_receives_extra_columns(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text("def match(prompts, completions, answer, **kw):\n"
                    "    return [float(a in c) for c, a in zip(completions, answer)]\n")
    args = SimpleNamespace(reward_fn=f"{path}:match", reward_model="", reward_weights="2", dataset="x.jsonl", max_steps=1)
    rewards, weights = grpo.load_rewards(args)
    assert [r["name"] for r in rewards] == ["match"] and weights.tolist() == [2.0]
    scores = grpo.score(rewards, ["say 3", "say 4"], [" 3", " 5"], None, {"answer": ["3", "4"]}, args)
    assert scores.tolist() == [[1.0], [0.0]]
    # conversational prompts: completions arrive as assistant messages, as in TRL
    path.write_text("def match(prompts, completions, answer, **kw):\n"
                    "    return [float(a in c[-1]['content']) for c, a in zip(completions, answer)]\n")
    rewards, _ = grpo.load_rewards(args)
    scores = grpo.score(rewards, [[{"role": "user", "content": "say 3"}]], [" 3"], None, {"answer": ["3"]}, args)
    assert scores.tolist() == [[1.0]]


# ------------------------------------------------------------------ end to end
METRICS = ["reward", "reward_std", "frac_reward_zero_std", "rewards/gold/mean", "kl", "clip_ratio",
           "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/dual_mean", "entropy",
           "completions/mean_length", "completions/clipped_ratio", "loss", "grad_norm", "learning_rate"]


def test_grpo_on_the_embedded_world(tmp_path, tiny_qwen):
    out = str(tmp_path / "grpo")
    run_script("grpo.py", "--model", tiny_qwen, "--output_dir", out, "--max_steps", "4", "--batch_size", "2",
               "--num_generations", "4", "--max_completion_length", "8", "--num_iterations", "2",
               "--save_steps", "2", "--learning_rate", "1e-3", "--optim", "adamw", "--max_prompt_length", "12",
               "--seed", "4")  # seed 4: the first rollout's rewards differ within a group, so the policy moves
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(k in rows[0] for k in METRICS)
    # first step: policy == reference == old policy
    assert abs(rows[0]["kl"]) < 1e-6 and rows[0]["clip_ratio"] == 0 and rows[0]["clip_ratio/dual_mean"] == 0
    # step 2 reuses step 1's rollout with the updated policy: same rewards, the ratio has moved
    assert rows[1]["reward"] == rows[0]["reward"] and rows[1]["kl"] > 0
    summary = json.load(open(os.path.join(out, "summary.json")))
    # throughput: the sampler's on the steps that sample (1 and 3), the update's on every step
    assert [("rollout_tokens_per_second" in r, r["rollout_time"] < r["step_time"] if "rollout_time" in r else None)
            for r in rows] == [(True, True), (False, None), (True, True), (False, None)]
    assert all(r["tokens_per_second"] > 0 and 0 < r["mfu"] < 1 for r in rows)
    vocab = json.load(open(os.path.join(tiny_qwen, "config.json")))["vocab_size"]
    assert all(0 < r["entropy"] <= math.log(vocab) for r in rows)  # nats of a softmax over the vocabulary
    assert 0 < summary["rollout_time"] < summary["step_time"] and summary["rollout_tokens_per_second"] > 0
    assert 0 < summary["mfu"] < 1 and summary["peak_flops"] > 0 and summary["flops_per_step"] > 0
    assert -1 <= summary["gold_score"] <= 1
    # cut prompts counted up front, sampled completions without EOS as they come (two rollouts of 2 x 4)
    assert summary["prompts_truncated"] > 0
    assert summary["completions_truncated"] == round(8 * (rows[0]["completions/clipped_ratio"] + rows[2]["completions/clipped_ratio"]))
    # --scale_rewards auto: the group's std with a verifier (the design document's formula)
    assert json.load(open(os.path.join(out, "args.json")))["scale_rewards"] == "group"
    from transformers import AutoModelForCausalLM

    for folder in (out, os.path.join(out, "checkpoint-2"), os.path.join(out, "checkpoint-4")):
        assert AutoModelForCausalLM.from_pretrained(folder).config.model_type == "qwen2"


def test_main_logs_the_entropy_of_the_tempered_softmax(tmp_path, tiny_qwen, monkeypatch):
    """grpo.main's first step logs as `entropy` the token mean of -sum p log p over the policy's
    tempered next-token distribution, written here with the model's full logits and torch's
    log_softmax on the completions main sampled, at the initial weights."""
    from conftest import run_main
    from transformers import AutoModelForCausalLM

    from rlhf import sampling

    calls, completion_logprobs = [], sampling.completion_logprobs
    monkeypatch.setattr(sampling, "completion_logprobs",
                        lambda *a, **kw: (kw.get("with_entropy") and calls.append(a[1:])) or completion_logprobs(*a, **kw))
    out = tmp_path / "grpo"
    run_main(grpo, ["--model", tiny_qwen, "--output_dir", str(out), "--max_steps", "1", "--batch_size", "2",
                    "--num_generations", "4", "--max_completion_length", "8", "--temperature", "0.7", "--optim", "adamw",
                    "--max_prompt_length", "12"], monkeypatch)
    (p_ids, p_mask, c_ids, c_mask, temperature), = calls
    p_ids, p_mask = p_ids.repeat_interleave(4, 0), p_mask.repeat_interleave(4, 0)  # a prompt for each of its completions
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen)
    ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=sampling.position_ids(mask)).logits
    log_p = torch.log_softmax(logits[:, p_ids.shape[1] - 1:-1].float() / temperature, -1)
    entropy = -(log_p.exp() * log_p).sum(-1)  # (B, C)
    expected = float((entropy * c_mask).sum() / c_mask.sum())
    assert temperature == 0.7 and json.loads(open(out / "metrics.jsonl").readline())["entropy"] == pytest.approx(expected, rel=1e-4)


def test_grpo_any_model_with_user_reward_and_reward_model(tmp_path, tiny_llama):
    from worlds import world
    from transformers import Qwen2ForSequenceClassification

    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as f:
        for name in ["alice", "bob", "carol", "dave", "erin", "frank"]:
            f.write(json.dumps({"prompt": f"POST: {name} bought the bike . TL;DR:", "answer": name}) + "\n")
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "def mentions(prompts, completions, answer, **kw):\n"
        "    assert all(a in p for p, a in zip(prompts, answer)), 'answer column not aligned with prompts'\n"
        "    return [float(a in c) - 0.01 * len(c.split()) for c, a in zip(completions, answer)]\n")
    rm = tmp_path / "rm"  # a reward model as reward.py saves it (random weights)
    tok = world.build_tokenizer()
    config = world.build_model(tok, 64, 1).config
    config.num_labels, config.reward_mean = 1, 0.5
    model = Qwen2ForSequenceClassification(config)
    model.save_pretrained(rm)
    tok.save_pretrained(rm)
    out = str(tmp_path / "grpo_llama")
    run_script("grpo.py", "--model", tiny_llama, "--dataset", str(data), "--reward_fn", f"{rewards}:mentions",
               "--reward_model", str(rm), "--reward_weights", "1,0.5", "--output_dir", out, "--max_steps", "2",
               "--batch_size", "3", "--num_generations", "2", "--max_completion_length", "6", "--beta", "0",
               "--loss_type", "dapo", "--mask_truncated_completions")
    rows = _metrics(out)
    # --scale_rewards auto: the batch's std when a reward model is among the rewards
    assert json.load(open(os.path.join(out, "args.json")))["scale_rewards"] == "batch"
    assert "rewards/mentions/mean" in rows[0] and "rewards/rm/mean" in rows[0] and "kl" not in rows[0]
    for r in rows:  # the total is the weighted sum of the sources
        assert math.isclose(r["reward"], r["rewards/mentions/mean"] + 0.5 * r["rewards/rm/mean"], abs_tol=1e-5)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "llama"


def test_grpo_refuses_one_generation_per_prompt(tmp_path, monkeypatch, capsys):
    from conftest import main_error

    message = main_error(grpo, ["--num_generations", "1", "--output_dir", str(tmp_path / "o")], monkeypatch, capsys)
    assert "--num_generations 1" in message and "at least 2" in message


def _step_over_micro_batches(parts, rewards, batch, a, G=4):
    """One optimizer step's loss and gradient, its rows split into micro-batches `parts` (slices)."""
    logprobs, old, ref, _, mask = batch
    lp = logprobs.clone().requires_grad_()
    advantages = grpo.batch_advantages([rewards[s] for s in parts], G, "batch")
    num_sequences, num_tokens = grpo.batch_normalisers([mask[s] for s in parts])
    loss = sum(grpo.grpo_loss(lp[s], old[s], ref[s], adv, mask[s], a, num_sequences, num_tokens)[0]
               for s, adv in zip(parts, advantages))
    loss.backward()
    return loss.detach(), lp.grad, torch.cat(advantages)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_micro_batches_train_like_one(loss_type):
    """--scale_rewards batch's std and dapo's token count are those of the whole optimizer batch:
    2 micro-batches of b/2 give the loss, gradient and advantages of one micro-batch of b."""
    batch = _random_batch(seed=1, N=16)
    rewards = torch.randn(16, generator=torch.Generator().manual_seed(2)) * torch.arange(16) / 4  # unequal halves
    one = _step_over_micro_batches([slice(0, 16)], rewards, batch, _args(loss_type=loss_type))
    two = _step_over_micro_batches([slice(0, 8), slice(8, 16)], rewards, batch, _args(loss_type=loss_type))
    for x, y in zip(one, two):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("batch_size, note", [
    ("16", "a micro-batch here is --batch_size 16 prompts x --num_generations 8 = 128 completions, which is TRL's "
           "per_device_train_batch_size 128."),
    ("2", "a micro-batch here is --batch_size 2 prompts x --num_generations 8 = 16 completions, which is TRL's "
          "per_device_train_batch_size 16.")])
def test_batch_note_arithmetic(tmp_path, monkeypatch, capsys, batch_size, note):
    """The note for configs ported from TRL: one sentence, our micro-batch in completions and the
    TRL value that equals it (it read as a riddle: "TRL's 2 is not a whole number of groups of 4")."""
    import sys

    monkeypatch.setattr(sys, "argv", ["grpo.py", "--batch_size", batch_size, "--num_generations", "8",
                                      "--dataset", str(tmp_path / "missing.jsonl"), "--output_dir", str(tmp_path / "o")])
    with pytest.raises(SystemExit):  # the note comes first, then the missing dataset stops the run
        grpo.main()
    assert f"grpo: note: {note}" in capsys.readouterr().out


def test_a_fork_says_its_own_name(tmp_path, tiny_qwen, monkeypatch, capsys):
    """cp grpo.py my_grpo.py: its note, progress bar and "saved to" say my_grpo, not grpo."""
    import sys

    from rlhf import tracking

    descs, progress = [], tracking.progress
    monkeypatch.setattr(tracking, "progress", lambda args, start, desc: descs.append(desc) or progress(args, start, desc))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    out = str(tmp_path / "out")
    monkeypatch.setattr(sys, "argv", ["my_grpo.py", "--model", tiny_qwen, "--batch_size", "2", "--num_generations", "2",
                                      "--max_steps", "1", "--max_completion_length", "4", "--output_dir", out])
    capsys.readouterr()
    grpo.main()
    printed = capsys.readouterr().out
    assert descs == ["my_grpo"] and "my_grpo: note: a micro-batch here is --batch_size 2" in printed and "my_grpo: " in printed
    assert f"saved to {out}" in printed and "\ngrpo:" not in "\n" + printed


def test_eval_reward_fn_scores_the_eval_completions_apart(tmp_path, tiny_qwen, monkeypatch, capsys):
    """--eval_reward_fn: every --eval_steps the same greedy eval completions are also scored by a
    function the run does not train on, logged as eval_rewards/<name>/mean and kept out of
    eval_reward and training; a name of a training reward is refused."""
    from conftest import check_eval_reward_fn, eval_reward_files, main_error

    f = eval_reward_files(tmp_path)
    argv = ["--model", tiny_qwen, "--dataset", f["prompts.jsonl"], "--reward_fn", f"{f['r.py']}:length",
            "--eval_dataset", f["eval.jsonl"], "--eval_steps", "2", "--max_steps", "4", "--batch_size", "2",
            "--num_generations", "2", "--max_completion_length", "6", "--learning_rate", "1e-3", "--optim", "adamw"]
    check_eval_reward_fn(grpo, argv, f, str(tmp_path), monkeypatch)
    bad = main_error(grpo, argv + ["--eval_reward_fn", f"{f['r.py']}:length", "--output_dir", str(tmp_path / "clash")],
                     monkeypatch, capsys)
    assert "--eval_reward_fn" in bad and "a reward named 'length' is already among the training rewards" in bad



def test_dynamic_sampling_refills_tied_groups_and_logs_it(tmp_path, tiny_qwen, monkeypatch):
    """--dynamic_sampling: 6 of 8 prompts get the same reward for every completion (a tied group, no
    gradient); every micro-batch grpo_loss trains on still holds --batch_size groups, none tied,
    and metrics.jsonl counts the dropped and refilled groups. Without the flag tied groups train;
    with --max_resample 0 they stay, counted as unfilled."""
    from conftest import run_main

    rows = [{"prompt": f"POST: bob sold the car {i} . TL;DR:", "tie": i < 6} for i in range(8)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "r.py").write_text("def r(completions, tie, **kw):\n"
                                   "    return [1.0 if t else float(len(c)) for c, t in zip(completions, tie)]\n")
    G, B = 4, 2

    def run(out, *flags):
        calls = []
        loss = grpo.grpo_loss
        monkeypatch.setattr(grpo, "grpo_loss", lambda *a, **kw: calls.append(a[3]) or loss(*a, **kw))
        run_main(grpo, ["--model", tiny_qwen, "--dataset", str(tmp_path / "p.jsonl"), "--reward_fn", f"{tmp_path}/r.py:r",
                        "--num_generations", str(G), "--batch_size", str(B), "--gradient_accumulation_steps", "2",
                        "--max_steps", "1", "--max_completion_length", "8", "--optim", "adamw", "--beta", "0",
                        "--output_dir", str(tmp_path / out), *flags], monkeypatch)
        tied = sum(int(grpo.tied_groups(a, G).sum()) for a in calls)  # A == 0 throughout a group: tied rewards
        return calls, tied, _metrics(str(tmp_path / out))

    calls, tied, metrics = run("plain")
    assert tied > 0 and "dynamic_sampling/dropped_groups" not in metrics[0]
    calls, tied, metrics = run("dynamic", "--dynamic_sampling", "--max_resample", "20")
    assert len(calls) == 2 and tied == 0 and all(len(a) == B * G for a in calls)  # both micro-batches trained
    assert sum(m["dynamic_sampling/dropped_groups"] for m in metrics) > 0
    assert sum(m["dynamic_sampling/refilled_groups"] for m in metrics) > 0
    assert all(m["dynamic_sampling/unfilled_groups"] == 0 for m in metrics)
    assert all(m["frac_reward_zero_std"] == 0 for m in metrics)
    # --max_resample 0: no extra rollout; the tied groups stay and are counted as unfilled
    calls, tied, metrics = run("bounded", "--dynamic_sampling", "--max_resample", "0")
    assert tied > 0 and all(len(a) == B * G for a in calls)
    assert all(m["dynamic_sampling/resamples"] == 0 for m in metrics)
    assert sum(m["dynamic_sampling/unfilled_groups"] for m in metrics) > 0
