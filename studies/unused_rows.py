"""Why the TL;DR world's byte-level SFT policy copied facts wrongly (issue #29; README, "The
embedded world"): sft.py from scratch on the same text and the same one-token-per-word split,
with four vocabularies / initialisations, then the gold judge's terms of greedy summaries on the
200 test posts.

    python studies/unused_rows.py --variants word,word633,bpe_random,bpe_zero --seed 0 --max_steps 1000

- word:        a word-level vocabulary of the world's words (109 tokens, all in the text; the
               world's tokenizer before it became a byte-level BPE, which AutoTokenizer misreads);
- word633:     the same plus 524 tokens the text never contains, random rows (as many as the BPE);
- bpe_random:  the world's byte-level BPE (633 tokens, 111 in the text), every row random;
- bpe_zero:    the same, the 522 rows the text never contains at zero (scratch.build_model's
               `texts`: what sft.py does now).
Appends one JSON line per run to studies/unused_rows.json. One run: ~3 to 6 min on a CPU core.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import data  # noqa: E402
import sampling  # noqa: E402
import scratch  # noqa: E402
import sft  # noqa: E402
import world  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BPE = world.build_tokenizer  # the world's own, before run() swaps it


def word_level(pad_to=0):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(scratch.SPECIAL_TOKENS + world.vocabulary())}
    for k in range(pad_to - len(vocab)):
        vocab[f"unused{k}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return scratch._wrap(tok)


VARIANTS = {  # name -> (tokenizer, rows the text never contains at zero)
    "word": (word_level, False),
    "word633": (lambda: word_level(len(BPE())), False),
    "bpe_random": (BPE, False),
    "bpe_zero": (BPE, True),
}


def run(variant, seed, max_steps, output_dir):
    make_tokenizer, zero = VARIANTS[variant]
    build = scratch.build_model
    world.build_tokenizer, scratch.build_model = make_tokenizer, (
        lambda tok, *a, texts=None, **k: build(tok, *a, texts=texts if zero else None, **k))
    try:
        start = time.time()
        sys.argv = ["sft.py", "--seed", str(seed), "--max_steps", str(max_steps), "--output_dir", output_dir,
                    "--overwrite_output_dir"]
        sft.main()
        seconds = time.time() - start
    finally:
        world.build_tokenizer, scratch.build_model = BPE, build
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer()  # the project's loader would read a word-level folder too; this is the same object
    model = AutoModelForCausalLM.from_pretrained(output_dir).eval()
    test = common.embedded_world()["test"]
    texts, _, _ = sampling.sample_texts(model, tok, [data.render_prompt(tok, p) for p in test["prompt"]], 48,
                                        do_sample=False)
    counts = [world.gold_counts(p, t) for p, t in zip(test["post"], texts)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"variant": variant, "vocab": len(tok), "seed": seed, "max_steps": max_steps,
            "gold": mean([world.gold_score(p, t) for p, t in zip(test["post"], texts)]),
            **{k: mean([c[k] for c in counts]) for k in ("missed", "unsupported", "repeated")},
            "seconds": round(seconds), "sample": texts[0]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_steps", type=int, default=1000)
    p.add_argument("--output_dir", default="runs/unused_rows")
    args = p.parse_args()
    for v in args.variants.split(","):
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}: choose from {', '.join(VARIANTS)}")
        result = run(v, args.seed, args.max_steps, os.path.join(args.output_dir, f"{v}_seed{args.seed}"))
        print(json.dumps(result))
        with open(os.path.join(HERE, "unused_rows.json"), "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
