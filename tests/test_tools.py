"""tools.py and grpo.py --tools: schemas, parsing, sandboxed calls, the multi-turn context and its
masks, log-probs in that context, no gradient on tool tokens, and a run end to end on a
Qwen2.5-shaped fixture (a byte-level tokenizer with Qwen2.5's special tokens and a chat template
that renders tools the way Qwen2.5's does, built here; a tiny Qwen2 model).

The tiny random model never writes a tool call by itself, so the tests that need calls replace
sampling.generate with a script (`scripted_generate`): each turn's text is fixed, everything else
(the loop, the sandbox, the template, the masks, grpo.py's log-probs and update) is the real code.
The arithmetic world's calculator (embedded:arith_tools, calculator.py) goes through the same code
with the world's own char-level tokenizer and chat template (the last tests).
"""

import json
import types

import pytest
import torch
from conftest import save_tiny

from rlhf import data
from rlhf import sampling
from rlhf import tools

# Qwen2.5's layout: a system turn listing the tools' JSON schemas inside <tools></tools>, calls as
# <tool_call>{json}</tool_call> in the assistant turn, consecutive tool replies grouped into one
# user turn as <tool_response>...</tool_response> (written for these tests, not Qwen's file)
QWEN_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\n"
    "For each call, return <tool_call>{\"name\": <name>, \"arguments\": <args>}</tool_call><|im_end|>\n"
    "{% else %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOLS_FILE = '''def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise ValueError("no luck")


def slow(x: int) -> int:
    """Never returns in time.

    Args:
        x: Anything.
    """
    while True:
        x += 1
