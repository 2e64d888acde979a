"""rollouts.py: the one way the training scripts sample. Plain decoding (sampling.generate), a
vLLM engine (vllm_rollouts.py, --use_vllm) and the tool loop (tools.py, --tools) sit behind one
contract, chosen once before the training loop (`start`): grpo.py, ppo.py and dpo.py --online
call `sample` the same way, whatever samples, and read a `Rollout`. What only one sampler has
is a field of the Rollout (the engine's log-probs, the tool exchange), never a branch in a loop.

    sampler = rollouts.start(model, tokenizer, args, max_new_tokens, tools)   # before the loop
    for step in ...:
        rollouts.load_weights(sampler, model)    # the engine samples with the current weights
        rollout = rollouts.sample(sampler, model, prompt_ids, prompt_mask, prompts, n, (step, micro))
        rollouts.release(sampler)                # --vllm_enable_sleep_mode: memory back for the update
    rollouts.stop(sampler)                       # last: vLLM's shutdown ends the process group

Seeds: the rollout at (step, micro-batch) samples with `sampling_kwargs`' seed, the same on every
rank, so N ranks sample what 1 rank would and a resumed run samples again what it sampled before.
"""

import dataclasses
import time

import torch

from rlhf import sampling
from rlhf import throughput
from rlhf import tools as tool_calls
from rlhf import vllm_rollouts


@dataclasses.dataclass
class Rollout:
    completion_ids: torch.Tensor  # (N, C) right-padded; rows i*n..(i+1)*n-1 continue prompt i
    attention_mask: torch.Tensor  # (N, C) every token the model reads (tool replies included)
    completion_mask: torch.Tensor  # (N, C) the model's own tokens: what is trained on
    truncated: torch.Tensor  # (N,) True where the completion has no stop token
    texts: list  # the decoded completions, as reward functions read them
    messages: list = None  # a tool exchange in TRL's conversational form (assistant and tool turns), per row
    sampling_logprobs: torch.Tensor = None  # (N, C) the sampler's own log-probs, where it is not the trainer (vLLM)
    tool_calls: int = None  # tool calls made on this rank (None: no tools), and how many failed
    tool_failures: int = None

    def completion_id_lists(self):
        """TRL's `completion_ids` for reward functions: each row's ids without padding."""
        return sampling.completion_id_lists(self.completion_ids, self.attention_mask)

    def reward_completions(self, prompts):
        """What reward functions receive, in TRL's form: the tool exchange's messages, else the
        text (after a text prompt) or one assistant message (after a conversation)."""
        return self.messages if self.messages is not None else sampling.reward_completions(prompts, self.texts)


@dataclasses.dataclass
class Sampler:
    tokenizer: object
    args: object  # the script's Args: temperature and the sampling knobs (sampling_kwargs)
    max_new_tokens: int
    engine: object = None  # this rank's vLLM engine (--use_vllm)
    tools: list = ()  # tools.Tool list (--tools)


def sampling_kwargs(args, step, micro=0):
    """The sampling knobs of a SamplingArgs, as keyword arguments of sampling.generate, and the
    seed of the rollout at (step, micro-batch): the same on every rank (generate keys each row's
    noise by this seed, the decoding step and the row's place in the global batch), so N ranks
    sample what 1 rank would, and a resumed run samples again what it sampled before."""
    return {"top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
            "seed": (args.seed * 1_000_003 + step) * 1_009 + micro}


def start(model, tokenizer, args, max_new_tokens, tools=()):
    """The sampler of this run: a vLLM engine holding the policy's weights with --use_vllm
    (`max_model_len` prompt + completion), the tools with --tools, else plain decoding."""
    engine = None
    if getattr(args, "use_vllm", False):
        engine = vllm_rollouts.start_engine(model, tokenizer, args, args.max_prompt_length + max_new_tokens)
    return Sampler(tokenizer, args, max_new_tokens, engine, list(tools))


