"""dpo.py: the loss against the equations, the step-0 invariant, precomputed == live reference,
and the script end to end (offline and online) at tiny size, through subprocess."""

import copy
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import run_script

import common
import dpo
from rlhf import sampling
from worlds import world


def _metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _args(**kw):
    base = dict(max_prompt_length=512, max_completion_length=256, eval_batch_size=3, loss_type="sigmoid")
    return SimpleNamespace(**{**base, **kw})


def _pairs(n=8):
    prefs = world.build_world(0, sizes={"sft": 1, "prefs": n, "contrast": 0, "rl": 1, "test": 1})["prefs"]
    return prefs["prompt"], prefs["chosen"], prefs["rejected"]


# ------------------------------------------------------------------ the loss against the equations
def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


def _transcribed(h, beta, loss_type, eps):
    """Loss of one pair and its derivative in h = log pi/ref(y_w) - log pi/ref(y_l), written
    out from the papers' equations by hand (DPO Eq. 7 + cDPO, robust DPO Eq. 9, IPO Eq. 17)."""
    if loss_type == "sigmoid":
        loss = -(1 - eps) * math.log(_sigmoid(beta * h)) - eps * math.log(_sigmoid(-beta * h))
        grad = -(1 - eps) * beta * _sigmoid(-beta * h) + eps * beta * _sigmoid(beta * h)
    elif loss_type == "robust":
        loss = (-(1 - eps) * math.log(_sigmoid(beta * h)) + eps * math.log(_sigmoid(-beta * h))) / (1 - 2 * eps)
        grad = (-(1 - eps) * beta * _sigmoid(-beta * h) - eps * beta * _sigmoid(beta * h)) / (1 - 2 * eps)
    else:
        loss, grad = (h - 1 / (2 * beta)) ** 2, 2 * (h - 1 / (2 * beta))
    return loss, grad


