"""What a TRL user reaches for (issue #19): the sampling knobs reach the sampler, GSPO's
sequence-level ratio and the bnpo / cispo losses against direct transcriptions of their
equations, multi-turn SFT trains exactly the assistant turns, logged values are window means
with a cumulative num_tokens, trackers are checked before anything loads, the small knobs
(chat_template_kwargs, num_train_epochs, save_total_limit, --help), and grpo.py end to end as a
new user runs it (samples, eval lines, completions.jsonl)."""

import json
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import chat_tokenizer, run_script

from rlhf import checkpoints
import common
from rlhf import data
import grpo
from rlhf import rollouts, sampling
from rlhf import tracking
from worlds import world


# ------------------------------------------------------------------ sampling knobs
def test_min_p_and_repetition_penalty_filter_the_logits():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0], [0.2, -2.0, 1.0, 0.9]])
    # min_p 0.5: only tokens at least half as probable as the best survive (row 0: tokens 0 and 1)
    torch.manual_seed(0)
    draws = torch.stack([sampling._next_token(logits, 1.0, 1.0, 0, True, min_p=0.5) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {0, 1} and set(draws[:, 1].tolist()) == {2, 3}
    # repetition penalty 4 (HF's rule): a seen positive logit is divided, a seen negative one multiplied
    seen = torch.tensor([[True, False, False, False], [False, False, True, False]])
    greedy = sampling._next_token(logits, 1.0, 1.0, 0, False, repetition_penalty=4.0, seen=seen)
    assert greedy.tolist() == [1, 3]  # 3 / 4 < 2.9 and 1 / 4 < 0.9
    assert sampling._next_token(logits, 1.0, 1.0, 0, False).tolist() == [0, 2]


def test_knobs_reach_generate():
    tok = world.build_tokenizer()
    model = world.build_model(tok, hidden_size=64, num_layers=2)
    ids, mask = data.encode_prompts(tok, ["POST: alice bought the bike . TL;DR:", "POST: bob lost it . TL;DR:"])
    greedy, gm, _ = sampling.generate(model, tok, ids, mask, 12, do_sample=False)
    args = SimpleNamespace(top_p=1.0, top_k=1, min_p=0.0, repetition_penalty=1.0, seed=0)
    top1, _, _ = sampling.generate(model, tok, ids, mask, 12, **rollouts.sampling_kwargs(args, step=0))  # top_k 1 == greedy
    assert torch.equal(top1, greedy)
    args = SimpleNamespace(top_p=1.0, top_k=0, min_p=0.999, repetition_penalty=1.0, seed=0)
    top1, _, _ = sampling.generate(model, tok, ids, mask, 12, **rollouts.sampling_kwargs(args, step=0))  # min_p ~1 == greedy
    assert torch.equal(top1, greedy)
    # a huge repetition penalty: no token of the prompt or of the completion comes twice (before EOS)
    out, om, _ = sampling.generate(model, tok, ids, mask, 12, do_sample=False, repetition_penalty=1e6)
    for row, m, p in zip(out.tolist(), om.tolist(), ids.tolist()):
        toks = [t for t, k in zip(row, m) if k and t != tok.eos_token_id]
        assert len(set(toks)) == len(toks) and not set(toks) & set(p)


# ------------------------------------------------------------------ GRPO: GSPO, bnpo, cispo
def _args(**kw):
    base = dict(epsilon=0.2, epsilon_high=0.28, dual_clip_c=3.0, beta=0.04, loss_type="grpo",
                max_completion_length=7, importance_sampling_level="token")
    return SimpleNamespace(**{**base, **kw})


def _batch(seed=0, N=8, C=7):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(N, C, generator=g) * 3
    old = logprobs + torch.randn(N, C, generator=g) * 0.6
    ref = logprobs + torch.randn(N, C, generator=g) * 0.5
    adv = torch.randn(N, generator=g)
    lengths = torch.randint(1, C + 1, (N,), generator=g)
    return logprobs, old, ref, adv, (torch.arange(C)[None] < lengths[:, None]).long()


def _transcribed(logprobs, old, ref, adv, mask, a, micro_batches=1):
    """GSPO (Zheng et al. 2025), CISPO (MiniMax-M1 technical report) and the bnpo / dapo / grpo
    normalisers, token by token in plain Python."""
    N, C = logprobs.shape
    rows = []  # (sum over tokens of l_t, number of tokens) per completion
    for i in range(N):
        A = float(adv[i])
        ts = [t for t in range(C) if mask[i, t]]
        s_i = math.exp(sum(float(logprobs[i, t] - old[i, t]) for t in ts) / len(ts))
        s_sum = math.exp(sum(float(logprobs[i, t] - old[i, t]) for t in ts))  # TRL's RLOOTrainer: the sequence's ratio
        total = 0.0
        for t in ts:
            lp, o, rf = float(logprobs[i, t]), float(old[i, t]), float(ref[i, t])
            r = {"sequence": s_i, "sequence_sum": s_sum}.get(a.importance_sampling_level, math.exp(lp - o))
            if a.loss_type == "cispo":
                l_t = -min(r, 1 + a.epsilon_high) * A * lp
            else:
                s = min(r * A, min(max(r, 1 - a.epsilon), 1 + a.epsilon_high) * A)
                if A < 0:
                    s = max(s, a.dual_clip_c * A)
                l_t = -s
            total += l_t + a.beta * (math.exp(rf - lp) - (rf - lp) - 1)
        rows.append((total, len(ts)))
    if a.loss_type == "grpo":
        return sum(t / n for t, n in rows) / N
    if a.loss_type == "bnpo":  # token mean per micro-batch, mean over the micro-batches
        size = N // micro_batches
        parts = [rows[k:k + size] for k in range(0, N, size)]
        return sum(sum(t for t, _ in p) / sum(n for _, n in p) for p in parts) / len(parts)
    return sum(t for t, _ in rows) / sum(n for _, n in rows)  # dapo, cispo


@pytest.mark.parametrize("loss_type,level", [("grpo", "sequence"), ("dapo", "sequence"), ("grpo", "sequence_sum"), ("bnpo", "token"),
                                             ("cispo", "token"), ("cispo", "sequence")])
def test_gspo_bnpo_cispo_match_their_equations(loss_type, level):
    a = _args(loss_type=loss_type, importance_sampling_level=level)
    logprobs, old, ref, adv, mask = _batch(2)
    assert mask[:4].sum() != mask[4:].sum()  # micro-batches of unequal token counts: bnpo differs from dapo
    loss, _ = grpo.grpo_loss(logprobs, old, ref, adv, mask, a)
    assert math.isclose(float(loss), _transcribed(logprobs, old, ref, adv, mask, a), rel_tol=1e-5, abs_tol=1e-6)
    # two micro-batches with the whole batch's normalisers: bnpo is the mean of their token means
    parts = [grpo.grpo_loss(logprobs[s], old[s], ref[s], adv[s], mask[s], a, num_sequences=8, num_tokens=mask.sum())[0]
             for s in (slice(0, 4), slice(4, 8))]
    assert math.isclose(float(sum(parts)), _transcribed(logprobs, old, ref, adv, mask, a, micro_batches=2),
                        rel_tol=1e-5, abs_tol=1e-6)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # ratio 5 with A > 0: the clipped surrogate has no gradient there; CISPO's capped weight keeps one
    logprobs = torch.tensor([[0.0, -0.5]], requires_grad=True)
    old = torch.tensor([[math.log(1 / 5.0), -0.5]])  # ratios 5 and 1
    mask, adv = torch.ones(1, 2, dtype=torch.long), torch.tensor([1.0])
    for loss_type, expect_grad in (("dapo", False), ("cispo", True)):
        logprobs.grad = None
        grpo.grpo_loss(logprobs, old, None, adv, mask, _args(loss_type=loss_type, beta=0.0))[0].backward()
        assert (logprobs.grad[0, 0] != 0) == expect_grad
    assert math.isclose(float(logprobs.grad[0, 0]), -1.28 / 2, rel_tol=1e-6)  # -sg(min(r, 1.28)) A / tokens
    # the weight is a constant (stop-gradient): token 2's gradient is -1 * A / 2, with no r * A * log pi term
    assert math.isclose(float(logprobs.grad[0, 1]), -1 / 2, rel_tol=1e-6)


# ------------------------------------------------------------------ multi-turn SFT
def test_every_assistant_turn_is_trained_and_nothing_else(tmp_path):
    tok = chat_tokenizer()
    u, a = (lambda c: {"role": "user", "content": c}), (lambda c: {"role": "assistant", "content": c})
    msgs = [u("alice bought the bike"), a("alice bought bike ."), u("what did bob do ?"), a("bob lost phone ."),
            u("so ?"), a("nice .")]
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"messages": msgs}) + "\n" + json.dumps({"prompt": "POST: x", "completion": " bike ."}) + "\n")
    ds = data.load_data(str(path)).select([0])
    (prompt, completion), = data.sft_pairs(ds, str(path))
    assert prompt == msgs[:1] and completion == msgs[1:]
    turns = data.render_turns(tok, prompt, completion)
    assert "".join(t for t, _ in turns) == data.render_completion(tok, prompt, completion)
    ids, mask, loss_mask = data.encode_turns(tok, [turns, [(" bike .", True)]])
    trained = [tok.convert_ids_to_tokens(t) for t, k in zip(ids[0].tolist(), loss_mask[0].tolist()) if k]
    masked = [tok.convert_ids_to_tokens(t) for t, m, k in zip(ids[0].tolist(), mask[0].tolist(), loss_mask[0].tolist())
              if m and not k]
    # (each word with its leading space is one added token, " alice"; the template writes a space
    # around each turn, which the byte-level tokenizer keeps as the byte "Ġ")
    assert trained == [" alice", " bought", " bike", " .", "Ġ", "<eos>", "Ġ", " bob", " lost", " phone", " .", "Ġ",
                       "<eos>", "Ġ", " nice", " .", "Ġ", "<eos>", "Ġ"]
    assert masked == ["<|user|>", " what", " did", " bob", " do", " ?", "Ġ", "<|assistant|>", "<|user|>", " so", " ?", "Ġ",
                      "<|assistant|>"]
    # prompt + completion rows: every completion token (and EOS) is trained, as before
    plain_ids, plain_mask = data.encode_completions(tok, [" bike ."])
    assert torch.equal(ids[1, :plain_ids.shape[1]], plain_ids[0]) and torch.equal(loss_mask[1, :plain_ids.shape[1]], plain_mask[0])


