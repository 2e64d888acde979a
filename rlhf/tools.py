"""tools.py: tool calling in sampled completions (TRL's GRPOTrainer `tools=` and
`max_tool_calling_iterations`): the model calls functions mid-answer, the replies join the
context, and generation goes on. Plumbing only; what grpo.py trains on is its own business
(it trains on the model's tokens: `completion_mask` below).

Read top to bottom:
1. `load_tools("file.py:fn,file.py:fn2")`: each file is EXECUTED in this process (its top-level
   code runs, as an import would) to get the function; its JSON schema comes from its signature
   and docstring (transformers' `get_json_schema`, as TRL), and goes to the chat template's
   `tools=` argument when prompts are rendered (data.render_prompt).
2. `parse_tool_calls(text)`: the calls an assistant turn makes, in the format of Qwen2.5's
   (and Hermes-style) chat templates: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
   any number of them, anywhere in the turn, and the other forms models write (`parse_tool_calls`).
   Anything else between the tags is a malformed call.
3. `execute(calls, tools)`: every call runs in sandbox.py's limited subprocess (the execution
   verifier's limits: rlimits; as root no network, every mount read-only but a private /tmp, and
   an unprivileged uid; the process group killed after `timeout` seconds): the tool's file is run there
   again, then the call, and `str()` of what it returns is the reply. So a tool imports the
   standard library only (the sandbox's interpreter runs with -S), holds no state between calls,
   and its reply is cut at sandbox.OUTPUT_CHARS characters (its own prints are silenced, so they
   never push the reply out of those). A malformed call, an unknown tool, a tool that raises and one that times out are not
   errors of the run: the reply is "error: <why>" and the call counts as failed
   (`tools/failure_frequency`).
4. `tool_turn_ids`: the tokens between the model's end-of-turn token and its next turn -- the
   template's glue after the assistant turn, the tool turns and the next generation prompt --
   rendered by the same chat template as `{"role": "tool", "name": ..., "content": ...}`
   messages (the difference of two renderings: the conversation with and without them).
5. `generate_with_tools`: sample a turn; rows whose turn ended with a stop token and holds
   `<tool_call>` (while fewer than `max_iterations` tool turns were made) get the replies
   appended and are sampled on; up to `max_completion_length` tokens in all, the tool tokens
   included (TRL). Returns the completion tokens (model's and tools'), the mask of what attention
   sees, the mask of the model's own tokens, and each row's exchange as messages.
"""

import dataclasses
import importlib.util
import json
import os
import re

import torch

from rlhf import basics
from rlhf import data
from rlhf import parallel
from rlhf import sampling
from rlhf import sandbox

TIMEOUT = 5.0  # wall-clock seconds per call (the sandbox's limit for a completion's code)


# ============================================================================ 1. loading
@dataclasses.dataclass
class Tool:
    name: str  # the function's name: what the model writes in "name"
    fn: object  # the function (loaded here, for its schema)
    source: str  # its file's text: run again in the sandbox for every call
    schema: dict  # transformers.utils.get_json_schema(fn)