def test_dpo_loss_on_a_hand_computed_pair():
    # log pi(y_w) = -10, log pi(y_l) = -12, both -11 under the reference: h = 1 - (-1) = 2
    losses, chosen_rewards, rejected_rewards = dpo.dpo_loss(
        torch.tensor([-10.0]), torch.tensor([-12.0]), torch.tensor([-11.0]), torch.tensor([-11.0]), beta=0.1)
    assert losses.item() == pytest.approx(math.log(1 + math.exp(-0.2)), abs=1e-6)  # -log sigmoid(0.1 * 2)
    assert chosen_rewards.item() == pytest.approx(0.1) and rejected_rewards.item() == pytest.approx(-0.1)


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("robust", 0.2), ("ipo", 0.0)])
def test_dpo_loss_and_gradient_match_the_equations(loss_type, eps):
    torch.manual_seed(0)
    beta = 0.3
    logps = [(torch.randn(6, dtype=torch.float64) * 5 - 20).requires_grad_() for _ in range(2)]
    ref = [torch.randn(6, dtype=torch.float64) * 5 - 20 for _ in range(2)]
    losses, _, _ = dpo.dpo_loss(logps[0], logps[1], ref[0], ref[1], beta, loss_type, eps)
    losses.mean().backward()
    h = ((logps[0] - ref[0]) - (logps[1] - ref[1])).tolist()
    expected = [_transcribed(x, beta, loss_type, eps) for x in h]
    torch.testing.assert_close(losses.detach(), torch.tensor([e[0] for e in expected], dtype=torch.float64))
    # d mean(L) / d log pi(y_w) = L'(h) / B, and the opposite for y_l
    grad = torch.tensor([e[1] / len(h) for e in expected], dtype=torch.float64)
    torch.testing.assert_close(logps[0].grad, grad)
    torch.testing.assert_close(logps[1].grad, -grad)


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("robust", 0.1)])
def test_step_zero_loss_is_ln2_and_margins_are_zero(loss_type, eps):
    """Before any update the policy is the reference: every implicit reward is 0."""
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2).train()
    prompts, chosen, rejected = _pairs(8)
    args = _args(loss_type=loss_type)
    cache = dpo.precompute_ref_logps(model, tok, prompts, chosen, rejected, args)  # batches of 3
    idx = [5, 0, 2, 7]
    batch = dpo.encode_pairs(tok, [prompts[i] for i in idx], [chosen[i] for i in idx], [rejected[i] for i in idx], args,
                             [tok.eos_token_id])
    chosen_logps, rejected_logps = dpo.pair_logps(model, batch, loss_type)
    losses, chosen_rewards, rejected_rewards = dpo.dpo_loss(
        chosen_logps, rejected_logps, *cache[idx].unbind(1), 0.1, loss_type, eps)
    assert losses.mean().item() == pytest.approx(math.log(2), abs=1e-5)
    assert (chosen_rewards - rejected_rewards).abs().max() < 1e-5
    assert (chosen_logps < 0).all() and not torch.allclose(chosen_logps, rejected_logps)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_precomputed_and_live_reference_give_the_same_loss(loss_type):
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2).train()
    prompts, chosen, rejected = _pairs(8)
    args = _args(loss_type=loss_type)
    cache = dpo.precompute_ref_logps(model, tok, prompts, chosen, rejected, args)
    ref_model = common.freeze(copy.deepcopy(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # train the policy away from the reference
    idx = [6, 1, 3, 4]
    batch = dpo.encode_pairs(tok, [prompts[i] for i in idx], [chosen[i] for i in idx], [rejected[i] for i in idx], args,
                             [tok.eos_token_id])
    for _ in range(2):
        c, r = dpo.pair_logps(model, batch, loss_type)
        dpo.dpo_loss(c, r, *cache[idx].unbind(1), 0.1, loss_type)[0].mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    chosen_logps, rejected_logps = dpo.pair_logps(model, batch, loss_type)
    precomputed = dpo.dpo_loss(chosen_logps, rejected_logps, *cache[idx].unbind(1), 0.1, loss_type)[0]
    with torch.no_grad():
        live = dpo.dpo_loss(chosen_logps, rejected_logps, *dpo.pair_logps(ref_model, batch, loss_type), 0.1, loss_type)[0]
    torch.testing.assert_close(precomputed, live, atol=1e-5, rtol=1e-5)
    assert abs(precomputed.mean().item() - (math.log(2) if loss_type == "sigmoid" else 25.0)) > 1e-3  # it moved
    if loss_type == "ipo":  # IPO reads per-token means of the log-probs, the sigmoid loss their sums
        sums = dpo.pair_logps(model, batch, "sigmoid")
        lengths = batch["completion_mask"].sum(1).view(2, -1)  # (2, B): chosen rows first, then rejected
        torch.testing.assert_close(chosen_logps, sums[0] / lengths[0])
        torch.testing.assert_close(rejected_logps, sums[1] / lengths[1])


def test_rpo_nll_is_the_per_token_nll_of_the_chosen_responses():
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2)
    prompts, chosen, rejected = _pairs(4)
    batch = dpo.encode_pairs(tok, list(prompts), list(chosen), list(rejected), _args(), [tok.eos_token_id])
    chosen_logps, _ = dpo.pair_logps(model, batch, "sigmoid")
    c_mask = batch["completion_mask"][:4]
    nll = dpo.chosen_nll(chosen_logps, c_mask, "sigmoid")
    # the same number from a full log-softmax: mean over pairs of each chosen response's token mean
    p_ids, p_mask, c_ids = batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"][:4]
    ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=sampling.position_ids(mask)).logits
    logp = torch.log_softmax(logits[:, p_ids.shape[1] - 1:-1].float(), -1).gather(-1, c_ids[..., None]).squeeze(-1)
    expected = -((logp * c_mask).sum(1) / c_mask.sum(1)).mean()
    torch.testing.assert_close(nll, expected, atol=1e-5, rtol=1e-5)
    ipo_logps, _ = dpo.pair_logps(model, batch, "ipo")  # ipo's log-probs are already token means
    torch.testing.assert_close(dpo.chosen_nll(ipo_logps, c_mask, "ipo"), expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ end to end
def _write_prefs(path, n=12):
    prompts, chosen, rejected = _pairs(n)
    with open(path, "w") as f:
        for p, c, r in zip(prompts, chosen, rejected):
            f.write(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n")


def test_offline_precompute_on_and_off_train_identically(tmp_path, tiny_qwen):
    data = tmp_path / "prefs.jsonl"
    _write_prefs(data)
    runs = {}
    for flag in ("--precompute_ref_logps", "--no_precompute_ref_logps"):
        out = str(tmp_path / flag.strip("-"))
        run_script("dpo.py", "--model", tiny_qwen, "--dataset", str(data), "--output_dir", out, "--max_steps", "3",
                   "--batch_size", "4", "--learning_rate", "1e-2", "--warmup_steps", "0", "--optim", "adamw", flag,
                   "--max_completion_length", "6", "--rpo_alpha", "0")  # plain DPO, said (on the summarization world the toy policy gets RPO)
        runs[flag] = (_metrics(out), json.load(open(os.path.join(out, "summary.json"))))
    (on, on_summary), (off, off_summary) = runs.values()
    assert [r["step"] for r in on] == [1, 2, 3]
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                "logps/chosen", "logps/rejected", "grad_norm", "learning_rate"):
        assert key in on[0], key
    assert on[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and abs(on[0]["rewards/margins"]) < 1e-5
    assert [r["loss"] for r in on] == pytest.approx([r["loss"] for r in off], abs=1e-4)
    assert abs(on[-1]["rewards/margins"]) > 1e-3  # the policy moved away from the reference
    # precompute on: training holds one model; off: policy + reference
    assert on_summary["models_alive"] == 1 and off_summary["models_alive"] == 2
    assert on_summary["completions_truncated"] == off_summary["completions_truncated"] > 0  # cut responses are counted
    assert off_summary["model_bytes"] == 2 * on_summary["model_bytes"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "precompute_ref_logps")).config.model_type == "qwen2"


def test_offline_on_conversational_preferences(tmp_path, tiny_llama):
    data = tmp_path / "prefs.jsonl"
    user = {"role": "user", "content": "POST: alice bought the bike . TL;DR:"}
    with open(data, "w") as f:
        for i in range(6):  # no prompt column: the shared turns before the last are the prompt
            f.write(json.dumps({"chosen": [user, {"role": "assistant", "content": "alice bought bike ."}],
                                "rejected": [user, {"role": "assistant", "content": "bob lost phone ."}]}) + "\n")
    out = str(tmp_path / "dpo_chat")
    proc = run_script("dpo.py", "--model", tiny_llama, "--dataset", str(data), "--output_dir", out,
                      "--max_steps", "3", "--batch_size", "2", "--learning_rate", "3e-3", "--warmup_steps", "0",
                      "--loss_type", "ipo", "--optim", "adamw")  # at 1e-2 the third step overshoots (margin 0.066 -> -0.013)
    assert "6 preference pairs" in proc.stdout
    rows = _metrics(out)
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]
    assert "gold_score" not in json.load(open(os.path.join(out, "summary.json")))


