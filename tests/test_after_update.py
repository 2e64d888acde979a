"""main() checked at a step where the policy has moved: at step 1 the policy, the sampling policy
(pi_old) and the reference are the same weights, so a loss handed two of them swapped gets the
same tensors. Here each script trains past its first update with a large learning rate, a spy
on sampling.completion_logprobs keeps a copy of the policy's weights at every forward, and each
log-prob tensor the loss receives is recomputed from the weights it must come from:

    grpo.py (--num_iterations 2, the second update of the second rollout): log pi from the
        current weights, log pi_old from the weights that sampled the rollout, log pi_ref from
        the starting model;
    ppo.py (2 minibatches, step 2): the KL penalty's log pi from the rollout's weights and
        log pi_ref from the starting model; the policy loss's log pi_old from the rollout's
        weights while log pi has moved on by a minibatch;
    dpo.py (every loss type x the precomputed and the live reference, step 2): the policy's
        chosen and rejected log-probs from the current weights, the reference's from the start;
    reward.py (step 2): the Bradley-Terry loss's scores are the current model's, read on prompt
        + response in one sequence.

At the checked step every pair of these tensors differs, so swapping any two fails."""

import inspect

import pytest
import torch
from conftest import run_main
from test_main_calls import preference_file, prompts_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import common
import dpo
import grpo
import ppo
import reward
from rlhf import sampling


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def record(monkeypatch, events, owner, name, kind):
    """Replace owner.name by a wrapper that appends {"kind", bound arguments, "out"} to `events`."""
    fn = getattr(owner, name)
    signature = inspect.signature(fn)

    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        events.append({"kind": kind, **bound.arguments, "out": out})
        return out

    monkeypatch.setattr(owner, name, wrapper)


def policy_forwards(monkeypatch, events):
    """Every sampling.completion_logprobs call on a trainable model (the policy; a frozen
    reference has no trainable weight): its inputs, its weights at that moment, whether it ran
    with gradient, and its log-probs (N, C)."""
    fn = sampling.completion_logprobs
    signature = inspect.signature(fn)

    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if any(p.requires_grad for p in a["model"].parameters()):
            events.append({"kind": "policy", "weights": snapshot(a["model"]), "grad": torch.is_grad_enabled(),
                           "inputs": {k: a[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                                        "temperature")},
                           "logprobs": out[0] if isinstance(out, tuple) else out})
        return out

    monkeypatch.setattr(sampling, "completion_logprobs", wrapper)


class Recompute:
    """log pi_W(y_t | x, y_<t) of recorded inputs under any recorded weights W (None: the
    starting model, loaded afresh), in a model of its own."""

    def __init__(self, path):
        self.model = common.disable_dropout(AutoModelForCausalLM.from_pretrained(path))
        self.start = snapshot(self.model)

    @torch.no_grad()
    def __call__(self, weights, inputs):
        self.model.load_state_dict(self.start if weights is None else weights)
        return sampling.completion_logprobs(self.model, **inputs)


def close(a, b):
    torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=0, atol=2e-5)


def apart(a, b, masks):
    """The two differ on the real tokens by more than the tolerance above (a swap would show)."""
    return float(((a.detach() - b.detach()).abs() * masks).max()) > 1e-3