def load_tools(spec):
    """`--tools file.py:fn[,file.py:fn2]` -> [Tool]. Executes each file in this process."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import (
        DocstringParsingException,
        TypeHintParsingException,
    )

    tools = []
    for item in [s for s in spec.split(",") if s]:
        path, _, name = item.rpartition(":")
        if not path.endswith(".py") or not name:
            basics.fail(f"--tools {item!r}: expected file.py:function.")
        if not os.path.isfile(path):
            basics.fail(f"--tools {item!r}: file {path} does not exist{basics.moved(path)}.")
        module_spec = importlib.util.spec_from_file_location(f"tool_{abs(hash(path))}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:  # the file is executed, as `python file.py` would: only pass files you trust
            basics.exec_user_file(module_spec, module)
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- the user's file: name it and its error
            basics.fail(f"--tools {item!r}: importing {path} raised {type(e).__name__}: {str(e)[:300]}; fix the file "
                        "(it is executed when loaded) and run again.")
        fn = getattr(module, name, None)
        if not callable(fn):
            basics.fail(f"--tools {item!r}: {path} defines no function {name!r}.")
        try:
            schema = get_json_schema(fn)
        except (DocstringParsingException, TypeHintParsingException) as e:
            basics.fail(f"--tools {item!r}: the model is shown a JSON schema built from the function's type hints and "
                        f"docstring, and this one has none ({e}). Add a type hint to every argument and a Google-style "
                        "docstring with an Args: line for each.")
        if name in [t.name for t in tools]:
            basics.fail(f"--tools: two tools are named {name!r}; the model calls tools by name.")
        with open(path) as f:
            tools.append(Tool(name, fn, f.read(), schema))
    return tools



def load_tools_for_prompts(spec, prompts, dataset):
    """--tools for these dataset prompts: [] without the flag; the tools otherwise, whose turns
    the chat template renders, so the prompts must be conversations."""
    if not spec:
        return []
    tools = load_tools(spec)  # first: a file that fails to import is the first thing to fix
    if not all(data.is_conversational(p) for p in prompts):
        basics.fail(f"--tools needs conversational prompts (lists of {{role, content}} messages) in {data.dataset_name(dataset)}: "
                    "tool turns are rendered by the chat template.")
    return tools


# ============================================================================ 2. parsing
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text):
    """The calls in an assistant turn, in order: each {"name": str, "arguments": dict}, or an
    error string for a malformed one (not JSON, no name, arguments not an object, an unclosed
    <tool_call>). A turn without "<tool_call>" makes no call: [].

    The forms models write besides Qwen2.5's: no "arguments" (or null, or "") for a tool without
    arguments, "parameters" in their place (Llama 3.1's JSON calls), the arguments as a JSON
    string (OpenAI's form), and a JSON list of calls in one <tool_call> (Mistral's form)."""
    calls = []
    for body in CALL.findall(text):
        # model output never stops the run: JSON nested too deep for the parser (RecursionError) or an
        # integer of more digits than Python converts (ValueError) is a malformed call like any other
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
            continue
        except (ValueError, RecursionError) as e:
            calls.append(f"the tool call cannot be read ({type(e).__name__}: {str(e)[:100]})")
            continue
        calls += [read_call(call) for call in (parsed if isinstance(parsed, list) and parsed else [parsed])]
    if text.count("<tool_call>") > len(CALL.findall(text)):  # an opened call never closed
        calls.append("a <tool_call> is not closed by </tool_call>")
    return calls


def read_call(call):
    """One parsed call object -> {"name", "arguments": dict}, or parse_tool_calls' error string."""
    malformed = 'a tool call must be {"name": <string>, "arguments": <object>}'
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return malformed
    args = call["arguments"] if "arguments" in call else call.get("parameters")
    if isinstance(args, str):  # a JSON string; an empty one is no arguments
        try:
            args = json.loads(args) if args.strip() else None
        except (ValueError, RecursionError):
            return malformed
    args = {} if args is None else args  # a tool without arguments: the key left out, null or ""
    if not isinstance(args, dict):
        return malformed
    return {"name": call["name"], "arguments": args}


# ============================================================================ 3. executing
MARK = "\x00tool-reply\x00"  # precedes the reply in the sandbox's output
SILENCE = "__import__('sys').stdout = __import__('sys').stderr = None\n"  # print() then writes nothing (its own rule)


def execute(calls, tools, timeout=None):
    """Run parsed calls (parse_tool_calls' items) -> [(name, reply, failed)], in order. Valid
    calls run in the sandbox, in parallel (sandbox.run_batch), each for at most `timeout` seconds
    (default: TIMEOUT); failures become "error: ..." replies."""
    timeout = timeout or TIMEOUT
    by_name = {t.name: t for t in tools}
    replies, jobs, where = [], [], []
    for call in calls:
        if isinstance(call, str):
            replies.append(("unknown", f"error: {call}", True))
        elif call["name"] not in by_name:
            replies.append((call["name"], f"error: unknown tool {call['name']!r}; the tools are {', '.join(by_name)}", True))
        else:
            # the file again, then the call (JSON arguments written as a Python literal: the sandbox
            # imports the standard library only); the reply goes to stdout after MARK
            # the tool's own prints are silenced (sys.stdout = None): the sandbox keeps only the first
            # OUTPUT_CHARS characters of the output, and a tool's chatter there would push the reply out
            test = (f"reply = str({call['name']}(**{call['arguments']!r})); "
                    f"__import__('sys').stdout = __import__('sys').__stdout__; print({MARK!r} + reply, end='')")
            where.append(len(replies))
            jobs.append((SILENCE + by_name[call["name"]].source, [test]))
            replies.append(None)
    for i, result in zip(where, sandbox.run_batch(jobs, timeout=timeout) if jobs else []):
        name = calls[i]["name"]
        if result.status == "timeout":
            replies[i] = (name, f"error: the tool did not return within {timeout:g} s", True)
        elif result.passed == (True,) and MARK in result.output:
            replies[i] = (name, result.output.split(MARK, 1)[1], False)
        else:  # the file or the call raised (the sandbox appends the exception), or the process died
            why = result.output.strip().splitlines()[-1] if result.output.strip() else result.status
            replies[i] = (name, f"error: {why.removeprefix('test: ').removeprefix('code: ')}", True)
    return replies


# ============================================================================ 4. rendering
def tool_turn_ids(tokenizer, conversation, tool_messages, schemas, after_stop):
    """Token ids of what follows the model's end-of-turn token: the rest of the template's
    rendering of that assistant turn (`after_stop`, e.g. Qwen's "\\n" after <|im_end|>), the tool
    messages and the next generation prompt, as the chat template renders them. `conversation`:
    the prompt's messages and the exchange so far, ending with the assistant turn."""
    kwargs = {"tokenize": False, "tools": schemas, **basics.CHAT_TEMPLATE_KWARGS}
    before = tokenizer.apply_chat_template(conversation, **kwargs)
    after = tokenizer.apply_chat_template(conversation + tool_messages, add_generation_prompt=True, **kwargs)
    if not after.startswith(before):
        basics.fail("the chat template does not render a conversation as a prefix of the same conversation with tool "
                    "replies added, so tool turns cannot be appended to sampled tokens; use a template that does "
                    "(e.g. Qwen2.5's).")
    return tokenizer(after_stop + after[len(before):], add_special_tokens=False)["input_ids"]


def glue_after_stop(tokenizer, schemas, stop_text):
    """What the template writes after an assistant turn's end-of-turn token (Qwen: "\\n"): read
    from a rendering of a one-word exchange."""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, tools=schemas, **basics.CHAT_TEMPLATE_KWARGS)
    at = text.rfind(stop_text)
    return text[at + len(stop_text):] if at >= 0 else ""


