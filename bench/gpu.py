"""bench/gpu.py: peak memory and tokens/s of dpo.py, grpo.py and ppo.py on one GPU at realistic
sizes: a Qwen2.5-1.5B-shaped model with random weights, prompts of 512 tokens, completions of
256 tokens. A benchmark, not a test; well under 10 minutes on one H100/H200.

What it does:
1. Builds the model from Qwen2.5-1.5B's config (hidden 1536, intermediate 8960, 28 layers, 12
   heads, 2 KV heads, vocab 151936, tied embeddings, rope theta 1e6) with random bf16 weights,
   a reward model of the same shape (PPO's reward and critic initialisation), and a tokenizer.
   The tokenizer is word-level (the `tokenizers` library): the embedded world's words plus
   filler words w<i> up to exactly 151936 entries, so every id the model can sample decodes
   and re-encodes to itself, prompts are exactly 512 tokens by construction, and nothing is
   downloaded. Random weights almost never sample EOS, so completions run to the full 256.
2. Writes prompts (and chosen/rejected completions for DPO) as .jsonl files.
3. Runs each script for --steps steps through subprocess, as a user would, with the settings
   in STAGES (gradient checkpointing on, 8-bit AdamW, bf16), watching metrics.jsonl to time
   each step; reads the peak from <run>/memory.json (memory.log_memory:
   torch.cuda.max_memory_allocated) and the --estimate_memory plan of the same command.
4. Writes bench/results_gpu.json and bench/results_gpu.md.

The `*_qlora_7b` stages (not in the default --stages) run grpo.py and dpo.py with --use_peft
--load_in_4bit on a Qwen2.5-7B-shaped policy (hidden 3584, intermediate 18944, 28 layers, 28
heads, 4 KV heads, vocab 152064, untied embeddings): QLoRA, where the plan says 16 GB is enough.

Run:
    python bench/gpu.py                # on the GPU machine
    python bench/gpu.py --stages grpo_qlora_7b,dpo_qlora_7b   # QLoRA on the 7B shape
    python bench/gpu.py --tiny         # a 2-minute check of the whole path on the CPU
    .venv-vllm/bin/python bench/gpu.py --stages grpo,grpo_vllm,grpo_vllm_sleep   # GRPO with and without vLLM rollouts
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                  max_position_embeddings=32768)
QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, rope_theta=1e6,
                 max_position_embeddings=32768)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True, rope_theta=1e6,
            max_position_embeddings=1024)
TARGET_GB = {"dpo": 12, "grpo": 18, "ppo": 40, "grpo_qlora_7b": 16, "dpo_qlora_7b": 16,  # peak-memory targets on the GPU
             "grpo_vllm": 33, "grpo_vllm_sleep": 33}  # grpo's 18 + the engine's 0.1 of an H200's 141 GB (a guess until measured)
QLORA = dict(use_peft=True, load_in_4bit=True)

# per stage: flags beyond --model/--dataset/--max_steps/--output_dir, and how many sequences
# (prompt + completion) one optimizer step processes (for tokens/s)
STAGES = {
    "dpo": dict(flags=dict(batch_size=4, eval_batch_size=8, gradient_checkpointing=True, learning_rate=5e-7),
                sequences=lambda f: 2 * f["batch_size"]),  # eval_batch_size: pairs per batch of the precompute pass
    "grpo": dict(flags=dict(batch_size=2, num_generations=8, gradient_checkpointing=True, beta=0.04, learning_rate=1e-6),
                 sequences=lambda f: f["batch_size"] * f["num_generations"]),
    "ppo": dict(flags=dict(batch_size=8, num_mini_batches=2, num_ppo_epochs=2, gradient_checkpointing=True, learning_rate=1e-6),
                sequences=lambda f: f["batch_size"] * f["num_mini_batches"]),  # the rollout batch
    # GRPO sampling with vLLM (--use_vllm, colocate): run in .venv-vllm (`make vllm-env`), e.g.
    # `.venv-vllm/bin/python bench/gpu.py --stages grpo,grpo_vllm`; peak and step time beside plain grpo's
    "grpo_vllm": dict(script="grpo", flags=dict(batch_size=2, num_generations=8, gradient_checkpointing=True, beta=0.04,
                                                learning_rate=1e-6, use_vllm=True, vllm_gpu_memory_utilization=0.1),
                      sequences=lambda f: f["batch_size"] * f["num_generations"]),
    # the same with vLLM's sleep mode (--vllm_enable_sleep_mode): the engine frees its weights and KV cache
    # during each update; the device peak (nvidia-smi) shows what that saves
    "grpo_vllm_sleep": dict(script="grpo", flags=dict(batch_size=2, num_generations=8, gradient_checkpointing=True,
                                                      beta=0.04, learning_rate=1e-6, use_vllm=True,
                                                      vllm_gpu_memory_utilization=0.1, vllm_enable_sleep_mode=True),
                            sequences=lambda f: f["batch_size"] * f["num_generations"]),
    # QLoRA on the 7B shape: a 4-bit base, LoRA r=16 adapters, the reference is the base with adapters off
    "grpo_qlora_7b": dict(script="grpo", shape=QWEN25_7B,
                          flags=dict(batch_size=2, num_generations=8, gradient_checkpointing=True, beta=0.04,
                                     learning_rate=1e-5, **QLORA),
                          sequences=lambda f: f["batch_size"] * f["num_generations"]),
    "dpo_qlora_7b": dict(script="dpo", shape=QWEN25_7B,
                         flags=dict(batch_size=4, eval_batch_size=8, gradient_checkpointing=True, learning_rate=5e-6,
                                    **QLORA),
                         sequences=lambda f: 2 * f["batch_size"]),
}


def build_tokenizer(vocab_size):
    """Word-level tokenizer: the world's words, then w<i> fillers up to vocab_size entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from worlds import world

    words = ["<pad>", "<eos>", "<unk>"] + world.vocabulary()
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   model_max_length=8192, padding_side="right", clean_up_tokenization_spaces=False)