def test_grpo_second_update_of_a_reused_rollout(tmp_path, tiny_qwen, monkeypatch):
    """--num_iterations 2, 4 steps of 2 micro-batches: at steps 2 and 4 grpo_loss gets log pi of
    the current weights, log pi_old of the weights that sampled the rollout (steps 1 and 3) and
    log pi_ref of the starting model; at step 4 the three differ."""
    prompts, fn = prompts_file(tmp_path)
    events = []
    policy_forwards(monkeypatch, events)
    record(monkeypatch, events, grpo, "grpo_loss", "loss")
    run_main(grpo, ["--model", tiny_qwen, "--dataset", prompts, "--reward_fn", fn, "--batch_size", "2",
                    "--num_generations", "2", "--gradient_accumulation_steps", "2", "--num_iterations", "2",
                    "--max_steps", "4", "--max_completion_length", "5", "--temperature", "0.9", "--beta", "0.2",
                    "--learning_rate", "3e-2", "--warmup_steps", "0", "--optim", "adamw",
                    "--output_dir", str(tmp_path / "out")], monkeypatch)
    lp = Recompute(tiny_qwen)
    trained = [e for e in events if e["kind"] == "policy" and e["grad"]]
    losses = [e for e in events if e["kind"] == "loss"]
    assert len(losses) == 8
    for k, call in enumerate(losses):
        (now,) = [e for e in trained if e["logprobs"] is call["logprobs"]]
        # the rollout's first update: the first forward on these very completions
        first = next(e for e in trained if e["inputs"]["completion_ids"].shape == now["inputs"]["completion_ids"].shape
                     and torch.equal(e["inputs"]["completion_ids"], now["inputs"]["completion_ids"]))
        assert (first is now) == (k // 2 % 2 == 0)  # steps 1 and 3 start a rollout
        close(call["old_logprobs"], lp(first["weights"], now["inputs"]))
        close(call["ref_logprobs"], lp(None, now["inputs"]))
        close(call["logprobs"], lp(now["weights"], now["inputs"]))
        if k >= 6:  # step 4: pi, pi_old and pi_ref are three different models
            m = call["completion_mask"].float()
            assert apart(call["logprobs"], call["old_logprobs"], m) and apart(call["old_logprobs"], call["ref_logprobs"], m)
            assert apart(call["logprobs"], call["ref_logprobs"], m)


def test_ppo_second_rollout_and_second_minibatch(tmp_path, tiny_qwen, monkeypatch):
    """2 steps of 2 minibatches: per_token_rewards' log pi are the rollout's weights' and its
    log pi_ref the starting model's; each policy_loss call's log pi_old are the rollout's weights'
    on the minibatch's rows, and at step 2's second minibatch log pi has moved away from both."""
    prompts, fn = prompts_file(tmp_path)
    events = []
    policy_forwards(monkeypatch, events)
    record(monkeypatch, events, ppo, "per_token_rewards", "rewards")
    record(monkeypatch, events, ppo, "policy_loss", "pg")
    run_main(ppo, ["--model", tiny_qwen, "--dataset", prompts, "--reward_fn", fn, "--batch_size", "2",
                   "--gradient_accumulation_steps", "1", "--num_mini_batches", "2", "--num_ppo_epochs", "1",
                   "--max_steps", "2", "--max_completion_length", "5", "--temperature", "0.9", "--kl_coef", "0.2",
                   "--learning_rate", "3e-2", "--warmup_steps", "0", "--optim", "adamw",
                   "--output_dir", str(tmp_path / "out")], monkeypatch)
    lp = Recompute(tiny_qwen)
    rollout, checked = [], 0
    for i, e in enumerate(events):
        if e["kind"] == "policy" and not e["grad"]:
            rollout = rollout + [e] if rollout and events[i - 1]["kind"] == "policy" and not events[i - 1]["grad"] else [e]
        elif e["kind"] == "rewards":  # the KL penalty of this rollout: its own weights against the start
            weights = rollout[0]["weights"]
            close(e["logprobs"], torch.cat([lp(weights, r["inputs"]) for r in rollout]))
            close(e["ref_logprobs"], torch.cat([lp(None, r["inputs"]) for r in rollout]))
            if checked:  # step 2: the rollout's weights have moved away from the start
                assert apart(e["logprobs"], e["ref_logprobs"], e["completion_mask"])
        elif e["kind"] == "pg":
            (now,) = [f for f in events[:i] if f["kind"] == "policy" and f["logprobs"] is e["logprobs"]]
            close(e["old_logprobs"], lp(rollout[0]["weights"], now["inputs"]))
            close(e["logprobs"], lp(now["weights"], now["inputs"]))
            checked += 1
            if checked == 4:  # step 2, second minibatch: one update past the rollout's weights
                assert apart(e["logprobs"], e["old_logprobs"], e["mask"])
    assert checked == 4


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("reference", ["precomputed", "live"])
def test_dpo_policy_and_reference_at_step_two(tmp_path, tiny_qwen, monkeypatch, loss_type, reference):
    """2 steps of 2 micro-batches: dpo_loss gets the current weights' chosen and rejected
    log-probs and the starting model's (precomputed or from the live frozen copy), as pair_logps
    forms them (sums; per-token means for ipo) from the rows c_0, r_0, c_1, r_1, ..."""
    events = []
    policy_forwards(monkeypatch, events)
    record(monkeypatch, events, dpo, "dpo_loss", "loss")
    run_main(dpo, ["--model", tiny_qwen, "--dataset", preference_file(tmp_path), "--batch_size", "2",
                   "--gradient_accumulation_steps", "2", "--max_steps", "2", "--loss_type", loss_type, "--beta", "0.3",
                   "--learning_rate", "3e-2", "--warmup_steps", "0", "--optim", "adamw", "--rpo_alpha", "0",
                   *([] if reference == "precomputed" else ["--no_precompute_ref_logps"]),
                   "--output_dir", str(tmp_path / "out")], monkeypatch)
    lp = Recompute(tiny_qwen)

    def pairs(weights, inputs):  # (B,), (B,): chosen and rejected, transcribed from pair_logps' contract
        per_token = lp(weights, inputs)
        mask = inputs["completion_mask"].float()
        logps = per_token.sum(1) / (mask.sum(1) if loss_type == "ipo" else 1)
        return logps[0::2], logps[1::2]

    losses = [i for i, e in enumerate(events) if e["kind"] == "loss"]
    assert len(losses) == 4
    for k, i in enumerate(losses):
        call = events[i]
        now = [e for e in events[:i] if e["kind"] == "policy" and e["grad"]][-1]
        chosen, rejected = pairs(now["weights"], now["inputs"])
        ref_chosen, ref_rejected = pairs(None, now["inputs"])
        close(call["chosen_logps"], chosen)
        close(call["rejected_logps"], rejected)
        close(call["ref_chosen_logps"], ref_chosen)
        close(call["ref_rejected_logps"], ref_rejected)
        if k >= 2:  # step 2: the policy has moved away from the reference
            one = torch.ones_like(chosen)
            assert apart(call["chosen_logps"], call["ref_chosen_logps"], one)
            assert apart(call["rejected_logps"], call["ref_rejected_logps"], one)


def test_reward_scores_at_step_two_are_the_current_models(tmp_path, tiny_qwen, monkeypatch):
    """2 steps: bradley_terry_loss gets pair_scores' chosen and rejected scores, which are the
    current model's scores of prompt + response read as one sequence at its last token; at step 2
    they differ from the starting model's."""
    events = []
    record(monkeypatch, events, reward, "bradley_terry_loss", "loss")
    original = reward.pair_scores

    def scores_with_weights(model, tokenizer, triples, args):
        events.append({"kind": "weights", "weights": snapshot(model), "triples": triples})
        return original(model, tokenizer, triples, args)

    monkeypatch.setattr(reward, "pair_scores", scores_with_weights)
    run_main(reward, ["--model", tiny_qwen, "--dataset", preference_file(tmp_path), "--batch_size", "3", "--max_steps", "2",
                      "--eval_steps", "0", "--test_size", "0.25", "--learning_rate", "3e-2", "--warmup_steps", "0",
                      "--optim", "adamw", "--output_dir", str(tmp_path / "out")], monkeypatch)
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    model = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "out"), num_labels=1)
    start = None
    trained = [i for i, e in enumerate(events) if e["kind"] == "loss" and e["chosen_rewards"].requires_grad]
    assert len(trained) == 2
    for k, i in enumerate(trained):
        call, scored = events[i], events[i - 1]
        model.load_state_dict(scored["weights"])
        start = start or scored["weights"]

        @torch.no_grad()
        def one_sequence(response):  # prompt + response (+ EOS, as encode_completions adds it), one forward
            out = []
            for p, c, r in scored["triples"]:
                ids = tok(p + (c if response == "chosen" else r), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                x = torch.tensor([ids])
                out.append(sampling.sequence_scores(model, x, torch.ones_like(x))[0])
            return torch.stack(out)

        close(call["chosen_rewards"], one_sequence("chosen"))
        close(call["rejected_rewards"], one_sequence("rejected"))
        if k == 1:
            moved = scored["weights"]
            assert any(not torch.equal(moved[n], start[n]) for n in moved)
            model.load_state_dict(start)
            assert float((one_sequence("chosen") - call["chosen_rewards"].detach()).abs().max()) > 1e-3