def test_online_end_to_end_with_a_reward_function(tmp_path, tiny_qwen):
    fn = tmp_path / "judge.py"
    fn.write_text("def distinct_words(prompts, completions, post, **kw):\n"
                  "    assert len(post) == len(prompts)  # dataset columns reach the judge\n"
                  "    return [float(len(set(c.split()))) for c in completions]\n")
    out = str(tmp_path / "online")
    proc = run_script("dpo.py", "--online", "--model", tiny_qwen, "--reward_fn", f"{fn}:distinct_words",
                      "--output_dir", out, "--max_steps", "2", "--batch_size", "6", "--max_new_tokens", "8",
                      "--eval_batch_size", "200", "--optim", "adamw")
    assert "2000 prompts" in proc.stdout  # the embedded world's rl split
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("loss", "rewards/margins", "rewards/accuracies", "objective/scores", "ties", "val/contain_eos_token"):
        assert key in rows[0], key
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # the reference is the initial policy
    assert 0 <= rows[0]["ties"] < 6 and rows[0]["objective/scores"] > 0
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert -1 <= summary["gold_score"] <= 1 and summary["models_alive"] == 2


def _online_args(**kw):
    base = dict(max_prompt_length=512, max_new_tokens=6, temperature=1.0, eval_batch_size=64, loss_type="sigmoid",
                reward_model="", reward_fn="", reward_weights="", max_steps=1, dtype="float32", attn_implementation="sdpa", trust_remote_code=False,
                top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, seed=0)
    return SimpleNamespace(**{**base, **kw})