def sample(sampler, model, prompt_ids, prompt_mask, prompts, num_return_sequences, position):
    """`num_return_sequences` completions of each of the left-padded prompts (B, P) -> a Rollout of
    B*n rows. `prompts`: the dataset's prompts (the tool loop continues their conversations);
    `position`: (step, micro-batch), which seeds the sample. Its time and the tokens the policy
    sampled are the step's rollout (rlhf/throughput.py)."""
    s, n, start = sampler, num_return_sequences, time.perf_counter()
    knobs = sampling_kwargs(s.args, *position)
    if s.tools:
        # the model's turns and the tools' replies: the model reads all of them (attention_mask) and is
        # trained on its own tokens only (completion_mask is 0 on tool replies and the template's glue)
        r = tool_calls.generate_with_tools(model, s.tokenizer, prompt_ids, prompt_mask, prompts, s.tools,
                                           s.args.max_tool_calling_iterations, s.max_new_tokens, s.args.temperature, n,
                                           **knobs)
        texts = [s.tokenizer.decode(ids[m.bool()]) for ids, m in zip(r.completion_ids, r.attention_mask)]
        rollout = Rollout(r.completion_ids, r.attention_mask, r.completion_mask, r.truncated, texts, r.messages,
                          tool_calls=r.calls, tool_failures=r.failures)
    else:
        sampling_logprobs = None
        if s.engine is None:
            ids, mask, truncated = sampling.generate(model, s.tokenizer, prompt_ids, prompt_mask, s.max_new_tokens,
                                                     s.args.temperature, num_return_sequences=n, **knobs)
        else:  # the same contract, plus the engine's log-probs of its samples (B*n, C)
            ids, mask, truncated, sampling_logprobs = vllm_rollouts.generate(
                sampler.engine, model, s.tokenizer, prompt_ids, prompt_mask, s.max_new_tokens, s.args.temperature,
                num_return_sequences=n, **knobs)
        texts = sampling.decode_completions(s.tokenizer, ids, mask, truncated)  # on the CPU: the sampling is done
        rollout = Rollout(ids, mask, mask, truncated, texts, sampling_logprobs=sampling_logprobs)
    throughput.add_rollout(time.perf_counter() - start, rollout.completion_mask.sum())
    return rollout


def concat(parts, pad_token_id):
    """Rollouts of several micro-batches as one, right-padded to the longest completion."""
    width = max(r.completion_ids.shape[1] for r in parts)

    def cat(name, value=0):
        return torch.cat([torch.nn.functional.pad(getattr(r, name), (0, width - getattr(r, name).shape[1]), value=value)
                          for r in parts])

    return Rollout(cat("completion_ids", pad_token_id), cat("attention_mask"), cat("completion_mask"),
                   torch.cat([r.truncated for r in parts]), [t for r in parts for t in r.texts],
                   None if any(r.messages is None for r in parts) else [m for r in parts for m in r.messages],
                   None if any(r.sampling_logprobs is None for r in parts) else cat("sampling_logprobs"),
                   None if any(r.tool_calls is None for r in parts) else sum(r.tool_calls for r in parts),
                   None if any(r.tool_failures is None for r in parts) else sum(r.tool_failures for r in parts))



def take_rows(rollout, rows):
    """The rows `rows` (a list of indices) of a Rollout; its tool-call counts stay those of the
    whole rollout (calls made on this rank, kept or not)."""
    index = torch.tensor(rows, dtype=torch.long)

    def pick(value):
        if value is None:
            return None
        return value[index.to(value.device)] if torch.is_tensor(value) else [value[i] for i in rows]

    return Rollout(pick(rollout.completion_ids), pick(rollout.attention_mask), pick(rollout.completion_mask),
                   pick(rollout.truncated), pick(rollout.texts), pick(rollout.messages), pick(rollout.sampling_logprobs),
                   rollout.tool_calls, rollout.tool_failures)

def load_weights(sampler, model):
    """Before a rollout: an engine takes the policy's current weights (plain decoding and the
    tool loop sample with the policy itself). Returns the seconds it took, as a metric."""
    if sampler.engine is None:
        return {}
    return {"vllm/sync_seconds": vllm_rollouts.sync_weights(sampler.engine, model)}


def release(sampler):
    """After a rollout, with --vllm_enable_sleep_mode: the engine frees its memory for the update."""
    vllm_rollouts.sleep(sampler.engine, sampler.args)


def stop(sampler):
    """The scripts' last act: vLLM's shutdown destroys the default process group (vllm_rollouts.shutdown)."""
    vllm_rollouts.shutdown(sampler.engine)
