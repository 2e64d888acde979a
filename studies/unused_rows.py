"""Why the TL;DR world's byte-level SFT policy copied facts wrongly (issue #29; docs/worlds.md, "The embedded world"): sft.py from scratch on the same text and the same one-token-per-word split,
with four vocabularies / initialisations, then the gold judge's terms of greedy summaries on the
200 test posts.

    python studies/unused_rows.py --variants word,word633,bpe_random,bpe_zero --seed 0 --max_steps 1000

- word:        a word-level vocabulary of the world's words (109 tokens, all in the text; the
               world's tokenizer before it became a byte-level BPE, which AutoTokenizer misreads);
- word633:     the same plus 524 tokens the text never contains, random rows (as many as the BPE);
- word633_zero: the same, those 524 rows at zero;
- word160_zero: the word-level vocabulary plus 51 tokens the text never contains, at zero;
- bpe_random:  the world's byte-level BPE (633 tokens, 109 in the text, 3 special), every row random;
- bpe_zero:    the same, the 521 other rows at zero (scratch.build_model's
               `texts`: what sft.py does now);
- bpe_frozen:  the same, those rows kept at zero during training (their gradient dropped).
Appends one JSON line per run (or per --rescore of a run) to studies/unused_rows.json. One run: ~3 to 6 min on a CPU core.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
from rlhf import data  # noqa: E402
from rlhf import sampling  # noqa: E402
from worlds import scratch  # noqa: E402
import sft  # noqa: E402
from worlds import world  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = world.build_tokenizer  # the world's own, before run() swaps it


def BPE():
    """The world's tokenizer before 2026-12-04 (commit 9a4f5b8): a byte-level BPE in Qwen2's layout
    whose merges make every word, with or without its leading space, and " .\n" one token."""
    words = world.vocabulary()
    return scratch.word_tokenizer(words + [" " + w for w in words] + [f" {p}\n" for p in ".?!"])


def word_level(pad_to=0):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(scratch.SPECIAL_TOKENS + world.vocabulary())}
    for k in range(pad_to - len(vocab)):
        vocab[f"unused{k}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return scratch._wrap(tok)


def added_words(alphabet=""):
    """A prototype: Qwen2's layout with the world's characters (and `alphabet`) as the BPE (no
    merges) and every world word, with its leading space (and "POST:", "TL;DR:" without), as an
    added token."""
    from tokenizers import AddedToken

    words = world.vocabulary()
    tok = scratch.char_tokenizer([" ".join(words) + "\n" + alphabet]).backend_tokenizer
    tok.add_tokens([AddedToken(" " + w, normalized=False) for w in words]
                   + [AddedToken(w, normalized=False) for w in ("POST:", "TL;DR:")])
    return scratch._wrap(tok)


VARIANTS = {  # name -> (tokenizer, rows the text never contains: "random" | "zero" | "frozen" at zero)
    "word": (word_level, "random"),
    "word633": (lambda: word_level(len(BPE())), "random"),
    "word633_zero": (lambda: word_level(len(BPE())), "zero"),
    "word160_zero": (lambda: word_level(160), "zero"),
    "bpe_random": (BPE, "random"),
    "bpe_zero": (BPE, "zero"),
    "bpe_frozen": (BPE, "frozen"),
    "added": (added_words, "zero"),
    "added_ascii": (lambda: added_words("".join(map(chr, range(32, 127))) + "\t"), "zero"),
    "added_bytes": (lambda: added_words("".join(map(chr, range(256)))), "zero"),
    "world": (WORLD, "zero"),
}


def freeze_zero_rows(model):
    """Keep the embedding rows that start at zero at zero: their gradient is dropped."""
    weight = model.get_input_embeddings().weight
    rows = (weight.detach() == 0).all(1).nonzero().squeeze(1)
    weight.register_hook(lambda grad: grad.index_fill(0, rows, 0.0))
    return model


def run(variant, seed, max_steps, output_dir):
    make_tokenizer, rows = VARIANTS[variant]
    build = scratch.build_model

    def build_variant(tok, *a, texts=None, **k):
        model = build(tok, *a, texts=None if rows == "random" else texts, **k)
        return freeze_zero_rows(model) if rows == "frozen" else model

    world.build_tokenizer, scratch.build_model = make_tokenizer, build_variant
    try:
        start = time.time()
        sys.argv = ["sft.py", "--seed", str(seed), "--max_steps", str(max_steps), "--output_dir", output_dir,
                    "--overwrite_output_dir"]
        sft.main()
        seconds = time.time() - start
    finally:
        world.build_tokenizer, scratch.build_model = WORLD, build
    return {"variant": variant, "vocab": len(make_tokenizer()), "seed": seed, "max_steps": max_steps,
            **score(variant, output_dir), "seconds": round(seconds)}


def score(variant, output_dir):
    """The gold judge's terms of the greedy summaries of the 200 test posts; `stopped` counts the
    facts missed because the summary ended early (fewer clauses than the post has facts), the rest
    of `missed` is clauses that state a fact wrongly."""
    from transformers import AutoModelForCausalLM

    tok = VARIANTS[variant][0]()  # the project's loader would read a word-level folder too; this is the same object
    model = AutoModelForCausalLM.from_pretrained(output_dir).eval()
    test = common.embedded_world()["test"]
    texts, _, _ = sampling.sample_texts(model, tok, [data.render_prompt(tok, p) for p in test["prompt"]], 48,
                                        do_sample=False)
    counts = [world.gold_counts(p, t) for p, t in zip(test["post"], texts)]
    for c, t in zip(counts, texts):
        c["stopped"] = max(0, c["n"] - len(world._clauses(t)))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"gold": mean([world.gold_score(p, t) for p, t in zip(test["post"], texts)]),
            **{k: mean([c[k] for c in counts]) for k in ("missed", "stopped", "unsupported", "repeated")},
            **early_stops(model, tok, test), "sample": texts[0]}


@torch.no_grad()
def early_stops(model, tok, test):
    """Why greedy summaries end early: at each clause boundary before all of the post's facts are
    stated, the next-token probabilities of EOS and of the names; over the boundaries where greedy
    picks EOS, how often the names together are more likely than EOS (sampling would go on more
    often than not, but no single name beats EOS), and the mean of each."""
    names = [tok(" " + p, add_special_tokens=False)["input_ids"] for p in world.PEOPLE]
    if any(len(ids) != 1 for ids in names):  # the word-level vocabulary has no leading spaces
        names = [tok(p, add_special_tokens=False)["input_ids"] for p in world.PEOPLE]
    names = [ids[0] for ids in names]
    stops = []  # (P(EOS), P(any name), P(the likeliest name)) where greedy stops early
    for prompt, post in zip(test["prompt"], test["post"]):
        n = len(world.key_facts(post))
        ids, mask = data.encode_prompts(tok, [prompt])
        ids = ids[mask.bool()][None]  # (1, T): one prompt, no padding
        out = []
        for _ in range(48):
            probs = model(input_ids=ids).logits[0, -1].float().softmax(-1)  # (V,)
            nxt = int(probs.argmax())
            clauses = len(world._clauses(tok.decode(out)))
            if nxt == tok.eos_token_id:
                if out and tok.decode(out).rstrip().endswith(".") and clauses < n:
                    stops.append((float(probs[tok.eos_token_id]), float(probs[names].sum()), float(probs[names].max())))
                break
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    mean = lambda xs: round(sum(xs) / max(1, len(xs)), 3)  # noqa: E731
    return {"early_stops": len(stops), "early_stops_names_above_eos": sum(nm > e for e, nm, _ in stops),
            "early_stop_p_eos": mean([e for e, _, _ in stops]), "early_stop_p_names": mean([nm for _, nm, _ in stops]),
            "early_stop_p_top_name": mean([t for _, _, t in stops])}


def print_table(variants):
    """Per variant and seed the newest line of studies/unused_rows.json, then the mean over seeds."""
    newest = {}
    with open(os.path.join(HERE, "unused_rows.json")) as f:
        for line in f:
            r = json.loads(line)
            newest[r["variant"], r["seed"]] = {**newest.get((r["variant"], r["seed"]), {}), **r}
    cols = ("gold", "missed", "stopped", "unsupported", "early_stops", "early_stops_names_above_eos")
    print("| variant | seeds | " + " | ".join(cols) + " |\n|" + "---|" * (len(cols) + 2))
    for v in variants:
        rows = [r for (name, _), r in sorted(newest.items()) if name == v]
        for r in rows + [None]:
            if r is None:  # the mean over the seeds that have every column
                full = [x for x in rows if all(c in x for c in cols)]
                if len(full) < 2:
                    continue
                r = {"seed": "mean of " + ",".join(str(x["seed"]) for x in full),
                     **{c: sum(x[c] for x in full) / len(full) for c in cols}}
            print(f"| {v} | {r['seed']} | " + " | ".join(f"{r[c]:.3f}" if c in r else "" for c in cols) + " |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_steps", type=int, default=1000)
    p.add_argument("--output_dir", default="runs/unused_rows")
    p.add_argument("--rescore", action="store_true", help="score the runs already in --output_dir; train nothing")
    p.add_argument("--table", action="store_true", help="print studies/unused_rows.json's newest line per variant and seed as a table")
    args = p.parse_args()
    if args.table:
        return print_table(args.variants.split(","))
    for v in args.variants.split(","):
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}: choose from {', '.join(VARIANTS)}")
        folder = os.path.join(args.output_dir, f"{v}_seed{args.seed}")
        if args.rescore:
            result = {"variant": v, "seed": args.seed, "rescored": folder, **score(v, folder)}
        else:
            result = run(v, args.seed, args.max_steps, folder)
        print(json.dumps(result))
        with open(os.path.join(HERE, "unused_rows.json"), "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
