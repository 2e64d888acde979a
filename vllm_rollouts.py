"""Rollouts with vLLM (`--use_vllm`): sampling.generate's job done by a vLLM engine, for the
scripts that sample. Read beside sampling.py, whose conventions it keeps: prompts left-padded
(B, P), completions right-padded (B*n, C), rows i*n..(i+1)*n-1 prompt i's, a completion ends at
any of `sampling.stop_token_ids`, `truncated` where none was produced.

Colocate mode, as TRL's `vllm_mode="colocate"`: one engine per rank, inside the training process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so no engine process is spawned), sampling that rank's rows.
The engine is built once from the policy's config; the policy's weights are then copied into it
in place, without a disk round trip, at the start and before every rollout (`sync_weights`; a
LoRA policy sends its merged weights W + (alpha/r) B A).

What comes back, beside what sampling.generate returns: vLLM's log-prob of every sampled token,
(B*n, C), after its temperature, top-k, top-p, min-p and repetition penalty ("processed
log-probs", as TRL asks for), i.e. the log-prob of the distribution the token was drawn from.
Without those filters that is the trainer's `completion_logprobs` up to the engine's numerics: in
fp32 equal to 1e-5 (tests/test_vllm.py), in bf16 not, which is what grpo.py's importance-sampling
correction is for.

Seeds: every completion is its own request with its own seed, derived from the rollout's seed
(common.sampling_kwargs) and the row's index in the global batch, so a resumed run draws the same
requests again, and rank r's requests are those a single process gives to rank r's rows.
The samples are not those of sampling.generate (another random stream), and whether N ranks
sample exactly what one rank would depends on the engine's numerics being independent of the
batch it runs, which vLLM does not promise (not tested here yet).
"""

import os
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process (colocate)

import torch

import basics
import parallel
import sampling


# ============================================================================ engine
def check_args(args):
    """Refuse, before anything loads, what the engine cannot reproduce (one sentence each)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        basics.fail(f"--use_vllm needs vLLM ({e}): run `make vllm-env` and use .venv-vllm/bin/python "
                    "(README, \"Rollouts with vLLM\").")
    if getattr(args, "load_in_4bit", False) or getattr(args, "load_in_8bit", False):
        basics.fail("--use_vllm with --load_in_4bit / --load_in_8bit is not supported: the engine would need "
                    "the merged unquantised weights every step; drop one of the two.")
    if parallel.world_size() > 1 and getattr(args, "parallel", "ddp") == "fsdp2":
        basics.fail("--use_vllm with --parallel fsdp2 is not supported yet (the weights would be gathered every "
                    "step); use --parallel ddp.")
    if args.min_p > 0 and args.top_p < 1.0:
        basics.fail(f"--use_vllm with both --min_p {args.min_p} and --top_p {args.top_p} is refused: vLLM applies "
                    "min-p before top-p, the project's sampler after it, so the two would sample different "
                    "distributions; pass one of them.")


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
    with tempfile.TemporaryDirectory() as folder:
        inner.config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        llm = LLM(model=folder, load_format="dummy", dtype=dtype, seed=args.seed, max_model_len=max_model_len,
                  gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                  generation_config="vllm",  # every sampling knob comes from the run, none from the model folder
                  enforce_eager=True,  # no CUDA graphs: the weights change in place every step
                  logprobs_mode="processed_logprobs",  # log-probs of the distribution sampled from (TRL's choice)
                  enable_prefix_caching=False)  # a cached prompt must not outlive a weight update
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
        if ".base_layer." in name and name.endswith(".weight"):
            layer = inner.get_submodule(name.split(".base_layer.")[0])
            tensor = tensor + sum(layer.get_delta_weight(a) for a in layer.active_adapters)
        yield name.replace(".base_layer.", "."), tensor


def sync_weights(llm, model):
    """Copy the policy's current weights into the engine, in place (vLLM's reload_weights), and
    return the seconds it took."""
    start = time.time()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": policy_weights(model)})
    return time.time() - start


def shutdown(llm):
    """Stop the engine; called before the process group is destroyed (vLLM's own cleanup at exit
    fails once the default group is gone)."""
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
