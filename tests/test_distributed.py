"""torchrun on the CPU (2 processes, gloo): 2 ranks x batch b must train exactly like 1 rank x
batch 2b (same losses, gradient norms and weights up to float reordering), with DDP-style
replication and with FSDP2 sharding -- the latter also killed mid-checkpoint and resumed."""

import json
import os
import subprocess
import sys

import pytest
import torch
import test_tools
from conftest import ROOT
from safetensors.torch import load_file

from rlhf import throughput


def _launch(argv, nproc=1, env=None):
    runner = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  "--nproc_per_node", str(nproc)]
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(runner + argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc, ok=True):
    out, err = proc.communicate(timeout=600)
    assert (proc.returncode == 0) == ok, f"exited {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
    return out


def _metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _assert_same_training(one, two, keys=("num_tokens", "loss"), weights_atol=1e-4, steps=4, rel=1e-5):
    a, b = ([r for r in _metrics(d) if "grad_norm" in r] for d in (one, two))  # training rows (not final evals)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, steps + 1))
    for ra, rb in zip(a, b):
        for k in keys:  # num_tokens: the two ranks together saw the same batch
            assert ra[k] == pytest.approx(rb[k], rel=rel, abs=1e-6), k
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
    wa, wb = load_file(os.path.join(one, "model.safetensors")), load_file(os.path.join(two, "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=weights_atol, rtol=0)


def test_sft_two_ranks_match_one_rank_with_twice_the_batch(tmp_path, tiny_qwen, sft_data):
    argv = ["sft.py", "--model", tiny_qwen, "--dataset", sft_data, "--max_steps", "4", "--learning_rate", "1e-2",
            "--warmup_steps", "0", "--optim", "adamw", "--save_steps", "2"]
    one, fsdp = str(tmp_path / "one"), str(tmp_path / "fsdp2")
    # 2 ranks x 2 micro-batches of 2 = 1 rank x 8: the token mean is over the whole optimizer batch.
    # FSDP2 here (DDP's 2-rank equivalence is test_dpo_two_ranks_...), killed while rank 0 writes
    # checkpoint-4, then resumed from checkpoint-2
    two = ["--batch_size", "2", "--gradient_accumulation_steps", "2"]
    runs = [_launch(argv + ["--batch_size", "8", "--output_dir", one]),
            _launch(argv + two + ["--output_dir", fsdp, "--parallel", "fsdp2"], nproc=2,
                    env={"RLHF_TEST_CRASH_WHILE_SAVING": "checkpoint-4"})]
    _finish(runs[0])
    _finish(runs[1], ok=False)
    assert os.path.isdir(os.path.join(fsdp, "checkpoint-4.tmp")) and not os.path.exists(os.path.join(fsdp, "checkpoint-4"))
    out = _finish(_launch(argv + two + ["--output_dir", fsdp, "--parallel", "fsdp2", "--resume"], nproc=2))
    assert "continuing from" in out and "checkpoint-2 at step 2" in out
    assert out.count("saved to") == 1 and out.count("sft: ") >= 1  # only rank 0 prints
    _assert_same_training(one, fsdp)
    ckpt = load_file(os.path.join(fsdp, "checkpoint-4", "model.safetensors"))  # gathered, full-size weights
    ref = load_file(os.path.join(one, "checkpoint-4", "model.safetensors"))
    assert all(ckpt[k].shape == ref[k].shape for k in ref)



def test_dpo_two_ranks_match_one_rank_with_twice_the_batch(tmp_path, tiny_qwen):
    data = tmp_path / "prefs.jsonl"
    with open(data, "w") as f:
        for i in range(24):
            f.write(json.dumps({"prompt": f"POST: bob sold the car {i % 5} . TL;DR:", "chosen": " bob sold car ." + " now" * (i % 3),
                                "rejected": " alice" + " bike" * (i % 4) + " ."}) + "\n")
    argv = ["dpo.py", "--model", tiny_qwen, "--dataset", str(data), "--max_steps", "4", "--learning_rate", "1e-2",
            "--warmup_steps", "0", "--optim", "adamw"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    runs = [_launch(argv + ["--batch_size", "8", "--output_dir", one]),
            _launch(argv + ["--batch_size", "4", "--output_dir", two], nproc=2)]
    for run in runs:
        _finish(run)
    _assert_same_training(one, two, keys=("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"))


def test_grpo_two_ranks_match_one_rank_with_twice_the_batch(tmp_path, tiny_qwen, monkeypatch):
    """grpo.py under 2 CPU ranks: each rank samples its shard of the prompts with the noise a
    single process draws for those rows (sampling.generate's seed), so 2 ranks x 2 prompts x 4
    samples train like 1 rank x 4 prompts x 4 samples; rank 0 logs and saves once."""
    from conftest import run_main

    import grpo

    argv = ["--model", tiny_qwen, "--max_steps", "3", "--num_generations", "4", "--max_completion_length", "8",
            "--learning_rate", "1e-3", "--optim", "adamw", "--save_steps", "2", "--eval_batch_size", "200"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run = _launch(["grpo.py", *argv, "--batch_size", "2", "--output_dir", two], nproc=2)
    run_main(grpo, argv + ["--batch_size", "4", "--output_dir", one], monkeypatch)  # 1 rank, in this process
    printed = _finish(run)
    assert printed.count("saved to") == 1 and printed.count("note: a micro-batch here") == 1  # only rank 0 prints, notes too
    rows = _metrics(two)
    assert rows[0]["kl"] == pytest.approx(0, abs=1e-6) and rows[0]["clip_ratio"] == 0
    assert os.path.exists(os.path.join(two, "checkpoint-2", "trainer_state.pt"))
    _assert_same_training(one, two, keys=("num_tokens", "reward", "reward_std", "completions/mean_length"), steps=3)  # kl: a token mean per rank
    assert json.load(open(os.path.join(two, "summary.json")))["gold_score"] == \
           pytest.approx(json.load(open(os.path.join(one, "summary.json")))["gold_score"])


def test_ppo_two_ranks_match_one_rank_with_twice_the_batch(tmp_path, tiny_qwen, monkeypatch):
    """ppo.py under 2 CPU ranks: the same samples as one rank with the whole batch, advantages
    whitened over both ranks, and the losses' token mean over the whole minibatch, so with the
    rollout as one minibatch, 2 ranks x 4 prompts train like 1 rank x 8 prompts (critic included)."""
    from conftest import run_main

    import ppo

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"POST: bob sold the car {i:02d} . TL;DR:"}) + "\n" for i in range(16)))
    (tmp_path / "r.py").write_text("def length(prompts, completions, **kw):\n    return [0.1 * len(c) for c in completions]\n")
    argv = ["--model", tiny_qwen, "--dataset", str(prompts), "--reward_fn", f"{tmp_path}/r.py:length", "--max_steps", "3",
            "--num_mini_batches", "1", "--gradient_accumulation_steps", "1", "--num_ppo_epochs", "2",
            "--max_completion_length", "6", "--learning_rate", "1e-2", "--optim", "adamw", "--missing_eos_penalty", "0.2",
            "--save_steps", "3"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run = _launch(["ppo.py", *argv, "--batch_size", "4", "--output_dir", two], nproc=2)
    run_main(ppo, argv + ["--batch_size", "8", "--output_dir", one], monkeypatch)
    assert _finish(run).count("saved to") == 1
    # the same samples (num_tokens, reward); kl after two updates at lr 1e-2 agrees to 1e-4 relative (the prompts
    # have one length; batches of 4 and 8 pad their completions to other widths, so the matmuls round differently:
    # with prompts of two lengths, 1.3e-4), within grad_norm's 1e-4
    _assert_same_training(one, two, keys=("num_tokens", "reward", "kl", "rlhf_reward", "completions/mean_length"), steps=3,
                          rel=1e-4)
    rows = _metrics(one)
    assert rows[-1]["kl"] != 0 and rows[0]["episode"] == _metrics(two)[0]["episode"] == 8
    ca, cb = (torch.load(os.path.join(d, "checkpoint-3", "trainer_state.pt"), weights_only=True)["critic"] for d in (one, two))
    for k in ca:  # the critic trained alike too
        torch.testing.assert_close(ca[k], cb[k], atol=1e-4, rtol=0)


# ------------------------------------------------------------------ in-process ranks (torch.multiprocessing + gloo)
def _spawn(fn, *args, nproc=2):
    """Run fn(*args) on `nproc` gloo ranks in one process group; an assertion
    on any rank fails the test. Cheaper than torchrun + a whole script."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(nproc, port, fn, args), nprocs=nproc)


def _rank_main(rank, nproc, port, fn, args):
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(nproc))
    torch.set_num_threads(1)
    # as parallel.init_distributed, with a timeout: a collective that ranks call differently fails, not hangs
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def _all_equal(t):
    """Whether every rank holds exactly this tensor (and how many entries differ on rank 0)."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return int(sum((p != parts[0]).sum() for p in parts))


def _metrics_with_different_keys(tmp):
    """MetricsLogger under torchrun when ranks log different keys (dpo --online: a rank whose
    pairs all tied has no loss): the union is logged, a missing key is absent from its mean."""
    from types import SimpleNamespace

    from rlhf import parallel
    from rlhf import tracking

    logger = tracking.MetricsLogger(SimpleNamespace(output_dir=f"{tmp}/metrics", report_to="none"))
    mine = [{"loss": 1.0, "ties": 4, "only_rank0": 2.0}, {"ties": 4, "only_rank1": 5.0}][parallel.rank()]
    logger.log(1, mine)
    logger.log(2, {"loss": 1.0 + parallel.rank(), "ties": 0})
    parallel.barrier()
    with open(f"{tmp}/metrics/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert rows == [{"step": 1, "loss": 1.0, "ties": 4, "only_rank0": 2.0, "only_rank1": 5.0},
                    {"step": 2, "loss": 1.5, "ties": 0}], rows


def _grpo_normalisers_over_ranks(tmp):
    """grpo.py's --scale_rewards batch std and dapo token count over ranks: 2 ranks x 2 micro-batches
    of 4 prompts' rows give the gradient of 1 rank x 1 micro-batch of all 16 rows (DDP averages)."""
    from types import SimpleNamespace

    import grpo
    from rlhf import parallel

    G, N, C = 4, 16, 7
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(N, C, generator=g) * 3
    old = logprobs + torch.randn(N, C, generator=g) * 0.3
    mask = (torch.arange(C)[None] < torch.randint(1, C + 1, (N,), generator=g)[:, None]).long()
    rewards = torch.randn(N, generator=g) * torch.arange(N) / 4  # the ranks' halves differ in spread
    args = SimpleNamespace(epsilon=0.2, epsilon_high=0.28, dual_clip_c=3.0, beta=0.0, loss_type="dapo", max_completion_length=C)
    # the reference: one process, one micro-batch of everything (no collectives)
    lp = logprobs.clone().requires_grad_()
    grpo.grpo_loss(lp, old, None, grpo.group_advantages(rewards, G, "batch"), mask, args)[0].backward()
    # this rank: its half of the rows, in two micro-batches
    rows = parallel.shard(torch.arange(N))
    parts = [rows[:4], rows[4:]]
    mine = logprobs.clone().requires_grad_()
    advantages = grpo.batch_advantages([rewards[p] for p in parts], G, "batch")
    num_sequences, num_tokens = grpo.batch_normalisers([mask[p] for p in parts])
    sum(grpo.grpo_loss(mine[p], old[p], None, adv, mask[p], args, num_sequences, num_tokens)[0]
        for p, adv in zip(parts, advantages)).backward()
    grad = parallel.all_reduce(mine.grad)  # the mean over ranks, as optimizer_step averages gradients
    torch.testing.assert_close(grad, lp.grad)


def _ranks(tmp, tiny_qwen):
    _metrics_with_different_keys(tmp)
    _grpo_normalisers_over_ranks(tmp)
    _bf16_ranks(tmp, tiny_qwen)
    test_tools.tools_on_two_ranks(tmp)  # grpo --tools: multi-turn samples, as one rank draws them


def _bf16_ranks(tmp, tiny_qwen):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from rlhf import checkpoints
    import common
    from rlhf import parallel

    def args(optim, par="ddp"):
        return SimpleNamespace(learning_rate=1e-3, weight_decay=0.0, optim=optim, lr_scheduler_type="constant",
                               warmup_steps=0, max_steps=10, output_dir=tmp, seed=5, resume=False, parallel=par,
                               resume_from_checkpoint="")

    # 1. DDP arithmetic, identical gradients on both ranks: the stochastic rounding must not differ
    for optim in ("adamw", "adamw_8bit"):
        torch.manual_seed(100 + parallel.rank())  # as the scripts: seed + rank, so the global RNGs differ
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 192)).to(torch.bfloat16)
        model = parallel.distribute(model, args(optim))
        optimizer = common.make_optimizer(model, args(optim))
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            common.optimizer_step(optimizer, 1.0)
        weights = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        assert _all_equal(weights) == 0, f"{optim}: {_all_equal(weights)} of {weights.numel()} weights differ between ranks"

    # 2. FSDP2 in bf16 (fp32 master shards, replicated embeddings/norm/head with stochastic rounding):
    # replicas stay identical, and a resumed run ends bit-for-bit where the uninterrupted one does
    def make():
        torch.manual_seed(7 + parallel.rank())
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.bfloat16)
        model = parallel.distribute(model, args("adamw", "fsdp2"))
        optimizer = common.make_optimizer(model, args("adamw", "fsdp2"))
        return model, optimizer, common.make_scheduler(optimizer, args("adamw", "fsdp2"))

    def train(model, optimizer, scheduler, steps):
        for step in steps:
            ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(step))  # same on both ranks
            model(input_ids=ids, labels=ids).loss.backward()
            common.optimizer_step(optimizer, 1.0)
            scheduler.step()

    def full(model):
        return {n: (p.full_tensor() if parallel.is_sharded_param(p) else p).detach().clone() for n, p in model.named_parameters()}

    model, optimizer, scheduler = make()
    train(model, optimizer, scheduler, range(2))
    checkpoints.save_checkpoint(model, None, args("adamw"), f"{tmp}/checkpoint-2", checkpoints.training_state(2, optimizer, scheduler))
    train(model, optimizer, scheduler, range(2, 4))
    replicated = torch.cat([p.detach().float().reshape(-1) for p in model.parameters() if not parallel.is_sharded_param(p)])
    assert _all_equal(replicated) == 0, "FSDP2's replicated parameters differ between ranks"
    model2, optimizer2, scheduler2 = make()
    resume = args("adamw", "fsdp2")
    resume.resume_from_checkpoint = f"{tmp}/checkpoint-2"
    assert checkpoints.maybe_resume(resume, model2, optimizer2, scheduler2) == 2
    train(model2, optimizer2, scheduler2, range(2, 4))
    a, b = full(model), full(model2)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_two_gloo_ranks_in_process(tmp_path, tiny_qwen):
    """Metrics with different keys per rank; GRPO's normalisers over ranks; bf16 replicas stay
    bit-identical (DDP with both optimizers, FSDP2's replicated parameters); FSDP2 in bf16
    resumes bit-for-bit; tool-using rollouts (tools.py) sample what one rank samples."""
    test_tools.prepare_two_ranks(tmp_path)
    _spawn(_ranks, str(tmp_path), tiny_qwen)