'''


def qwen_tokenizer():
    """Byte-level BPE without merges (every text round-trips) + Qwen2.5's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = QWEN_TOOLS_TEMPLATE
    return tokenizer


def build_qwen(path):
    """A Qwen2.5-shaped folder: the tokenizer above and a tiny Qwen2 (random weights)."""
    return save_tiny(path, "Qwen2", qwen_tokenizer(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_qwen(tmp_path_factory.mktemp("tiny_qwen_tools"))


@pytest.fixture
def tool_list(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_FILE)
    return tools.load_tools(f"{path}:add,{path}:broken,{path}:slow")


def scripted_generate(turns):
    """A stand-in for sampling.generate whose k-th call returns, for every row, turns[k] (a string,
    or a list of one string per row) followed by the end-of-turn token."""
    calls = []

    def generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature=1.0,
                 num_return_sequences=1, seed=None, **kw):
        texts = turns[len(calls)]
        calls.append(prompt_ids)
        rows = prompt_ids.shape[0] * num_return_sequences
        texts = texts if isinstance(texts, list) else [texts] * rows
        seqs = [tokenizer(t, add_special_tokens=False)["input_ids"][:max_new_tokens - 1] + [tokenizer.eos_token_id]
                for t in texts]
        ids, mask = data._pad(seqs, tokenizer.pad_token_id, left=False)
        return ids, mask, torch.zeros(rows, dtype=torch.bool)
    generate.calls = calls
    return generate


def test_schema_equals_transformers(tool_list):
    from transformers.utils import get_json_schema

    add = tool_list[0]
    assert add.schema == get_json_schema(add.fn)
    assert add.schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "The first integer."},
            "b": {"type": "integer", "description": "The second integer."}}, "required": ["a", "b"]},
        "return": {"type": "integer"}}}


def test_undocumented_tool_fails_loudly(tmp_path):
    (tmp_path / "t.py").write_text("def f(x):\n    return x\n")
    with pytest.raises(SystemExit, match="docstring"):
        tools.load_tools(f"{tmp_path / 't.py'}:f")


def test_parse_tool_calls():
    text = ('I will add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}</tool_call>'
            '<tool_call>{"name": add}</tool_call><tool_call>[1]</tool_call><tool_call>{"name": "x"')
    calls = tools.parse_tool_calls(text)
    assert calls[:2] == [{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "add", "arguments": {"a": 1, "b": 1}}]
    assert "not valid JSON" in calls[2] and "must be" in calls[3] and "not closed" in calls[4]
    assert tools.parse_tool_calls("no call here") == []


CALL = '<tool_call>{"name": "%s", "arguments": {%s}}</tool_call>'


@pytest.mark.parametrize("turn, reply, failed", [
    (CALL % ("add", '"a": 2, "b": 3'), "5", False),
    ('<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>', "error: the tool call is not valid JSON", True),
    (CALL % ("nope", ""), "error: unknown tool 'nope'", True),
    (CALL % ("broken", '"x": 1'), "error: ValueError: no luck", True),
    (CALL % ("slow", '"x": 1'), "error: the tool did not return within 1 s", True),
], ids=["call", "malformed", "unknown", "raises", "timeout"])
def test_one_call_context_and_mask(qwen, tool_list, monkeypatch, turn, reply, failed):
    """The completion is the model's turn, the template's tool turn with the reply, then the
    model's next turn; completion_mask is 1 exactly on the model's two turns (end-of-turn included)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(qwen), AutoModelForCausalLM.from_pretrained(qwen)
    monkeypatch.setattr(tools, "TIMEOUT", 1.0)
    monkeypatch.setattr(sampling, "generate", scripted_generate([turn, "The answer is 5."]))
    conv = [{"role": "user", "content": "What is 2 + 3?"}]
    schemas = [t.schema for t in tool_list]
    ids, mask = data.encode_prompts(tok, [data.render_prompt(tok, conv, schemas)])
    out = tools.generate_with_tools(model, tok, ids, mask, [conv], tool_list, None, 2000, 1.0, 1)
    assert (out.calls, out.failures) == (1, int(failed))
    assert out.messages[0][0] == {"role": "assistant", "content": turn}
    assert out.messages[0][1]["role"] == "tool" and out.messages[0][1]["content"].startswith(reply)
    assert out.messages[0][2] == {"role": "assistant", "content": "The answer is 5."}
    # the context is exactly the template's rendering of the whole exchange
    full = tok.apply_chat_template(conv + out.messages[0], tools=schemas, tokenize=False)
    prompt = data.render_prompt(tok, conv, schemas)
    assert tok.decode(out.completion_ids[0][out.attention_mask[0].bool()]) == full[len(prompt):].removesuffix("\n")
    # the model's own tokens: its two turns, each with its <|im_end|>
    own = tok.decode(out.completion_ids[0][out.completion_mask[0].bool()])
    assert own == turn + "<|im_end|>" + "The answer is 5.<|im_end|>"
    assert not out.truncated[0]


def two_call_rollout(qwen, tool_list, monkeypatch, n=2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(qwen), AutoModelForCausalLM.from_pretrained(qwen)
    turns = [CALL % ("add", '"a": 2, "b": 3'), [CALL % ("add", '"a": 5, "b": 4'), "Done: 5."] * n, "It is 9."]
    monkeypatch.setattr(sampling, "generate", scripted_generate(turns))
    convs = [[{"role": "user", "content": "2 + 3 + 4?"}], [{"role": "user", "content": "Add 2 and 3, please."}]]
    ids, mask = data.encode_prompts(tok, [data.render_prompt(tok, c, [t.schema for t in tool_list]) for c in convs])
    return model, tok, ids, mask, tools.generate_with_tools(model, tok, ids, mask, convs, tool_list, None, 2000, 1.0, n)


def test_max_tool_calling_iterations(qwen, tool_list, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(qwen), AutoModelForCausalLM.from_pretrained(qwen)
    call = CALL % ("add", '"a": 1, "b": 1')
    monkeypatch.setattr(sampling, "generate", scripted_generate([call] * 5))
    conv = [{"role": "user", "content": "1 + 1?"}]
    ids, mask = data.encode_prompts(tok, [data.render_prompt(tok, conv, [t.schema for t in tool_list])])
    out = tools.generate_with_tools(model, tok, ids, mask, [conv], tool_list, 2, 2000, 1.0, 1)
    assert out.calls == 2 and [m["role"] for m in out.messages[0]] == ["assistant", "tool"] * 2 + ["assistant"]


def test_logprobs_in_two_call_exchange_equal_a_plain_forward(qwen, tool_list, monkeypatch):
    """Rows 0 and 2 make two calls, rows 1 and 3 one: completion_logprobs over the multi-turn
    completion (shared-prompt cache) equals a log-softmax of one forward over prompt + completion."""
    model, _, ids, mask, out = two_call_rollout(qwen, tool_list, monkeypatch)
    assert out.calls == 6 and [m["content"] for m in out.messages[0] if m["role"] == "tool"] == ["5", "9"]
    lp = sampling.completion_logprobs(model, ids, mask, out.completion_ids, out.attention_mask)
    for i in range(4):
        p = ids[i // 2][mask[i // 2].bool()]
        c = out.completion_ids[i][out.attention_mask[i].bool()]
        full = torch.cat([p, c])[None]
        logits = model(input_ids=full).logits[0, len(p) - 1:-1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, c[:, None])[:, 0]
        own = out.completion_mask[i][out.attention_mask[i].bool()].bool()
        torch.testing.assert_close(lp[i][:len(c)][own], expected[own], atol=1e-5, rtol=1e-5)


def test_tool_tokens_receive_no_gradient(qwen, tool_list, monkeypatch):
    import grpo

    model, _, ids, mask, out = two_call_rollout(qwen, tool_list, monkeypatch)
    logprobs = sampling.completion_logprobs(model, ids, mask, out.completion_ids, out.attention_mask).detach()
    logprobs.requires_grad_(True)
    args = types.SimpleNamespace(**{**vars(grpo.Args()), "loss_type": "grpo"})
    ref = logprobs.detach() - 0.1
    loss, _ = grpo.grpo_loss(logprobs, logprobs.detach(), ref, torch.tensor([1.0, -1.0, 0.5, -0.5]),
                             out.completion_mask, args)
    loss.backward()
    tool_positions = (out.attention_mask == 1) & (out.completion_mask == 0)
    assert tool_positions.sum() > 100
    assert (logprobs.grad[tool_positions] == 0).all()
    assert (logprobs.grad[out.completion_mask.bool()] != 0).all()


def test_grpo_with_tools_end_to_end(qwen, tmp_path, monkeypatch):
    """grpo.main() on the Qwen2.5-shaped fixture: half the samples call `add` (one of them a
    failing call), the tools answer in the sandbox, the rewards receive the exchange as messages,
    the metrics count the calls, and the update trains (loss and KL finite)."""
    from conftest import run_main

    import grpo

    (tmp_path / "calc.py").write_text(TOOLS_FILE)
    (tmp_path / "r.py").write_text(
        "def used_tool(prompts, completions, **kw):\n"
        "    assert all(isinstance(c, list) and c[0]['role'] == 'assistant' for c in completions)\n"
        "    return [float(any(m['role'] == 'tool' and m['content'] == '5' for m in c)) for c in completions]\n")
    with open(tmp_path / "p.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"What is 2 + 3 ({i})?"}]}) + "\n")
    first = [CALL % ("add", '"a": 2, "b": 3'), "It is 5.", CALL % ("add", '"a": "x"'), "Five."]
    script = scripted_generate([first, "So: 5."] * 2)
    monkeypatch.setattr(sampling, "generate", script)
    out = str(tmp_path / "out")
    run_main(grpo, ["--model", qwen, "--dataset", str(tmp_path / "p.jsonl"), "--reward_fn", f"{tmp_path}/r.py:used_tool",
                    "--tools", f"{tmp_path}/calc.py:add", "--max_tool_calling_iterations", "1", "--num_generations", "4",
                    "--batch_size", "1", "--gradient_accumulation_steps", "1", "--max_steps", "2", "--max_completion_length", "600",
                    "--learning_rate", "1e-3", "--optim", "adamw", "--output_dir", out], monkeypatch)
    rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    assert rows[0]["tools/call_frequency"] == pytest.approx(0.5)
    assert rows[0]["tools/failure_frequency"] == pytest.approx(0.5)  # "x" is no int: add raises in the sandbox
    assert rows[0]["reward"] == pytest.approx(0.25)
    # the model's tokens only (each turn + its <|im_end|>, one byte a token): not the tool turns
    own = [len(first[0]) + 1 + len("So: 5.") + 1, len(first[1]) + 1, len(first[2]) + 1 + len("So: 5.") + 1, len(first[3]) + 1]
    assert rows[0]["completions/mean_length"] == pytest.approx(sum(own) / 4)
    assert rows[0]["completions/max_length"] == max(own) and rows[0]["kl"] == pytest.approx(0, abs=1e-6)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert len(script.calls) == 4  # a first turn and one continuation per step


def _rollout_with_real_continuations(qwen, tool_path, convs):
    """Turn 0 scripted (every row calls `add`, rows differ in length), later turns sampled by the
    real, seeded sampling.generate: what rank independence is about."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(qwen), AutoModelForCausalLM.from_pretrained(qwen)
    tool_list = tools.load_tools(f"{tool_path}:add")
    real = sampling.generate

    def generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature=1.0, num_return_sequences=1,
                 seed=None, **kw):
        if num_return_sequences == 1:  # a continuation: the real sampler
            return real(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature,
                        num_return_sequences=1, seed=seed, **kw)
        first = [CALL % ("add", f'"a": {c[0]["content"].count("x")}, "b": {j * 111}') for c in convs
                 for j in range(num_return_sequences)]
        return scripted_generate([first])(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens,
                                          num_return_sequences=num_return_sequences)

    sampling.generate = generate
    try:
        schemas = [t.schema for t in tool_list]
        ids, mask = data.encode_prompts(tok, [data.render_prompt(tok, c, schemas) for c in convs])
        return tools.generate_with_tools(model, tok, ids, mask, convs, tool_list, None, 200, 1.0, 2, seed=1234)
    finally:
        sampling.generate = real


RANK_CONVS = [[{"role": "user", "content": "x" * (k + 1)}] for k in range(4)]


def prepare_two_ranks(tmp):
    """For tests/test_distributed.py's in-process ranks: a Qwen2.5-shaped folder, the tools file and
    1 rank x 4 prompts' multi-turn rollout (tmp/tools/one.pt), which `tools_on_two_ranks` compares
    with each rank's 2 prompts."""
    import pathlib

    folder = pathlib.Path(tmp) / "tools"
    build_qwen(folder / "model")
    (folder / "calc.py").write_text(TOOLS_FILE)
    one = _rollout_with_real_continuations(str(folder / "model"), folder / "calc.py", RANK_CONVS)
    assert one.calls == 8
    assert (one.completion_mask.sum(1) > 70).all()  # the real sampler wrote after the tool turn (turn 0: 69 tokens)
    torch.save({"messages": one.messages, "ids": one.completion_ids, "mask": one.attention_mask,
                "own": one.completion_mask}, folder / "one.pt")


def tools_on_two_ranks(tmp):
    """On each of 2 ranks: its 2 prompts give every row the exchange 1 rank x 4 prompts gave it --
    the continuations after the tool replies draw the noise of the row's global index."""
    from rlhf import parallel

    folder = f"{tmp}/tools"
    one = torch.load(f"{folder}/one.pt")
    mine = parallel.shard(list(range(len(RANK_CONVS))))
    out = _rollout_with_real_continuations(f"{folder}/model", f"{folder}/calc.py", [RANK_CONVS[i] for i in mine])
    rows = [r for i in mine for r in (2 * i, 2 * i + 1)]
    width = out.completion_ids.shape[1]
    assert out.messages == [one["messages"][r] for r in rows]
    assert torch.equal(out.completion_ids, one["ids"][rows][:, :width]) and not one["mask"][rows][:, width:].any()
    assert torch.equal(out.completion_mask, one["own"][rows][:, :width])


def test_tools_need_conversational_prompts(tmp_path, tiny_qwen, monkeypatch):
    from conftest import run_main

    import grpo

    (tmp_path / "calc.py").write_text(TOOLS_FILE)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "What is 2 + 3?"}) + "\n")
    with pytest.raises(SystemExit, match="--tools needs conversational prompts"):
        run_main(grpo, ["--model", tiny_qwen, "--dataset", str(tmp_path / "p.jsonl"), "--reward_fn", "arith_strict",
                        "--tools", f"{tmp_path}/calc.py:add", "--output_dir", str(tmp_path / "out")], monkeypatch)


def test_a_template_that_renders_no_tools_stops_the_run(tmp_path, tiny_llama, monkeypatch, capsys):
    """SmolLM2's template drops tools=: grpo.py --tools and sft.py on a `tools` column stop with one
    sentence, before the model loads, instead of training as if no tool existed."""
    from conftest import main_error

    import grpo
    import sft

    (tmp_path / "calc.py").write_text(TOOLS_FILE)
    u = {"role": "user", "content": "What is 2 + 3?"}
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": [u]}) + "\n")
    message = main_error(grpo, ["--model", tiny_llama, "--dataset", str(tmp_path / "p.jsonl"), "--reward_fn", "arith_strict",
                                "--tools", f"{tmp_path}/calc.py:add", "--output_dir", str(tmp_path / "out")], monkeypatch, capsys)
    assert message.startswith("error: --tools: this chat template renders no tools") and "Qwen2.5-Instruct" in message
    schema = tools.load_tools(f"{tmp_path}/calc.py:add")[0].schema
    (tmp_path / "s.jsonl").write_text(json.dumps({"prompt": [u], "completion": [{"role": "assistant", "content": "5"}],
                                                  "tools": [schema]}) + "\n")
    message = main_error(sft, ["--model", tiny_llama, "--dataset", str(tmp_path / "s.jsonl"), "--output_dir",
                               str(tmp_path / "sft")], monkeypatch, capsys)
    assert message.startswith("error: the dataset's 'tools' column: this chat template renders no tools")


def test_a_template_that_renders_tools_passes_the_check():
    tok = qwen_tokenizer()
    data.check_renders_tools(tok, [{"role": "user", "content": "What is 2 + 3?"}], [{"name": "add"}], "--tools")


# ---------------------------------------------------------------- the arithmetic world's calculator (embedded:arith_tools)
ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))


def arith_tools_tokenizer(sft):
    """The world's tokenizer as sft.py builds it from scratch: the characters of every conversation
    as the world's chat template renders it (with its row's tools), and that template."""
    from worlds import scratch
    from worlds import world_arith as wa
    from transformers.utils.chat_template_utils import render_jinja_template

    texts = [render_jinja_template([r["prompt"] + r["completion"]], tools=r["tools"], chat_template=wa.CHAT_TEMPLATE)[0][0]
             for r in sft]
    tok = scratch.fit_tokenizer(texts, "char")
    tok.chat_template = wa.CHAT_TEMPLATE
    return tok, texts


def test_arith_tools_demonstrations_round_trip():
    """The demonstrator's calls are what tools.parse_tool_calls reads and the sandboxed calculator
    answers; the reply turn SFT masks is what tools.tool_turn_ids appends in a rollout; the
    tokenizer writes every character back; a prompt without tools is embedded:arith's."""
    from worlds import world_arith as wa

    sizes = {"sft": 400, "rl": 10, "test": 50}
    world, plain = wa.build_world(seed=0, sizes=sizes, tools=True), wa.build_world(seed=0, sizes=sizes)
    sft = world["sft"]
    tok, texts = arith_tools_tokenizer(sft)
    tool_list = tools.load_tools(f"{ROOT}/{wa.TOOL_FILE}:add")
    schemas = [t.schema for t in tool_list]
    assert all(tok.decode(tok(t, add_special_tokens=False)["input_ids"]) == t for t in texts)
    assert [data.render_prompt(tok, r["prompt"]) for r in world["test"]] == plain["test"]["prompt"]
    assert [r["completion"][0]["content"] for r in sft if len(r["completion"]) == 1] == \
        [r["completion"] for r, t in zip(plain["sft"], sft) if len(t["completion"]) == 1]  # the same scratchpads
    listed = [r for r in sft if r["tools"] is not None]
    calling = [r for r in listed if len(r["completion"]) == 3]
    assert all(r["tools"] == schemas for r in listed) and all(r["tools"] is not None for r in calling)
    assert 0.4 < len(listed) / len(sft) < 0.6 and 0.2 < len(calling) / len(listed) < 0.4
    after_stop = tools.glue_after_stop(tok, schemas, tok.eos_token)
    for r in calling:
        call, reply, final = r["completion"]
        a, b = map(int, r["prompt"][0]["content"].split("+"))
        assert tools.parse_tool_calls(call["content"]) == [{"name": "add", "arguments": {"a": a, "b": b}}]
        assert (reply["role"], reply["name"], reply["content"]) == ("tool", "add", str(a + b))
        assert wa.arith_strict(None, [r["completion"]], [r["answer"]]) == [1.0] and r["correct"]
        segments = data.render_turns(tok, r["prompt"], r["completion"], r["tools"])
        assert [trained for _, trained in segments] == [True, False, True]
        assert tools.tool_turn_ids(tok, r["prompt"] + [call], [reply], schemas, after_stop) == \
            tok(segments[1][0], add_special_tokens=False)["input_ids"]
    replies = tools.execute([tools.parse_tool_calls(r["completion"][0]["content"])[0] for r in calling[:6]], tool_list)
    assert replies == [("add", str(r["answer"]), False) for r in calling[:6]]


def test_grpo_on_arith_tools_end_to_end(tmp_path, monkeypatch):
    """grpo.py --dataset embedded:arith_tools --tools worlds/calculator.py:add --reward_fn arith_strict on a
    tiny model with the world's tokenizer: a scripted policy calls the tool on every other sample
    (with the problem's numbers, then copies the reply) and writes a wrong scratchpad on the others;
    the sandboxed calculator answers, and the strict verifier reads the last assistant turn."""
    import re

    from conftest import run_main

    import grpo
    from worlds import scratch
    from worlds import world_arith as wa

    tok, texts = arith_tools_tokenizer(wa.build_world(seed=0, sizes={"sft": 200, "rl": 1, "test": 1}, tools=True)["sft"])
    scratch.build_model(tok, hidden_size=32, num_layers=1).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    wrong = " 1+1=2 A: 0"

    def generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature=1.0, num_return_sequences=1,
                 seed=None, **kw):
        contexts = [tokenizer.decode(ids[m.bool()]) for ids, m in zip(prompt_ids, prompt_mask)]
        if num_return_sequences > 1:  # the first turn: a call with the problem's numbers, or a wrong scratchpad
            turns = [wa.tool_call_text(tuple(map(int, re.search(r"Q: (\d+)\+(\d+)=", c).groups()))) if j % 2 == 0 else wrong
                     for c in contexts for j in range(num_return_sequences)]
        else:  # after the tool turn: copy the reply (rows without a pending call are dropped by the loop)
            turns = [" A: " + m.group(1) if (m := re.search(r" R: (\d+)$", c)) else wrong for c in contexts]
        return scripted_generate([turns])(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens,
                                          num_return_sequences=num_return_sequences)

    monkeypatch.setattr(sampling, "generate", generate)
    out = str(tmp_path / "out")
    run_main(grpo, ["--model", str(tmp_path / "model"), "--dataset", wa.TOOLS_SPEC, "--reward_fn", "arith_strict",
                    "--tools", f"{ROOT}/{wa.TOOL_FILE}:add", "--max_tool_calling_iterations", "1", "--num_generations", "2",
                    "--batch_size", "2", "--max_steps", "1", "--max_completion_length", "96", "--output_dir", out], monkeypatch)
    row = json.loads(open(f"{out}/metrics.jsonl").readline())
    assert row["tools/call_frequency"] == pytest.approx(0.5) and row["tools/failure_frequency"] == 0
    assert row["reward"] == pytest.approx(0.5)  # every call's answer is right, every scratchpad wrong
    # the model's tokens only: a call and its answer (two or three digits), each with its <eos>; the scratchpad
    call = len('<tool_call>{"name":"add","arguments":{"a":10,"b":10}}</tool_call>') + 1
    assert row["completions/max_length"] in (call + len(" A: 20") + 1, call + len(" A: 100") + 1)
    assert row["completions/min_length"] == len(wrong) + 1


def test_sft_from_scratch_on_arith_tools(tmp_path, monkeypatch):
    """sft.py --dataset embedded:arith_tools saves a tokenizer that AutoTokenizer reloads with the
    world's chat template: a tool exchange renders and encodes as in training (one <eos> token per
    turn, every character kept), with and without the tool listed."""
    from conftest import run_main
    from transformers import AutoTokenizer

    import sft
    from worlds import world_arith as wa

    out = str(tmp_path / "sft")
    run_main(sft, ["--dataset", wa.TOOLS_SPEC, "--hidden_size", "32", "--num_layers", "1", "--max_steps", "1",
                   "--batch_size", "4", "--output_dir", out], monkeypatch)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == wa.CHAT_TEMPLATE
    schemas = [t.schema for t in tools.load_tools(f"{ROOT}/{wa.TOOL_FILE}:add")]
    conv = [{"role": "user", "content": "47+38"}, {"role": "assistant", "content": wa.tool_call_text((47, 38))},
            {"role": "tool", "name": "add", "content": "85"}, {"role": "assistant", "content": " A: 85"}]
    text = tok.apply_chat_template(conv, tools=schemas, tokenize=False)
    assert text == 'T:add\nQ: 47+38=<tool_call>{"name":"add","arguments":{"a":47,"b":38}}</tool_call><eos> R: 85 A: 85<eos>'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.eos_token_id) == 2 and len(ids) == len(text) - 2 * (len("<eos>") - 1)
    assert tok.decode(ids) == text
    assert data.render_prompt(tok, conv[:1]) == "Q: 47+38="