# ------------------------------------------------------------------ logging
def test_logged_values_are_window_means_and_num_tokens_is_cumulative(tmp_path):
    logger = tracking.MetricsLogger(SimpleNamespace(output_dir=str(tmp_path), report_to="none"))
    for step, (loss, n) in enumerate([(1.0, 10), (2.0, 20), (6.0, 30), (4.0, 5)], 1):
        logger.update({"loss": torch.tensor(loss), **({"ties": 2} if step == 2 else {})}, num_tokens=n)
        if step % 3 == 0 or step == 4:
            logger.log(step, {"learning_rate": 0.1})
    logger.log_eval(4, {"eval_loss": 0.5})
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert lines[0] == {"step": 3, "loss": 3.0, "ties": 2.0, "learning_rate": 0.1, "num_tokens": 60}
    assert lines[1] == {"step": 4, "loss": 4.0, "learning_rate": 0.1, "num_tokens": 65}
    assert lines[2] == {"step": 4, "eval_loss": 0.5}
    # a resumed run continues the count from the lines it keeps
    resumed = tracking.MetricsLogger(SimpleNamespace(output_dir=str(tmp_path), report_to="none"), start_step=3)
    resumed.update({"loss": 1.0}, num_tokens=7)
    resumed.log(4)
    assert [json.loads(x)["num_tokens"] for x in open(tmp_path / "metrics.jsonl")] == [60, 67]