# ============================================================================ 5. the loop
@dataclasses.dataclass
class Rollout:
    completion_ids: torch.Tensor  # (N, C) the model's and the tools' tokens after the prompt, right-padded
    attention_mask: torch.Tensor  # (N, C) 1 on every one of them: what the model reads
    completion_mask: torch.Tensor  # (N, C) 1 on the model's own tokens only: what is trained
    truncated: torch.Tensor  # (N,) True where the last model turn has no stop token
    messages: list  # per row: [{"role": "assistant", ...}, {"role": "tool", ...}, ...] (TRL's form)
    calls: int  # tool calls made on this rank
    failures: int  # of which failed


def generate_with_tools(model, tokenizer, prompt_ids, prompt_mask, conversations, tools, max_iterations,
                        max_completion_length, temperature, num_return_sequences, seed=None, **sampling_kwargs):
    """Multi-turn sampling with tool calls (module docstring, 5.) -> Rollout.

    `conversations`: the prompts' messages (B lists), `prompt_ids`/`prompt_mask` their left-padded
    renderings (with the tools' schemas); row i continues prompt i // num_return_sequences.

    Rank independence: every turn is sampled by sampling.generate with a seed that depends only
    on `seed` and the turn's number, over ALL rows of this rank (those without a pending call
    too, whose new tokens are dropped), so row j draws the noise of global row j whatever the
    number of ranks (sampling.sampling_noise), as the first turn does.
    """
    n, schemas = num_return_sequences, [t.schema for t in tools]
    stops = sampling.stop_token_ids(model, tokenizer)
    after_stop = {s: glue_after_stop(tokenizer, schemas, tokenizer.decode([s])) for s in stops}
    N = prompt_ids.shape[0] * n
    tokens, own = [[] for _ in range(N)], [[] for _ in range(N)]  # per row: ids after the prompt; 1 = the model's
    messages = [[] for _ in range(N)]
    open_rows, truncated = list(range(N)), [False] * N  # rows still generating
    calls = failures = 0
    ctx_ids, ctx_mask = prompt_ids, prompt_mask  # turn 0: the prompts, each sampled n times
    for turn in range((max_iterations if max_iterations is not None else max_completion_length) + 1):
        budget = max(max_completion_length - min(len(tokens[i]) for i in open_rows), 1) if open_rows else 1
        turn_seed = None if seed is None else (seed * 1_000_033 + turn) % 2**63
        ids, mask, _ = sampling.generate(model, tokenizer, ctx_ids, ctx_mask, budget, temperature,
                                         num_return_sequences=n if turn == 0 else 1, seed=turn_seed, **sampling_kwargs)
        # the new assistant turn of every open row, cut at the row's own budget
        pending = []
        for i in open_rows:
            new = [t for t, m in zip(ids[i].tolist(), mask[i].tolist()) if m][:max_completion_length - len(tokens[i])]
            tokens[i] += new
            own[i] += [1] * len(new)
            ended = bool(new) and new[-1] in stops
            text = tokenizer.decode(new[:-1] if ended else new, skip_special_tokens=True)
            messages[i].append({"role": "assistant", "content": text})
            truncated[i] = not ended
            if ended and "<tool_call>" in text and (max_iterations is None or turn < max_iterations):
                pending.append((i, parse_tool_calls(text), new[-1]))
        # run every pending call of this rank at once, then append each row's tool turns
        replies = execute([c for _, cs, _ in pending for c in cs], tools)
        open_rows = []
        for i, cs, stop in pending:
            mine, replies = replies[:len(cs)], replies[len(cs):]
            calls += len(mine)
            failures += sum(failed for _, _, failed in mine)
            tool_msgs = [{"role": "tool", "name": name, "content": reply} for name, reply, _ in mine]
            glue = tool_turn_ids(tokenizer, conversations[i // n] + messages[i], tool_msgs, schemas, after_stop[stop])
            glue = glue[:max_completion_length - len(tokens[i])]
            tokens[i] += glue
            own[i] += [0] * len(glue)
            messages[i] += tool_msgs
            if len(tokens[i]) < max_completion_length:
                open_rows.append(i)
            else:  # no room left for the model's next turn
                truncated[i] = True
        more = len(open_rows)
        if parallel.is_sharded(model):  # FSDP2: every rank must run generate while any rank has an open row
            more = parallel.all_reduce(float(more), "sum")
        if not more:
            break
        # the next turn continues every row (prompt + everything so far), open or not (see docstring)
        contexts = [[t for t, m in zip(prompt_ids[i // n].tolist(), prompt_mask[i // n].tolist()) if m] + tokens[i]
                    for i in range(N)]
        ctx_ids, ctx_mask = data._pad(contexts, tokenizer.pad_token_id, left=True)
        ctx_ids, ctx_mask = ctx_ids.to(prompt_ids.device), ctx_mask.to(prompt_ids.device)
    ids, attention = data._pad(tokens, tokenizer.pad_token_id, left=False)
    own_mask, _ = data._pad(own, 0, left=False)
    device = prompt_ids.device
    return Rollout(ids.to(device), attention.to(device), own_mask.to(device), torch.tensor(truncated, device=device),
                   messages, calls, failures)