def build_models(workdir, shape, dtype, names=("policy", "reward")):
    """Policy (causal LM) and reward model (sequence classifier) folders with random weights."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    tok = build_tokenizer(shape["vocab_size"])
    config = Qwen2Config(**shape, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    paths = {}
    for name, cls, extra in (("policy", Qwen2ForCausalLM, {}), ("reward", Qwen2ForSequenceClassification, {"num_labels": 1})):
        if name not in names:
            continue
        path = paths[name] = os.path.join(workdir, name)
        if os.path.exists(os.path.join(path, "config.json")):
            continue
        torch.manual_seed(0)
        cfg = Qwen2Config(**{k: v for k, v in config.to_dict().items() if k not in ("id2label", "label2id")}, **extra)
        with torch.device(device):
            model = cls(cfg).to(dtype)  # random init on the GPU: seconds, not minutes
        model.save_pretrained(path)
        tok.save_pretrained(path)
        del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the runs are subprocesses: leave them the whole card
    return paths, tok


def write_data(workdir, tok, prompt_len, completion_len, n):
    """prompt (+ chosen/rejected) rows whose prompts are exactly prompt_len tokens."""
    rng = random.Random(0)
    vocab = [w for w in tok.get_vocab() if not w.startswith("<")]
    words = lambda k: " ".join(rng.choice(vocab) for _ in range(k))  # noqa: E731
    prompts = [f"POST: {words(prompt_len - 2)} TL;DR:" for _ in range(n)]
    paths = {"prompts": os.path.join(workdir, "prompts.jsonl"), "prefs": os.path.join(workdir, "prefs.jsonl")}
    with open(paths["prompts"], "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    with open(paths["prefs"], "w") as f:  # completions of completion_len tokens with the EOS added
        for p in prompts:
            f.write(json.dumps({"prompt": p, "chosen": words(completion_len - 1), "rejected": words(completion_len - 1)}) + "\n")
    assert len(tok(prompts[0])["input_ids"]) == prompt_len
    return paths


REWARD_FN = '''def reward(prompts, completions, **columns):
    """Distinct words per completion: cheap, deterministic, and varies within a group."""
    return [len(set(c.split())) / 100 for c in completions]
'''


def stage_command(stage, paths, data, args, prompt_len, completion_len, out):
    flags = dict(STAGES[stage]["flags"], model=paths["policy"], max_steps=args.steps, output_dir=out,
                 max_prompt_length=prompt_len, max_completion_length=completion_len, logging_steps=1, seed=0)
    stage = STAGES[stage].get("script", stage)
    if stage == "dpo":
        flags.update(dataset=data["prefs"])
    else:
        flags.update(dataset=data["prompts"])
    if stage == "grpo":
        flags.update(reward_fn=f"{data['reward_fn']}:reward")
    if stage == "ppo":
        flags.update(reward_model=paths["reward"])
    if args.tiny:
        flags.update(batch_size=2, gradient_checkpointing=False)
        if stage == "grpo":
            flags.update(num_generations=4)
    cmd = [sys.executable, os.path.join(ROOT, f"{stage}.py")]
    for k, v in flags.items():
        cmd += [f"--{k}"] if v is True else [f"--{k}={v}"]
    return cmd, flags


def device_used_bytes():
    """Memory in use on GPU 0 as nvidia-smi reports it (every process, the CUDA context and vLLM's
    own allocations included, which torch.cuda.max_memory_allocated does not see), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=5).stdout
        return int(out.strip().splitlines()[0]) * 2**20
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def run_stage(cmd, out, log, timeout):
    """Run a script; record when each line of metrics.jsonl appears (one per step) and the
    device's peak memory in use (nvidia-smi, polled every 0.5 s)."""
    metrics = os.path.join(out, "metrics.jsonl")
    start, stamps, polls, device_peak = time.perf_counter(), [], 0, None
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "TQDM_DISABLE": "1"})
        while proc.poll() is None:
            time.sleep(0.05)
            if time.perf_counter() - start > timeout:  # keep the whole benchmark inside its budget
                proc.kill()
                proc.wait()
                break
            if os.path.exists(metrics):
                with open(metrics) as m:
                    n = sum(1 for _ in m)
                stamps += [time.perf_counter() - start] * (n - len(stamps))
            polls += 1
            if polls % 10 == 0:
                used = device_used_bytes()
                device_peak = used if device_peak is None or (used or 0) > device_peak else device_peak
    rows = []
    if os.path.exists(metrics):
        with open(metrics) as m:
            rows = [json.loads(line) for line in m]
    stamps += [time.perf_counter() - start] * (len(rows) - len(stamps))
    return proc.returncode, time.perf_counter() - start, stamps, rows, device_peak