# ------------------------------------------------------------------ arguments
def _parse(monkeypatch, cls, *argv):
    monkeypatch.setattr(sys, "argv", ["sft.py", *argv])
    return common.parse_args(cls)


def test_tracker_is_checked_before_anything_loads(monkeypatch):
    import importlib.util

    import sft

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    for tracker in ("tensorboard", "wandb"):
        with pytest.raises(SystemExit) as e:  # parse_args runs before any model or data is loaded
            _parse(monkeypatch, sft.Args, "--report_to", tracker, "--model", "no/such/model/folder")
        assert f"pip install {tracker}" in str(e.value.code)


def test_small_knobs(monkeypatch, tmp_path, capsys):
    import eval as eval_script
    import sft

    args = _parse(monkeypatch, sft.Args, "--chat_template_kwargs", '{"enable_thinking": false}', "--num_train_epochs", "2.5")
    assert common.CHAT_TEMPLATE_KWARGS == {"enable_thinking": False}
    tok = chat_tokenizer()
    tok.chat_template = "{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}" + tok.chat_template
    assert data.render_prompt(tok, [{"role": "user", "content": "x"}]).startswith("NOTHINK ")
    data.set_max_steps(args, 10, 4)  # ceil(2.5 * 10 / 4)
    assert args.max_steps == 7
    with pytest.raises(SystemExit, match="not valid JSON"):
        _parse(monkeypatch, sft.Args, "--chat_template_kwargs", "{enable_thinking: false}")
    with pytest.raises(SystemExit, match="not both"):
        _parse(monkeypatch, sft.Args, "--num_train_epochs", "1", "--max_steps", "3")
    common.CHAT_TEMPLATE_KWARGS.clear()
    # --save_total_limit: the newest ones stay
    for step in (5, 10, 15):
        os.makedirs(tmp_path / f"checkpoint-{step}")
    checkpoints.delete_old_checkpoints(str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10", "checkpoint-15"]
    # eval.py's flags are its own: no training flags; empty defaults print no "(default: )"
    names = set(eval_script.Args.__dataclass_fields__)
    assert not names & {"learning_rate", "max_steps", "optim", "save_steps", "resume", "report_to", "eval_steps"}
    monkeypatch.setattr(sys, "argv", ["sft.py", "--help"])
    with pytest.raises(SystemExit):
        common.parse_args(sft.Args)
    help_text = capsys.readouterr().out
    assert "runs/<script>)." in " ".join(help_text.split()) and "(default: )" not in help_text


# ------------------------------------------------------------------ end to end, as a new user
def test_grpo_on_a_foreign_llama_with_samples_and_eval(tmp_path, tiny_llama):
    names = ["alice", "bob", "carol", "dave"]
    for name, n in (("train", 8), ("eval", 4)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"prompt": [{"role": "user", "content": f"POST: {names[i % 4]} bought the bike . TL;DR:"}],
                                    "answer": names[i % 4]}) + "\n")
    (tmp_path / "rewards.py").write_text(
        "def mentions_answer(prompts, completions, answer, **kw):\n"
        "    return [float(a in c[0]['content']) for c, a in zip(completions, answer)]\n")
    out = tmp_path / "out"
    proc = run_script("grpo.py", "--model", tiny_llama, "--dataset", str(tmp_path / "train.jsonl"),
                      "--reward_fn", f"{tmp_path / 'rewards.py'}:mentions_answer", "--log_completions",
                      "--eval_dataset", str(tmp_path / "eval.jsonl"), "--eval_steps", "2", "--top_p", "0.9",
                      "--max_steps", "4", "--batch_size", "2", "--num_generations", "2", "--max_completion_length", "8",
                      "--num_completions_to_print", "2", "--output_dir", str(out))
    assert proc.stdout.count("completions at step") == 4 and "eval_reward" in proc.stdout
    assert "Loading weights" not in proc.stdout + proc.stderr
    lines = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [x["step"] for x in lines if "eval_reward" in x] == [2, 4]
    assert [x["num_tokens"] for x in lines if "loss" in x] == sorted(x["num_tokens"] for x in lines if "loss" in x)
    rows = [json.loads(x) for x in open(out / "completions.jsonl")]
    assert len(rows) == 4 * 2 * 2 and {"prompt", "completion", "mentions_answer", "reward", "advantage"} <= set(rows[0])
    assert "eval_reward" in json.load(open(out / "summary.json"))


