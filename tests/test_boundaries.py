"""Boundaries small runs never reach: checkpoint steps across a digit boundary (checkpoint-9 and
checkpoint-12, checkpoint-900 and checkpoint-1000 sort the other way round as text), pruning with
--save_total_limit and --resume after it; and the tool-call forms models write besides Qwen2.5's
(no arguments, "parameters", arguments as a JSON string, several calls in one turn and in one
<tool_call>), each read, run in the sandbox and answered in its own row."""

import json
import os

import torch
from conftest import run_main
from test_tools import build_qwen, scripted_generate

import sft
from rlhf import checkpoints
from rlhf import data
from rlhf import sampling
from rlhf import tools


# ---------------------------------------------------------------- checkpoints
def fake_checkpoints(folder, steps):
    for step in steps:
        os.makedirs(folder / f"checkpoint-{step}")
        (folder / f"checkpoint-{step}" / "trainer_state.pt").write_bytes(b"")


def test_checkpoints_are_ordered_by_step_not_by_name(tmp_path):
    """checkpoint-1000 is newer than checkpoint-900: --resume takes it, pruning keeps it, an error
    offers the older one, and resuming from 900 sets 1000 aside (not the other way round)."""
    fake_checkpoints(tmp_path, [90, 100, 900, 1000])
    assert checkpoints.checkpoints(str(tmp_path)) == [f"{tmp_path}/checkpoint-{s}" for s in (90, 100, 900, 1000)]
    assert checkpoints.last_checkpoint(str(tmp_path)) == f"{tmp_path}/checkpoint-1000"
    assert "--resume_from_checkpoint " + f"{tmp_path}/checkpoint-900 " in checkpoints._earlier_checkpoints(
        f"{tmp_path}/checkpoint-1000")
    checkpoints.delete_old_checkpoints(str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1000", "checkpoint-900"]
    checkpoints.abandon_newer_checkpoints(str(tmp_path), 900)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1000.abandoned", "checkpoint-900"]
    assert checkpoints.last_checkpoint(str(tmp_path)) == f"{tmp_path}/checkpoint-900"


def test_an_unreadable_checkpoint_offers_only_older_ones_in_order(tmp_path):
    """The sentence an unreadable checkpoint's error ends with: the newest checkpoint older than it to
    resume from, then the rest oldest first; never itself or a newer one (checkpoint-1100 beside
    checkpoint-1000), and the one sentence for none left."""
    t = tmp_path
    fake_checkpoints(t, [100, 900, 1000, 1100])
    assert checkpoints._earlier_checkpoints(f"{t}/checkpoint-1000") == (
        f" Resume from the previous one with --resume_from_checkpoint {t}/checkpoint-900 (earlier: {t}/checkpoint-100).")
    assert checkpoints._earlier_checkpoints(f"{t}/checkpoint-1100/") == (
        f" Resume from the previous one with --resume_from_checkpoint {t}/checkpoint-1000 "
        f"(earlier: {t}/checkpoint-100, {t}/checkpoint-900).")
    assert checkpoints._earlier_checkpoints(f"{t}/checkpoint-900") == (
        f" Resume from the previous one with --resume_from_checkpoint {t}/checkpoint-100.")
    assert checkpoints._earlier_checkpoints(f"{t}/checkpoint-100") == (
        " No earlier checkpoint is left; start again without --resume (with --overwrite_output_dir).")
    assert checkpoints.checkpoints(str(t / "missing")) == [] and checkpoints.last_checkpoint(str(t / "missing")) is None


def test_abandoning_a_checkpoint_twice_keeps_the_newest_abandoned_one(tmp_path, monkeypatch, capsys):
    """Resuming from checkpoint-900 twice, each time with a checkpoint-1000 ahead of it: the first
    checkpoint-1000.abandoned gives way to the second (the abandoned run of the moment), each rename
    is said, and a rename the filesystem refuses stops with the path and what was kept."""
    import pytest

    t = tmp_path
    fake_checkpoints(t, [900, 1000])
    checkpoints.abandon_newer_checkpoints(str(t), 900)
    assert capsys.readouterr().out == (f"resume: {t}/checkpoint-1000 belongs to the abandoned run: renamed "
                                       "checkpoint-1000.abandoned (kept; --resume ignores it).\n")
    fake_checkpoints(t, [1000])
    (t / "checkpoint-1000" / "second").write_text("the second run")
    checkpoints.abandon_newer_checkpoints(str(t), 900)
    assert sorted(os.listdir(t)) == ["checkpoint-1000.abandoned", "checkpoint-900"]
    assert (t / "checkpoint-1000.abandoned" / "second").read_text() == "the second run"
    fake_checkpoints(t, [1000])

    def refuse(src, dst):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(checkpoints.os, "replace", refuse)
    with pytest.raises(SystemExit) as stop:
        checkpoints.abandon_newer_checkpoints(str(t), 900)
    assert str(stop.value) == f"error: cannot write {t}/checkpoint-1000 (Read-only file system); nothing else was changed."


def test_resume_after_pruning_across_a_digit_boundary(tmp_path, tiny_qwen, sft_data, monkeypatch, capsys):
    """sft.py saves every 3 steps to step 12 with --save_total_limit 2: checkpoint-9 and
    checkpoint-12 stay (as text, "checkpoint-9" sorts last). --resume then continues from step
    12, keeps both, and its own checkpoint at 15 prunes checkpoint-9."""
    out = tmp_path / "out"
    argv = ["--model", tiny_qwen, "--dataset", sft_data, "--batch_size", "2", "--save_steps", "3",
            "--save_total_limit", "2", "--optim", "adamw", "--output_dir", str(out)]
    run_main(sft, argv + ["--max_steps", "12"], monkeypatch)
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-12", "checkpoint-9"]
    capsys.readouterr()
    run_main(sft, argv + ["--max_steps", "15", "--resume"], monkeypatch)
    assert f"continuing from {out}/checkpoint-12 at step 12" in capsys.readouterr().out
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-12", "checkpoint-15"]


# ---------------------------------------------------------------- tool calls
def test_the_forms_of_a_tool_call_models_write():
    """Qwen2.5's form, and: no arguments (left out, null or ""), Llama 3.1's "parameters", the
    arguments as a JSON string (OpenAI's form), a JSON list of calls in one tag (Mistral's form),
    several tags in one turn with the newlines Qwen2.5 writes around them."""
    def one(body):
        return tools.parse_tool_calls(f"<tool_call>{body}</tool_call>")

    add = {"name": "add", "arguments": {"a": 1, "b": 2}}
    none = [{"name": "pi", "arguments": {}}]
    assert one('{"name": "add", "arguments": {"a": 1, "b": 2}}') == [add]
    assert one('{"name": "pi"}') == one('{"name": "pi", "arguments": null}') == one('{"name": "pi", "arguments": ""}') == none
    assert one('{"name": "add", "parameters": {"a": 1, "b": 2}}') == [add]
    assert one('{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}') == [add]
    assert one('[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "pi"}]') == [add, *none]
    turn = ('Two sums.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    assert tools.parse_tool_calls(turn) == [add, {"name": "add", "arguments": {"a": 3, "b": 4}}]
    # still malformed: arguments that are not an object, nor a JSON string of one; an empty list
    for body in ('{"name": "add", "arguments": [1, 2]}', '{"name": "add", "arguments": "{a: 1}"}',
                 '{"name": "add", "arguments": "[1]"}', '[]', '{"arguments": {}}'):
        (error,) = one(body)
        assert isinstance(error, str) and "must be" in error, body


TOOLS = '''def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def pi() -> float:
    """The number pi, to two places."""
    return 3.14
'''


def test_several_calls_in_one_turn_each_reach_their_own_row(tmp_path, monkeypatch):
    """Two prompts x 2 samples, each row making two calls in its first turn (one of them without
    arguments, one with "parameters" in the second prompt's rows) and none in its second: every
    row gets its own two replies, in order, then its own next turn; the calls are counted."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (tmp_path / "t.py").write_text(TOOLS)
    tool_list = tools.load_tools(f"{tmp_path}/t.py:add,{tmp_path}/t.py:pi")
    path = build_qwen(tmp_path / "qwen")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    first = [f'<tool_call>{{"name": "add", "arguments": {{"a": {i}, "b": {10 * i}}}}}</tool_call>'
             + ('<tool_call>{"name": "pi"}</tool_call>' if i < 2 else
                f'<tool_call>{{"name": "add", "parameters": {{"a": {i}, "b": 1}}}}</tool_call>')
             for i in range(4)]
    monkeypatch.setattr(sampling, "generate", scripted_generate([first, [f"row {i} done." for i in range(4)]]))
    convs = [[{"role": "user", "content": "Add and pi?"}], [{"role": "user", "content": "Add twice?"}]]
    schemas = [t.schema for t in tool_list]
    ids, mask = data.encode_prompts(tok, [data.render_prompt(tok, c, schemas) for c in convs])
    out = tools.generate_with_tools(model, tok, ids, mask, convs, tool_list, None, 4000, 1.0, 2)
    assert (out.calls, out.failures) == (8, 0)
    for i in range(4):
        replies = [str(11 * i), "3.14"] if i < 2 else [str(11 * i), str(i + 1)]
        assert out.messages[i] == [{"role": "assistant", "content": first[i]},
                                   *({"role": "tool", "name": n, "content": r} for n, r in zip(
                                       ["add", "pi" if i < 2 else "add"], replies)),
                                   {"role": "assistant", "content": f"row {i} done."}]
        # the tokens the model reads are the template's rendering of that row's own exchange
        full = tok.apply_chat_template(convs[i // 2] + out.messages[i], tools=schemas, tokenize=False)
        prompt = data.render_prompt(tok, convs[i // 2], schemas)
        assert tok.decode(out.completion_ids[i][out.attention_mask[i].bool()]) == full[len(prompt):].removesuffix("\n")
    assert not out.truncated.any() and torch.equal(out.completion_mask * out.attention_mask, out.completion_mask)


EDGES = '''import torch  # importable here, not in the sandbox (standard library only): every call fails there


def echo(text: str) -> str:
    """Say it back.

    Args:
        text: What to say.
    """
    return text
'''


def test_what_parsing_and_the_sandbox_answer_at_their_edges(tmp_path):
    """Calls nested past the JSON parser's depth, or with more digits than Python converts, are
    malformed calls with their reason cut at 100 characters, and the calls after them are still
    read; every malformed call is answered in its row as "unknown", an unknown tool names the
    tools; a reply that holds the sandbox's own marker comes back whole; a tool file that imports
    what the sandbox lacks answers with the exception, without the sandbox's "code: " prefix."""
    deep, digits = "[" * 100_000 + "]" * 100_000, '{"name": "echo", "arguments": {"text": ' + "9" * 5000 + "}}"
    reasons = []
    for body in (deep, digits):
        try:
            json.loads(body)
        except (ValueError, RecursionError) as e:
            reasons.append(f"the tool call cannot be read ({type(e).__name__}: {str(e)[:100]})")
    assert len(reasons[1]) > 130  # the ValueError's text is longer than the cut
    calls = tools.parse_tool_calls(f"<tool_call>{deep}</tool_call><tool_call>{digits}</tool_call>"
                                   '<tool_call>{"name": "echo"}</tool_call><tool_call>1</tool_call><tool_call>{"name": "x"')
    malformed = 'a tool call must be {"name": <string>, "arguments": <object>}'
    assert calls == [*reasons, {"name": "echo", "arguments": {}}, malformed, "a <tool_call> is not closed by </tool_call>"]
    (tmp_path / "t.py").write_text(TOOLS + "\n\n" + EDGES.split("\n\n\n", 1)[1])  # add, pi and echo
    tool_list = tools.load_tools(f"{tmp_path}/t.py:echo,{tmp_path}/t.py:add")  # not pi
    text = "a" + tools.MARK + "b"
    assert tools.execute([{"name": "echo", "arguments": {"text": text}}, malformed, {"name": "nope", "arguments": {}}],
                         tool_list) == [("echo", text, False), ("unknown", f"error: {malformed}", True),
                                        ("nope", "error: unknown tool 'nope'; the tools are echo, add", True)]
    (tmp_path / "edges.py").write_text(EDGES)
    (failing,) = tools.load_tools(f"{tmp_path}/edges.py:echo")
    assert tools.execute([{"name": "echo", "arguments": {"text": "hi"}}], [failing]) == [
        ("echo", "error: ModuleNotFoundError: No module named 'torch'", True)]