def test_online_pairs_put_the_judges_winner_first_and_skip_ties():
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=1)
    rl = world.build_world(0, sizes={"sft": 1, "prefs": 1, "contrast": 0, "rl": 8, "test": 1})["rl"]
    calls = []

    def judge(prompts, completions, completion_ids, columns, step=0):  # ties on the first prompt, the word count elsewhere
        calls.append((prompts, completions, completion_ids, columns))
        return torch.tensor([0.0 if p == prompts[0] else float(len(c.split())) for p, c in zip(prompts, completions)])

    rl_prompts, posts = list(rl["prompt"]), list(rl["post"])
    # seed 4 (sampling.generate's noise): 3 of the 8 random pairs differ in length, 5 tie
    batch, stats, samples = dpo.sample_pairs(model, tok, rl_prompts, {"post": posts}, judge, _online_args(seed=4), (0, 0))
    prompts, completions, ids, columns = calls[0]
    twice = [p for p in rl_prompts for _ in (0, 1)]  # the two samples of a prompt are adjacent rows
    assert prompts == twice and columns["post"] == [p for p in posts for _ in (0, 1)]
    scores = judge(prompts, completions, ids, columns).view(-1, 2).t()  # (2, B): first and second samples
    n = 8 - stats["ties"]
    assert stats["ties"] == int((scores[0] == scores[1]).sum()) >= 1
    prompt_ids, completion_ids, completion_mask = batch["prompt_ids"], batch["completion_ids"], batch["completion_mask"]
    assert samples[0] == twice and samples[2].tolist() == judge(prompts, completions, ids, columns).tolist()  # --log_completions
    assert prompt_ids.shape[0] == n and completion_ids.shape[0] == 2 * n
    last = completion_ids.gather(1, completion_mask.sum(1, keepdim=True) - 1).squeeze(1)  # EOS unless truncated
    texts = dpo.sampling.decode_completions(tok, completion_ids, completion_mask, last != tok.eos_token_id)
    words = torch.tensor([len(t.split()) for t in texts])
    assert (words[:n] > words[n:]).all()  # chosen (first half) beat rejected (second half)


def test_online_judge_from_a_reward_model(tmp_path):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = world.build_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    judge, rm = dpo.make_judge(_online_args(reward_model=str(tmp_path)), True)
    prompts = ["POST: alice bought the bike .\nTL;DR:"] * 2
    scores = judge(prompts, [" alice bought bike .", " bob lost phone ."], None, {})
    assert scores.shape == (2,) and scores[0] != scores[1] and not rm.training
    with pytest.raises(SystemExit, match="needs a judge"):
        dpo.make_judge(_online_args(), False)


def _main(monkeypatch, *argv):
    monkeypatch.setattr("sys.argv", ["dpo.py", *argv])
    with pytest.raises(SystemExit) as e:
        dpo.main()
    return str(e.value)


def test_bad_input_stops_with_a_clear_message(tmp_path, tiny_qwen, monkeypatch):
    data = tmp_path / "no_rejected.jsonl"
    data.write_text('{"prompt": "POST: alice bought the bike . TL;DR:", "chosen": " alice bought bike ."}\n')
    message = _main(monkeypatch, "--model", tiny_qwen, "--dataset", str(data), "--output_dir", str(tmp_path / "o"))
    assert "no column 'rejected'" in message and "no_rejected.jsonl" in message
    assert "--loss_type 'hinge'" in _main(monkeypatch, "--model", tiny_qwen, "--loss_type", "hinge")
    assert "--label_smoothing" in _main(monkeypatch, "--model", tiny_qwen, "--label_smoothing", "0.5")
    assert "add --online" in _main(monkeypatch, "--model", tiny_qwen, "--reward_fn", "gold")