@pytest.mark.parametrize("script", ["sft", "reward", "dpo", "grpo", "ppo"])
def test_every_trl_name_gets_a_pointer(script):
    """A TRL flag spelled otherwise here names ours in one sentence; one with no flag here says
    why (common.TRL_NAMES): never a bare "unknown flag"."""
    import dataclasses
    import importlib

    args_cls = importlib.import_module(script).Args
    fields = {f.name for f in dataclasses.fields(args_cls)}
    for trl, (ours, note) in common.TRL_NAMES.items():
        if trl in fields or (ours and ours not in fields):  # the same name here, or another trainer's flag
            continue
        message = common.unknown_flag_message(args_cls, [f"--{trl}", "1"])
        assert message.startswith(f"unknown flag --{trl}: TRL's --{trl} ") and (f"--{ours} here" if ours else note) in message, message
    assert "reward_fn" not in fields or "--reward_fn here" in common.unknown_flag_message(args_cls, ["--reward_funcs", "f"])


def test_a_pretrained_models_default_grpo_step_is_trls(tmp_path, tiny_llama, monkeypatch, capsys):
    """grpo.py on a pretrained model with no batch flags: one optimizer step samples one prompt x
    8 completions (TRL's per_device_train_batch_size 8, num_generations 8, gradient_accumulation_steps
    1), and the run says so before the first step."""
    from conftest import run_main

    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:"}) + "\n"
                                              for i in range(4)))
    (tmp_path / "r.py").write_text("def length(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    calls = []
    real = sampling.generate
    monkeypatch.setattr(sampling, "generate", lambda *a, **k: calls.append((a[2].shape[0], k["num_return_sequences"])) or real(*a, **k))
    run_main(grpo, ["--model", tiny_llama, "--dataset", str(tmp_path / "p.jsonl"), "--reward_fn", f"{tmp_path}/r.py:length",
                    "--max_steps", "1", "--max_completion_length", "4", "--optim", "adamw",
                    "--output_dir", str(tmp_path / "out")], monkeypatch)
    assert calls == [(1, 8)]  # one micro-batch of one prompt, eight completions
    assert ("one optimizer step = 1 prompts x 8 completions = 8 sequences, in micro-batches of 8; in TRL: "
            "per_device_train_batch_size=8, num_generations=8, gradient_accumulation_steps=1") in capsys.readouterr().out


@pytest.mark.parametrize("script", ["ppo", "dpo"])
def test_a_pretrained_models_default_ppo_and_online_dpo_steps(script, tmp_path, tiny_llama, monkeypatch, capsys):
    """ppo.py and dpo.py --online on a pretrained model with no batch flags: an optimizer step holds
    8 prompts (TRL's per_device_train_batch_size 8, gradient_accumulation_steps 1), one completion
    each for PPO and a pair for online DPO; PPO's rollout of two mini-batches is sampled in two
    micro-batches of 8; the run prints both before the first step."""
    import importlib

    from conftest import run_main

    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:"}) + "\n"
                                              for i in range(12)))
    (tmp_path / "r.py").write_text("def length(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    calls = []
    real = sampling.generate
    monkeypatch.setattr(sampling, "generate", lambda *a, **k: calls.append((a[2].shape[0], k.get("num_return_sequences", 1))) or real(*a, **k))
    judge = ["--max_completion_length", "4"] if script == "ppo" else ["--online", "--max_new_tokens", "4"]
    run_main(importlib.import_module(script), ["--model", tiny_llama, "--dataset", str(tmp_path / "p.jsonl"), *judge,
                                                "--reward_fn", f"{tmp_path}/r.py:length", "--max_steps", "1", "--optim", "adamw",
                                                "--output_dir", str(tmp_path / "out")], monkeypatch)
    per_prompt = 1 if script == "ppo" else 2
    assert calls == [(8, per_prompt)] * (2 if script == "ppo" else 1)  # micro-batches of eight prompts
    printed = capsys.readouterr().out
    assert f"one optimizer step = 8 prompts x {per_prompt} completions = {8 * per_prompt} sequences" in printed
    assert script == "dpo" or "(16 prompts a rollout, 4 optimizer steps on it)" in printed


def test_progress_moves_within_a_step(monkeypatch):
    """tracking.within shows which micro-batch of a step is running beside the bar."""
    from tqdm.auto import tqdm

    monkeypatch.setitem(tracking._RUN, "bar", tqdm(range(3), disable=False, file=open(os.devnull, "w"), mininterval=0))
    seen = []
    for item in tracking.within(["a", "b", "c"], "sampling"):
        seen.append((item, tracking._RUN["bar"].postfix))
    assert seen == [("a", "sampling 1/3"), ("b", "sampling 2/3"), ("c", "sampling 3/3")]


@pytest.mark.parametrize("script", ["sft", "reward"])
def test_sft_and_reward_train_trls_three_epochs_by_default(script, tmp_path, tiny_llama, monkeypatch, capsys):
    """On a pretrained model with neither --max_steps nor --num_train_epochs, sft.py and reward.py
    train TRL's 3 epochs (6 rows, 8 a step: 3 steps; reward.py holds 1 of its 6 pairs out, says so,
    and trains 3 epochs of 5: 2 steps); --max_steps alone trains that many steps."""
    import importlib

    from conftest import run_main

    module = importlib.import_module(script)
    rows = [{"prompt": f"POST: alice bought the bike {i} . TL;DR:", "completion": " alice bought bike .",
             "chosen": " alice bought bike .", "rejected": " bob lost the phone ."} for i in range(6)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r if script == "reward" else {k: r[k] for k in ("prompt", "completion")})
                                              + "\n" for r in rows))
    base = ["--model", tiny_llama, "--dataset", str(tmp_path / "d.jsonl"), "--optim", "adamw"]
    run_main(module, base + ["--output_dir", str(tmp_path / "a")], monkeypatch)
    printed = capsys.readouterr().out
    steps = len(open(tmp_path / "a" / "metrics.jsonl").read().split('"step"')) - 1  # eval lines have a step too
    if script == "sft":
        assert steps == 3 and "--num_train_epochs 3 over 6 examples, 8 per step: 3 steps" in printed
    else:
        assert "--num_train_epochs 3 over 5 examples, 8 per step: 2 steps" in printed
        assert "the 1 test pairs are --test_size 0.1 of --dataset, held out of training" in printed
    run_main(module, base + ["--max_steps", "1", "--output_dir", str(tmp_path / "b")], monkeypatch)
    assert "num_train_epochs" not in capsys.readouterr().out.split("defaults for")[-1].split("\n", 1)[1]