def test_reward_two_ranks_match_one_rank_with_twice_the_batch(tmp_path, tiny_qwen, monkeypatch):
    from worlds import world
    from conftest import run_main

    import reward

    prefs = tmp_path / "prefs.jsonl"
    with open(prefs, "w") as f:
        for row in world.build_world(0, sizes={"sft": 1, "prefs": 40, "contrast": 0, "rl": 1, "test": 1})["prefs"]:
            f.write(json.dumps({k: row[k] for k in ("prompt", "chosen", "rejected")}) + "\n")
    # --expand_layers 0: a new layer's q/k/v and MLP input start with gradients that are rounding noise
    # (its output projections are zero), which Adam scales up to the learning rate; the run below grows one
    argv = ["--model", tiny_qwen, "--dataset", str(prefs), "--max_steps", "4", "--eval_steps", "0",
            "--learning_rate", "3e-3", "--warmup_steps", "0", "--optim", "adamw", "--expand_layers", "0"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run = _launch(["reward.py", *argv, "--batch_size", "4", "--output_dir", two], nproc=2)
    run_main(reward, argv + ["--batch_size", "8", "--output_dir", one], monkeypatch)  # 1 rank, in this process
    assert _finish(run).count("reward: saved to") == 1  # only rank 0 prints
    _assert_same_training(one, two, keys=("loss", "accuracy"))  # margin: a difference near 0, reordered sums
    sa, sb = (json.load(open(os.path.join(d, "summary.json"))) for d in (one, two))
    assert sb["test_accuracy"] == sa["test_accuracy"] and sb["reward_mean"] == pytest.approx(sa["reward_mean"], abs=1e-4)
    # a reward model grown by one layer (the embedded world's) under FSDP2: the new layer is sharded like the
    # others and the saved model is the deeper one
    grown = str(tmp_path / "grown")
    argv[argv.index("--expand_layers") + 1] = "1"
    assert _finish(_launch(["reward.py", *argv, "--batch_size", "4", "--parallel", "fsdp2", "--output_dir", grown],
                           nproc=2)).count("reward: saved to") == 1
    config = json.load(open(os.path.join(grown, "config.json")))
    assert config["num_hidden_layers"] == 3 and len(config["layer_types"]) == 3


def test_ppo_under_torchrun_with_fsdp2_resumes_exactly(tmp_path, tiny_qwen):
    """ppo.py on 2 CPU ranks, policy and critic sharded with FSDP2: each rank samples and scores its
    own prompts, rank 0 logs and saves once, and a run resumed from checkpoint-1 ends where the
    uninterrupted one does (critic included)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:"}) + "\n" for i in range(16)))
    (tmp_path / "r.py").write_text("def length(prompts, completions, **kw):\n    return [0.1 * len(c) for c in completions]\n")
    argv = ["ppo.py", "--model", tiny_qwen, "--dataset", str(prompts), "--reward_fn", f"{tmp_path}/r.py:length",
            "--max_steps", "2", "--batch_size", "2", "--num_mini_batches", "2", "--max_completion_length", "5",
            "--learning_rate", "1e-2", "--optim", "adamw", "--parallel", "fsdp2", "--save_steps", "1"]
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    assert _finish(_launch(argv + ["--output_dir", full], nproc=2)).count("ppo: saved to") == 1
    rows = _metrics(full)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["episode"] == 8  # 2 ranks x 4 prompts
    out = _finish(_launch(argv + ["--output_dir", resumed, "--resume_from_checkpoint", f"{full}/checkpoint-1"], nproc=2))
    assert "at step 1" in out
    # num_tokens is cumulative over the metrics.jsonl of the run's own folder: another folder starts it again
    drop = (*throughput.TIMED, "num_tokens")
    assert [{k: v for k, v in r.items() if k not in drop} for r in _metrics(resumed)] == \
           [{k: v for k, v in r.items() if k not in drop} for r in rows[1:]]  # vf_loss: the critic too
    wa, wb = load_file(os.path.join(full, "model.safetensors")), load_file(os.path.join(resumed, "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_kto_two_ranks_match_one_rank_with_twice_the_batch(tmp_path, tiny_qwen):
    """kto.py under 2 CPU ranks: each rank trains its half of a block and the reference point z0 is
    averaged over both, so 2 ranks x 4 rows train like 1 rank x 8 rows."""
    data = tmp_path / "unpaired.jsonl"
    with open(data, "w") as f:
        for i in range(32):
            f.write(json.dumps({"prompt": f"POST: bob sold the car {i % 5} . TL;DR:",
                                "completion": " bob sold car ." + " now" * (i % 3) if i % 2 else " alice" + " bike" * (i % 4) + " .",
                                "label": bool(i % 2)}) + "\n")
    argv = ["kto.py", "--model", tiny_qwen, "--dataset", str(data), "--max_steps", "4", "--learning_rate", "1e-3",
            "--warmup_steps", "0", "--optim", "adamw"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    runs = [_launch(argv + ["--batch_size", "8", "--output_dir", one]),
            _launch(argv + ["--batch_size", "4", "--output_dir", two], nproc=2)]
    for run in runs:
        _finish(run)
    _assert_same_training(one, two, keys=("loss", "kl"))


def test_grpo_dynamic_sampling_on_two_ranks(tmp_path, tiny_qwen):
    """grpo.py --dynamic_sampling under 2 CPU ranks: a rank that must resample and one that need not
    take the same number of extra rollouts (the sampler's collectives stay in step), and the run
    finishes with the refill logged."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"POST: bob sold the car {i} . TL;DR:"}) + "\n" for i in range(16)))
    (tmp_path / "r.py").write_text("def some(completions, **kw):\n    return [float(len(c) % 3 == 0) for c in completions]\n")
    out = str(tmp_path / "two")
    _finish(_launch(["grpo.py", "--model", tiny_qwen, "--dataset", str(prompts), "--reward_fn", f"{tmp_path}/r.py:some",
                     "--dynamic_sampling", "--max_resample", "2", "--max_steps", "2", "--num_generations", "2",
                     "--batch_size", "2", "--max_completion_length", "6", "--optim", "adamw", "--output_dir", out], nproc=2))
    rows = _metrics(out)
    assert len(rows) == 2 and all("dynamic_sampling/resamples" in r for r in rows), rows


def test_distill_two_ranks_match_one_rank_with_twice_the_batch(tmp_path):
    """distill.py on a tiny Llama with a smaller Llama teacher (one tokenizer): 2 gloo ranks x 4
    prompts train as 1 rank x 8, on-policy and dataset micro-batches mixed (--lmbda 0.5): the
    draws, the samples and the token normaliser span the ranks."""
    from conftest import chat_tokenizer, save_tiny

    shape = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    student = save_tiny(tmp_path / "student", "Llama", chat_tokenizer(), hidden_size=64, intermediate_size=128, **shape)
    teacher = save_tiny(tmp_path / "teacher", "Llama", chat_tokenizer(), hidden_size=32, intermediate_size=64, **shape)
    data = tmp_path / "sft.jsonl"
    with open(data, "w") as f:
        for i in range(32):
            f.write(json.dumps({"prompt": f"POST: bob sold the car {i % 5} . TL;DR:", "completion": " bob sold car ." + " now" * (i % 3)}) + "\n")
    argv = ["distill.py", "--model", student, "--teacher", teacher, "--dataset", str(data), "--max_steps", "4",
            "--learning_rate", "1e-3", "--optim", "adamw", "--lmbda", "0.5", "--beta", "0.5", "--max_completion_length", "8"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    runs = [_launch(argv + ["--batch_size", "8", "--output_dir", one]),
            _launch(argv + ["--batch_size", "4", "--output_dir", two], nproc=2)]
    for run in runs:
        _finish(run)
    assert {r["on_policy"] for r in _metrics(one)} == {0.0, 1.0}  # both kinds of micro-batch ran
    _assert_same_training(one, two, keys=("loss", "num_tokens"))
