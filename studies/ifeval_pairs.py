"""studies/ifeval_pairs.py: an offline preference dataset from a policy's own samples on the
instruction-following world (worlds/world_ifeval.py), labelled by its strict verifier.

For each of the first --num_prompts prompts of embedded:ifeval's `rl` split (training topics and
families only), the policy samples --num_samples completions at --temperature; ifeval_strict
labels each; a prompt with at least one completion that passes and one that fails gives pairs
(each passing completion that was not truncated against each failing one, distinct texts, at most
--pairs_per_prompt of them, in sample order), in TRL's conversational
preference format (prompt messages, chosen and rejected as one assistant message each). Prompts
whose samples all pass or all fail give no pair (nothing to prefer). This is "offline DPO on the
base model's own samples": the pairs are on-policy for the model that sampled them, and dpo.py
trains on them with that model as its reference.

Run (make demo-real):
    python studies/ifeval_pairs.py --model models/SmolLM2-135M-Instruct --output runs/real/pairs.jsonl
    python dpo.py --model models/SmolLM2-135M-Instruct --dataset runs/real/pairs.jsonl ...

With --kto_output the same labelled samples are also written unpaired, one row a distinct sample
with the verifier's thumbs up or down (KTO's data: make real-kto).
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from rlhf import checkpoints  # noqa: E402
from rlhf import data  # noqa: E402
from rlhf import sampling  # noqa: E402
from worlds import world_ifeval  # noqa: E402


def preference_pairs(rows, texts, scores, truncated, n, per_prompt=1):
    """Pairs of each row whose n samples (texts[i*n:(i+1)*n]) hold a pass and a fail: every distinct
    passing sample that is not truncated against every distinct failing one, in sample order, at most
    per_prompt of them; TRL's conversational preference format, with the row's family."""
    pairs = []
    for i, r in enumerate(rows):
        group = list(zip(texts[i * n:(i + 1) * n], scores[i * n:(i + 1) * n], truncated[i * n:(i + 1) * n]))
        chosen = list(dict.fromkeys(t for t, s, tr in group if s == 1.0 and not tr))
        rejected = list(dict.fromkeys(t for t, s, _ in group if s == 0.0))
        for c, rj in [(c, rj) for c in chosen for rj in rejected][:per_prompt]:
            pairs.append({"prompt": r["prompt"], "chosen": [{"role": "assistant", "content": c}],
                          "rejected": [{"role": "assistant", "content": rj}], "family": r["family"]})
    return pairs


def unpaired_rows(rows, texts, scores, truncated, n):
    """KTO's rows from the same labelled samples: each distinct sample of a prompt once, desirable
    (label true) when it passes and was not truncated, undesirable when it fails; a passing but
    truncated sample is left out, as from the pairs. TRL's conversational unpaired format."""
    out = []
    for i, r in enumerate(rows):
        seen = set()
        for t, s, tr in zip(texts[i * n:(i + 1) * n], scores[i * n:(i + 1) * n], truncated[i * n:(i + 1) * n]):
            if t in seen or (s == 1.0 and tr):
                continue
            seen.add(t)
            out.append({"prompt": r["prompt"], "completion": [{"role": "assistant", "content": t}],
                        "label": s == 1.0, "family": r["family"]})
    return out


def write_jsonl(path, rows):
    """rows to `path` through a temporary file, so a stopped run leaves no half-written file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(path + ".tmp", path)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="The policy whose samples make the pairs (a folder).")
    p.add_argument("--output", required=True, help="The JSONL file of pairs to write.")
    p.add_argument("--kto_output", default="", help="Also write KTO's unpaired rows (prompt, completion, label) of the same samples to this JSONL file.")
    p.add_argument("--num_prompts", type=int, default=256, help="Prompts of the rl split to sample on (its first ones).")
    p.add_argument("--num_samples", type=int, default=4, help="Completions sampled per prompt.")
    p.add_argument("--pairs_per_prompt", type=int, default=1, help="At most this many (pass, fail) pairs of one prompt's samples.")
    p.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    p.add_argument("--max_completion_length", type=int, default=48, help="Tokens generated per completion.")
    p.add_argument("--batch_size", type=int, default=32, help="Prompts per generation batch.")
    p.add_argument("--seed", type=int, default=0, help="The rl split's seed and the sampling seed.")
    args = p.parse_args()
    if args.num_samples < 2:
        common.fail("--num_samples must be at least 2: a pair needs a completion that passes and one that fails.")

    start = time.time()
    common.set_seed(args.seed)
    ds = common.ifeval_split("rl", args.seed)
    ds = ds.select(range(min(args.num_prompts, len(ds))))
    tokenizer = common.load_tokenizer(args.model)
    model = common.freeze(common.load_model(args.model, argparse.Namespace(
        dtype="auto", attn_implementation="auto", trust_remote_code=False, use_peft=False, load_in_4bit=False,
        load_in_8bit=False)))
    prompts = [data.render_prompt(tokenizer, r) for r in ds["prompt"]]
    texts, truncated = [], []
    for i in range(0, len(prompts), args.batch_size):  # n samples of each prompt: rows i*n..(i+1)*n-1
        ids, mask = data.encode_prompts(tokenizer, prompts[i:i + args.batch_size])
        c, cm, tr = sampling.generate(model, tokenizer, ids, mask, args.max_completion_length, args.temperature,
                                      num_return_sequences=args.num_samples, seed=args.seed)
        texts += sampling.decode_completions(tokenizer, c, cm, tr)
        truncated += tr.tolist()

    # label every sample with the strict verifier; one pair per prompt with a pass and a fail
    n = args.num_samples
    rows = [r for r in ds for _ in range(n)]
    scores = world_ifeval.ifeval_strict([r["prompt"] for r in rows], texts, [r["constraints"] for r in rows],
                                        [r["keyword"] for r in rows])
    pairs = preference_pairs(list(ds), texts, scores, truncated, n, args.pairs_per_prompt)
    if not pairs:
        common.fail(f"no prompt of {len(ds)} had a passing and a failing sample: raise --num_samples or --num_prompts.")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    checkpoints.write_json(args.output + ".summary.json", {
        "model": args.model, "prompts": len(ds), "num_samples": n, "pairs": len(pairs),
        "pass_rate": sum(scores) / len(scores), "truncated": sum(truncated) / len(truncated),
        "seconds": round(time.time() - start, 1)})
    write_jsonl(args.output, pairs)
    if args.kto_output:
        kto = unpaired_rows(list(ds), texts, scores, truncated, n)
        write_jsonl(args.kto_output, kto)
        print(f"ifeval_pairs: {len(kto)} unpaired rows ({sum(r['label'] for r in kto)} desirable) -> {args.kto_output}")
    print(f"ifeval_pairs: {len(pairs)} pairs from {len(ds)} prompts x {n} samples (pass rate "
          f"{sum(scores) / len(scores):.3f}, truncated {sum(truncated) / len(truncated):.3f}) -> {args.output} "
          f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
