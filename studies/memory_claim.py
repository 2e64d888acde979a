"""The design document's claim "Critic-free alignment reduces memory by 60%: the total drops from
60 GB to 18-23 GB" (issue #28, claim 5; docs/studies.md), checked against the project's memory plans.

Every number comes from the scripts' own `--estimate_memory` (memory.py: exact counts of
weights, gradients and optimizer states from the config, the activation formula that
tests/test_memory.py checks against autograd's saved tensors), for a Qwen2.5-1.5B-shaped config,
bf16, prompt 512 + completion 256 tokens, --gradient_checkpointing, at the settings of
docs/benchmarks.md's table: PPO 8 sequences per micro-batch, DPO 4 pairs, GRPO 2 prompts x G. Each
algorithm is planned with fp32-state AdamW and with 8-bit AdamW, so the two changes the
document's 60% mixes (dropping the critic, and 8-bit states) are measured apart.

    python studies/memory_claim.py          # ~1 min on a CPU; writes studies/memory_claim.json, prints the tables
"""

import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                  max_position_embeddings=32768)
# the document's table (GB): PPO with fp32 AdamW states, DPO and GRPO with 8-bit ones
DOCUMENT = {"PPO": 60.0, "DPO": 18.0, "GRPO": 23.0}
COMMON = ["--dtype", "bfloat16", "--gradient_checkpointing", "--max_prompt_length", "512"]
# name -> (script, flags beyond --model and COMMON)
PLANS = {
    "PPO (reward model, critic)": ("ppo.py", ["--reward_model", "{C}", "--batch_size", "8", "--max_completion_length", "256"]),
    "DPO, reference log-probs precomputed": ("dpo.py", ["--batch_size", "4", "--max_completion_length", "256"]),
    "DPO, live reference": ("dpo.py", ["--batch_size", "4", "--max_completion_length", "256", "--no_precompute_ref_logps"]),
    "GRPO G=4, reward model": ("grpo.py", ["--batch_size", "2", "--num_generations", "4", "--max_completion_length", "256",
                                           "--reward_model", "{C}"]),
    "GRPO G=4, rule verifier": ("grpo.py", ["--batch_size", "2", "--num_generations", "4", "--max_completion_length", "256",
                                            "--reward_fn", "gold"]),
    "GRPO G=8, rule verifier": ("grpo.py", ["--batch_size", "2", "--num_generations", "8", "--max_completion_length", "256",
                                            "--reward_fn", "gold"]),
}


def plan(script, flags):
    """The rows of one --estimate_memory table: {component: GB}."""
    out = subprocess.run([sys.executable, script, *flags, "--estimate_memory"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if out.returncode != 0:
        sys.exit(f"{script} {' '.join(flags)} --estimate_memory failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    rows = [re.match(r"(.+?)\s{2,}(\d+\.\d+)\s+\d+\.\d+", line) for line in out.stdout.splitlines()]
    return {m.group(1).strip(): float(m.group(2)) for m in rows if m}


def main():
    from transformers import Qwen2Config

    with tempfile.TemporaryDirectory() as folder:
        Qwen2Config(**QWEN25_15B).save_pretrained(folder)  # only config.json: the plans load no weights
        results = {}
        for name, (script, flags) in PLANS.items():
            for optim in ("adamw", "adamw_8bit"):
                argv = ["--model", folder, *COMMON, "--optim", optim, *[f.replace("{C}", folder) for f in flags]]
                results[f"{name} | {optim}"] = {"command": f"python {script} --model $C " + " ".join(
                    a.replace(folder, "$C") for a in argv[2:]) + " --estimate_memory", "rows": plan(script, argv)}
                print(f"{name:40s} {optim:10s} total {results[f'{name} | {optim}']['rows']['total']:7.2f} GB", flush=True)
    total = {k: v["rows"]["total"] for k, v in results.items()}
    ppo = {o: total[f"PPO (reward model, critic) | {o}"] for o in ("adamw", "adamw_8bit")}
    reductions = {k: {"GB": t, "vs PPO, same optimizer": 1 - t / ppo[k.split(" | ")[1]],
                      "vs PPO with fp32 AdamW": 1 - t / ppo["adamw"]}  # the document's comparison
                  for k, t in total.items() if not k.startswith("PPO")}
    out = {"shape": QWEN25_15B, "document_GB": DOCUMENT, "plans": results, "reductions": reductions,
           "document_reduction": {k: 1 - v / DOCUMENT["PPO"] for k, v in DOCUMENT.items() if k != "PPO"}}
    path = os.path.join(ROOT, "studies", "memory_claim.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print("\n| plan | optimizer | total GB | reduction vs PPO, same optimizer | vs PPO with fp32 AdamW |")
    print("|---|---|---|---|---|")
    for k, t in total.items():
        name, optim = k.split(" | ")
        r = reductions.get(k)
        print(f"| {name} | {optim} | {t:.2f} | " + (f"{r['vs PPO, same optimizer']:.0%} | {r['vs PPO with fp32 AdamW']:.0%} |"
                                                   if r else "– | – |"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
