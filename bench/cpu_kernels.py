"""bench/cpu_kernels.py: the kernels behind docs/benchmarks.md's notes on a CPU step, each timed alone on
random tensors of SmolLM2-135M-Instruct's shapes (no weights needed), least CPU time of --repeats:

- decoding's matmuls: 8 rows times each of the model's 211 weight matrices (30 layers of q, k, v, o,
  gate, up, down, and the 49,152 x 576 head), as plain fp32 `F.linear`, against a transposed copy
  of each weight, as W x^T, against MKL's packed weights (`decoding.packed_weights`'s op) and
  oneDNN's; the packing's time and size; one core's read bandwidth (`sum` over as many bytes);
- the head's log-probs of 256 tokens, forward and backward: autograd's `gather - logsumexp`
  against `sampling.LabelLogprob`, each also with the entropy (autograd's: the softmax times the
  log-softmax, without gradient);
- attention of a prompt of 38 tokens and 8 completions of 32 in one row (9 heads of 64), forward
  and backward: sdpa over the whole block mask against `sampling.prompt_block_attention`;
- clipping the gradients and AdamW's fused step: `clip_grad_norm_` then the step, against
  `common.optimizer_step`, which clips inside the fused kernel;
- with --model: forward + backward of `completion_logprobs` for DPO's shape (2 prompts of 42 tokens x
  2 completions of 15, random tokens) with the blocks and with the whole mask, alternating 4 times;
  `sampling.generate` of 1 prompt x 8 completions x 32 tokens, its forwards under inference mode
  (as it runs them) against no_grad, alternating 4 times; the same through decoding's fused step of the
  Llama family (`decoding.llama_step`) against the model's own forward on packed weights, alternating 4
  times; forward + backward of `completion_logprobs` for GRPO's shape reading each completion but its
  last token (`sampling.states_before`) against reading all of it, alternating 4 times; and the same
  pass with the tied embedding's gradient sparse (`models.sparse_tied_embedding`) and dense,
  alternating 6 times, with the page faults of each.

    OMP_NUM_THREADS=1 python bench/cpu_kernels.py [--model models/SmolLM2-135M-Instruct] [--only SECTIONS]
"""

import argparse
import os
import sys
import time
import types
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlhf import decoding  # noqa: E402
from rlhf import sampling  # noqa: E402

HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30  # SmolLM2-135M-Instruct
LAYER_SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN),
                (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def cpu_best(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def decode_matmuls(repeats, rows=8):
    weights = [torch.randn(o, i) * 0.02 for o, i in LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]]
    x = {n: torch.randn(rows, n) for n in (HIDDEN, INTERMEDIATE)}
    xt = {n: t.t().contiguous() for n, t in x.items()}
    nbytes = sum(w.numel() * 4 for w in weights)
    flat = torch.randn(nbytes // 4)
    read = cpu_best(lambda: flat.sum(), repeats)
    del flat
    print(f"decoding: {rows} rows x {len(weights)} fp32 weights ({nbytes / 1e6:.0f} MB); one core reads "
          f"{nbytes / read / 1e9:.1f} GB/s (sum): {read * 1e3:.1f} ms a token at that rate")

    def token(products):
        return lambda: [f() for f in products]

    def report(name, products):
        print(f"  {name:32} {cpu_best(token(products), repeats) * 1e3:6.1f} ms a token")

    report("F.linear (plain)", [lambda w=w: F.linear(x[w.shape[1]], w) for w in weights])
    transposed = [w.t().contiguous() for w in weights]
    report("x @ (a transposed copy of W)", [lambda t=t: x[t.shape[0]] @ t for t in transposed])
    del transposed
    report("W @ x^T", [lambda w=w: w @ xt[w.shape[1]] for w in weights])
    if torch.backends.mkl.is_available():
        start = time.process_time()
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        first = time.process_time() - start
        again = cpu_best(lambda: [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights], 2)
        print(f"  MKL packing: {first:.3f} s into fresh memory, {again:.3f} s again; "
              f"{sum(p.numel() * 4 for p in packed) / 1e6:.0f} MB of packed copies")
        report("MKL packed (decoding.packed_weights)",
               [lambda w=w, p=p: torch.ops.mkl._mkl_linear(x[w.shape[1]], p, w, None, rows) for w, p in zip(weights, packed)])
        del packed
    if torch.backends.mkldnn.is_available():
        start = time.process_time()
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        print(f"  oneDNN packing: {time.process_time() - start:.3f} s")
        report("oneDNN packed", [lambda w=w, p=p: torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], p, None, "none", [], "")
                                 for w, p in zip(weights, packed)])