def plan_total_gb(cmd):
    """The --estimate_memory total of the same command, in GB."""
    proc = subprocess.run(cmd + ["--estimate_memory"], cwd=ROOT, capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    m = re.match(r"total\s+(\d+\.\d+)", last)
    return (float(m.group(1)) if m else None), proc.stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="Tiny model and lengths: checks the path on the CPU.")
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps per stage (the first is warm-up).")
    parser.add_argument("--stage_timeout", type=int, default=150, help="Seconds after which a stage is stopped.")
    parser.add_argument("--stages", default="dpo,grpo,ppo", help="Comma-separated stages to run.")
    parser.add_argument("--workdir", default="/tmp/bench_gpu", help="Models, data, runs and logs.")
    parser.add_argument("--output", default="", help="Writes OUTPUT.json and OUTPUT.md (default: bench/results_gpu; with --tiny, in --workdir).")
    args = parser.parse_args()

    import torch

    shape = TINY if args.tiny else QWEN25_15B
    prompt_len, completion_len = (32, 16) if args.tiny else (512, 256)
    workdir = args.workdir + ("_tiny" if args.tiny else "")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    stages = args.stages.split(",")
    paths, tok = build_models(workdir, shape, dtype)
    if any(STAGES.get(s, {}).get("shape") is QWEN25_7B for s in stages):  # the policy only: QLoRA stages need no reward model
        paths_7b, _ = build_models(os.path.join(workdir, "7b"), TINY if args.tiny else QWEN25_7B, dtype, names=("policy",))
    data = write_data(workdir, tok, prompt_len, completion_len, n=64)  # w<i> words: in both vocabularies
    data["reward_fn"] = os.path.join(workdir, "reward_fn.py")
    with open(data["reward_fn"], "w") as f:
        f.write(REWARD_FN)
    print(f"built models and data in {time.perf_counter() - t0:.0f} s", flush=True)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results = {"device": device, "shape": shape, "prompt_length": prompt_len, "completion_length": completion_len,
               "steps": args.steps, "stages": {}}
    for stage in stages:
        if stage not in STAGES:
            results["stages"][stage] = {"error": f"unknown stage {stage}"}
            continue
        out = os.path.join(workdir, f"run_{stage}")
        stage_paths = paths_7b if STAGES[stage].get("shape") is QWEN25_7B else paths
        cmd, flags = stage_command(stage, stage_paths, data, args, prompt_len, completion_len, out)
        plan_gb, plan_text = plan_total_gb(cmd)
        rc, wall, stamps, rows, device_peak = run_stage(cmd, out, out + ".log", args.stage_timeout)
        r = {"command": " ".join(cmd[1:]).replace(ROOT + "/", ""), "returncode": rc, "wall_seconds": wall,
             "plan_total_gb": plan_gb, "plan": plan_text,
             "device_peak_gb": None if device_peak is None else device_peak / 2**30}
        if rc != 0:
            with open(out + ".log") as f:
                r["error"] = f.read()[-3000:]
        mem_path = os.path.join(out, "memory.json")
        if os.path.exists(mem_path):
            with open(mem_path) as f:
                mem = json.load(f)
            r.update(peak_gb=mem["peak_bytes"] / 2**30, peak_kind=mem["peak_kind"],
                     measured_gb={k: v / 2**30 for k, v in mem["components"].items()})
        if len(stamps) >= 2 and stamps[-1] > stamps[0]:  # steady state: the steps after the first
            step_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
            lengths = [row.get("completions/mean_length", completion_len) for row in rows[1:]] or [completion_len]
            tokens = STAGES[stage]["sequences"](flags) * (prompt_len + sum(lengths) / len(lengths))
            r.update(seconds_per_step=step_s, tokens_per_second=tokens / step_s)
        r["target_gb"] = TARGET_GB[stage]
        r["shape"] = STAGES[stage].get("shape", QWEN25_15B)
        results["stages"][stage] = r
        print(f"{stage}: rc {rc}, {wall:.0f} s, peak {r.get('peak_gb', float('nan')):.2f} GB "
              f"(plan {plan_gb} GB, target {TARGET_GB[stage]} GB), {r.get('tokens_per_second', float('nan')):.0f} tokens/s",
              flush=True)

    output = args.output or (os.path.join(workdir, "results_gpu_tiny") if args.tiny else os.path.join(ROOT, "bench", "results_gpu"))
    with open(output + ".json", "w") as f:
        json.dump(results, f, indent=2)
    lines = [f"# GPU benchmark: {device}", "",
             f"Qwen2.5-1.5B shape (`*_qlora_7b`: Qwen2.5-7B shape){' (TINY check)' if args.tiny else ''}, random weights, prompt {prompt_len} + "
             f"completion {completion_len} tokens, {args.steps} steps per stage.", "",
             "| stage | peak GB (measured) | device peak GB (nvidia-smi) | plan GB (--estimate_memory) | target GB | s/step | tokens/s | command |",
             "|---|---|---|---|---|---|---|---|"]
    for stage, r in results["stages"].items():
        device_gb = r.get("device_peak_gb")
        lines.append(f"| {stage} | {r.get('peak_gb', float('nan')):.2f} | {'-' if device_gb is None else f'{device_gb:.2f}'} | "
                     f"{r.get('plan_total_gb')} | {TARGET_GB.get(stage)} | "
                     f"{r.get('seconds_per_step', float('nan')):.2f} | {r.get('tokens_per_second', float('nan')):.0f} | "
                     f"`{r.get('command', r.get('error', ''))}` |")
    with open(output + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"total {time.perf_counter() - t0:.0f} s; wrote {output}.json and {output}.md")
    failed = [s for s, r in results["stages"].items() if r.get("returncode", 1) != 0]
    if failed:
        sys.exit(f"error: stage(s) {', '.join(failed)} failed; see the logs in {workdir}")


if __name__ == "__main__":
    main()