def head_logprobs(repeats, tokens=256):
    torch.manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN) * 0.02).requires_grad_()
    hidden = torch.randn(tokens, HIDDEN, requires_grad=True)
    labels, upstream = torch.randint(0, VOCAB, (tokens,)), torch.randn(tokens)

    def autograd_way():
        logits = (hidden @ weight.t()).float()
        return logits.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)

    def autograd_with_entropy():
        logits = (hidden @ weight.t()).float()
        with torch.no_grad():
            (logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        return logits.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)

    def ours(entropy=False):
        return sampling.LabelLogprob.apply((hidden @ weight.t()).float(), labels, entropy)[0]

    print(f"the head's log-probs: {tokens} tokens x {VOCAB} x {HIDDEN}, forward + backward")
    for name, fn in (("autograd: gather - logsumexp", autograd_way), ("sampling.LabelLogprob", ours),
                     ("autograd, and the entropy", autograd_with_entropy),
                     ("sampling.LabelLogprob, entropy", lambda: ours(True))):
        def step(fn=fn):
            weight.grad = hidden.grad = None
            fn().backward(upstream)
        print(f"  {name:32} {cpu_best(step, repeats) * 1e3:6.1f} ms")


def block_attention(repeats, P=38, k=8, C=32, heads=9, kv_heads=3, head_dim=64):
    T = P + k * C
    seen = {}

    def body(**kw):
        seen.update(kw)
        return types.SimpleNamespace(last_hidden_state=torch.zeros(kw["input_ids"].shape + (1,)))

    sampling.prompt_rows(body, torch.ones(1, P, dtype=torch.long), torch.ones(1, P, dtype=torch.long),
                         torch.ones(k, C, dtype=torch.long), torch.ones(k, C, dtype=torch.long))
    mask = seen["attention_mask"]  # (1, 1, T, T): prompt_rows' block mask
    torch.manual_seed(0)
    q, key, value = (torch.randn(1, n, T, head_dim, requires_grad=True) for n in (heads, kv_heads, kv_heads))
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    upstream = torch.randn(1, T, heads, head_dim)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    print(f"attention of one row: a prompt of {P} and {k} completions of {C} ({T} tokens), {heads} heads "
          f"({kv_heads} key/value) of {head_dim}, x{LAYERS} layers")
    for name, fn in (("sdpa over the whole (T, T) mask", lambda: sdpa_attention_forward(module, q, key, value, mask)),
                     ("sampling.prompt_block_attention",
                      lambda: sampling.prompt_block_attention(module, q, key, value, mask, prompt_blocks=(P, k, C)))):
        forward = cpu_best(fn, repeats)
        both = cpu_best(lambda fn=fn: fn()[0].backward(upstream), repeats)
        print(f"  {name:32} forward {forward * LAYERS * 1e3:6.1f} ms, forward + backward {both * LAYERS * 1e3:6.1f} ms")


def dpo_blocks(model_dir, repeats, B=2, k=2, P=42, C=15):
    import argparse as ap

    from rlhf import models

    args = ap.Namespace(dtype="float32", trust_remote_code=False, attn_implementation="sdpa", use_peft=False,
                        load_in_4bit=False, load_in_8bit=False, gradient_checkpointing=False)
    model = models.load_model(model_dir, args).train()
    torch.manual_seed(0)
    p_ids, c_ids = torch.randint(100, 1000, (B, P)), torch.randint(100, 1000, (B * k, C))

    def step():
        model.zero_grad(set_to_none=True)
        sampling.completion_logprobs(model, p_ids, torch.ones_like(p_ids), c_ids, torch.ones_like(c_ids)).sum().backward()

    times = {"blocks": [], "whole mask": []}
    for _ in range(4):
        for name, threshold in (("blocks", 0), ("whole mask", float("inf"))):
            sampling.BLOCK_ATTENTION_MIN_WORK = threshold
            step()
            times[name].append(cpu_best(step, repeats))
    print_times(f"completion_logprobs, {B} prompts of {P} x {k} completions of {C}, forward + backward ({model_dir}):", times)


def clip_and_step(repeats):
    """clip_grad_norm_ then torch's fused AdamW, against common.optimizer_step, which clips inside
    the fused kernel (grad_scale); the model's shapes, one tied head, gradients set afresh each time."""
    import common

    torch.manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)] + [(HIDDEN,)] * (2 * LAYERS + 1)
    params = [torch.nn.Parameter(torch.randn(shape) * 0.02) for shape in shapes]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
    grads = [torch.randn_like(p) for p in params]  # norm ~ 11,600: clipped to 1

    def clip_then_step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = {"clip_grad_norm_, then the step": [], "common.optimizer_step": []}
    for _ in range(repeats + 1):
        for name, fn in (("clip_grad_norm_, then the step", clip_then_step),
                         ("common.optimizer_step", lambda: common.optimizer_step(optimizer, 1.0))):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    print(f"clipping and AdamW's step over {sum(p.numel() for p in params) / 1e6:.1f}M fp32 parameters (fused AdamW):")
    for name, seconds in times.items():
        print(f"  {name:32} {min(seconds[1:]) * 1e3:6.1f} ms")  # the first (AdamW's state made) left out


def fp32_model(model_dir):
    """The model as transformers loads it, fp32 under sdpa: none of the project's own settings."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")


def generate_two_ways(model_dir, repeats, names, patch, k=8, P=38, C=32):
    """sampling.generate of one prompt x k completions x C tokens as it runs (names[0]) and inside
    `patch()` (names[1]), alternating `repeats` times."""
    from transformers import AutoTokenizer

    model = fp32_model(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    ids = torch.randint(100, 1000, (1, P))

    def generate():
        sampling.generate(model, tokenizer, ids, torch.ones_like(ids), C, num_return_sequences=k, seed=0)

    generate()
    times = {name: [] for name in names}
    for _ in range(repeats):
        times[names[0]].append(cpu_best(generate, 1))
        with patch():
            times[names[1]].append(cpu_best(generate, 1))
    print_times(f"sampling.generate, 1 prompt of {P} x {k} completions of up to {C} tokens ({model_dir}):", times)


def print_times(title, times):
    print(title)
    for name, seconds in times.items():
        print(f"  {name:32} " + ", ".join(f"{t * 1e3:.0f}" for t in seconds) + " ms")


def decoding_modes(model_dir, repeats):
    """sampling.generate, its forwards under inference mode (as it runs them) against no_grad."""
    generate_two_ways(model_dir, repeats, ("inference mode", "no_grad"),
                      lambda: mock.patch.object(torch, "inference_mode", lambda mode=True: torch.no_grad()))


def fused_step(model_dir, repeats):
    """sampling.generate through decoding's fused step of the Llama family (`decoding.llama_step`, as
    it runs) against the model's own forward on MKL-packed weights."""
    generate_two_ways(model_dir, repeats, ("fused Llama step", "the model's forward"),
                      lambda: mock.patch.object(decoding, "llama_weights", lambda *a: None))


def last_token(model_dir, repeats, k=8, P=38, C=32):
    """Forward + backward of completion_logprobs for GRPO's shape (1 prompt x k completions of C
    tokens, random tokens), the model reading each completion but its last token
    (`sampling.states_before`, as it runs) against reading all C, alternating `repeats` times."""
    model = fp32_model(model_dir)
    torch.manual_seed(0)
    p_ids, c_ids = torch.randint(100, 1000, (1, P)), torch.randint(100, 1000, (k, C))

    def read_all(model, *args):  # every completion token through the model, the last state dropped
        return sampling.completion_states(model, *args)[:, :-1]

    def step():
        model.zero_grad(set_to_none=True)
        sampling.completion_logprobs(model, p_ids, torch.ones_like(p_ids), c_ids, torch.ones_like(c_ids)).sum().backward()

    step()
    times = {f"reads {C - 1} tokens a completion": [], f"reads {C}": []}
    for _ in range(repeats):
        times[f"reads {C - 1} tokens a completion"].append(cpu_best(step, 1))
        with mock.patch.object(sampling, "states_before", read_all):
            times[f"reads {C}"].append(cpu_best(step, 1))
    print_times(f"completion_logprobs, 1 prompt of {P} x {k} completions of {C}, forward + backward ({model_dir}):", times)


def tied_embedding(model_dir, repeats, k=8, P=38, C=32):
    """Forward + backward of completion_logprobs for GRPO's shape (1 prompt x k completions of C
    tokens, random tokens) with the tied embedding's gradient sparse (models.sparse_tied_embedding)
    and dense, alternating `repeats` times: CPU time and minor page faults of each."""
    import resource

    model = fp32_model(model_dir)
    embedding = model.get_input_embeddings()
    torch.manual_seed(0)
    p_ids, c_ids = torch.randint(100, 1000, (1, P)), torch.randint(100, 1000, (k, C))

    def step():
        model.zero_grad(set_to_none=True)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        start = time.process_time()
        sampling.completion_logprobs(model, p_ids, torch.ones_like(p_ids), c_ids, torch.ones_like(c_ids)).sum().backward()
        return time.process_time() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - usage.ru_minflt

    step()
    times = {"sparse": [], "dense": []}
    for _ in range(repeats):
        for name in times:
            embedding.sparse = name == "sparse"
            times[name].append(step())
    print(f"completion_logprobs, 1 prompt of {P} x {k} completions of {C}, forward + backward, the tied "
          f"embedding's gradient ({model_dir}):")
    for name, runs in times.items():
        print(f"  {name:32} " + ", ".join(f"{t * 1e3:.0f} ms ({faults // 1000}k faults)" for t, faults in runs))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="", help="A model folder for the sections that load one.")
    parser.add_argument("--only", default="", help="Comma-separated sections to run (default: all): decode, head, "
                        "attention, clip, and with --model dpo_blocks, decoding_modes, fused_step, last_token, tied_embedding.")
    cli = parser.parse_args()
    print(f"{torch.get_num_threads()} thread(s), torch {torch.__version__}")
    sections = {"decode": lambda: decode_matmuls(cli.repeats), "head": lambda: head_logprobs(cli.repeats),
                "attention": lambda: block_attention(cli.repeats), "clip": lambda: clip_and_step(cli.repeats)}
    if cli.model:
        sections.update(dpo_blocks=lambda: dpo_blocks(cli.model, 4), decoding_modes=lambda: decoding_modes(cli.model, 4),
                        fused_step=lambda: fused_step(cli.model, 4), last_token=lambda: last_token(cli.model, 4),
                        tied_embedding=lambda: tied_embedding(cli.model, 6))
    for name, run in sections.items():
        if not cli.only or name in cli.only.split(","):
            run()


if __name__ == "__main__":
    main()
