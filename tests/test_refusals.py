"""Every refusal of rlhf/data.py and of the judges (rlhf/evaluation/judges.py), pinned word for word.
A bad input must stop the run with one sentence a person can act on, naming the file, the row, the
column or the flag at fault; a test that looks for a fragment of that sentence still passes when the
sentence names the wrong row, loses a word or changes case, so each case here compares the whole
message with ==. Each refusal is reached with the smallest input that trips it (datasets built in
memory, files under tmp_path, the judge's server on 127.0.0.1), and the checks beside the refusals
(an empty assistant turn allowed where it trains nothing, exactly half the tokens unreadable, the
step count of --num_train_epochs) are pinned at their edges. Parts that are not ours (a file's
temporary path, a tokenizer's class name, the text of an error raised by datasets or pyarrow) are
computed in the expectation; every other word is written out as the user reads it.
"""

import errno
import http.server
import json
import os
import sys
import threading
import time
import types

import pytest
from conftest import bos_tokenizer
from conftest import chat_tokenizer
from datasets import Dataset

from rlhf import data
from rlhf.evaluation import judges
from worlds import world


def _refusal(fn, *args, **kwargs):
    """The message a refusal (basics.fail: sys.exit) stops the run with."""
    with pytest.raises(SystemExit) as e:
        fn(*args, **kwargs)
    return str(e.value.code)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _parquet(path, columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return str(path)


def _word_tokenizer():
    """A word-level tokenizer of three words: any other word is its unknown token, and 'A' and 'B'
    are no token of it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "yes": 1, "no": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _chat(*turns):
    """A conversation from (role, content) pairs."""
    return [{"role": role, "content": content} for role, content in turns]


def chat_tokenizer_with(template):
    tok = chat_tokenizer()
    tok.chat_template = template
    return tok


NO_PREFIX_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}|{% endfor %}"
                      "{% if add_generation_prompt %}GO{% endif %}")  # the generation prompt is not where the answer goes
QA = _chat(("user", "hi"), ("assistant", "bob"))


# ------------------------------------------------------------------ in-memory data: one case per refusal
CASES = [
    ("a missing column", lambda: data.require_columns(Dataset.from_list([{"text": "a", "label": 1}]), ["prompt"],
                                                      "data.jsonl"),
     "error: data.jsonl has no column 'prompt' (columns: text, label)."),
    ("a missing column, with the hint", lambda: data.require_columns(
        Dataset.from_list([{"prompt": "a"}]), ["prompt", "completion"], "data.jsonl", "Expected prompt+completion."),
     "error: data.jsonl has no column 'completion' (columns: prompt). Expected prompt+completion."),
    ("the embedded world by name", lambda: data.require_columns(Dataset.from_list([{"text": "a"}]), ["prompt"],
                                                                "embedded", "Say so."),
     "error: the embedded world has no column 'prompt' (columns: text). Say so."),
    ("no rows", lambda: data.require_columns(Dataset.from_dict({"prompt": []}), ["prompt"], "data.jsonl"),
     "error: data.jsonl is empty."),
    ("content that is a list of parts, shown cut", lambda: data.check_text(Dataset.from_list([{"prompt": _chat(
        ("user", ["the first part", "the second part", "the third part", "the fourth part"]))}]), ["prompt"], "data.jsonl"),
     "error: data.jsonl, row 0, column 'prompt', message 0 (user): the content is list ['the first part', "
     "'the second part', 'the third part', 'the, not text; write each message's content as one string (join a list "
     "of parts into its text)."),
    ("content that is None", lambda: data.check_text(
        Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}]),
        ["messages"], "data.jsonl"),
     "error: data.jsonl, row 0, column 'messages', message 1 (assistant): the content is NoneType None, not text; "
     "write each message's content as one string (join a list of parts into its text)."),
    ("an empty assistant turn before the last, trained", lambda: data.check_text(
        Dataset.from_list([{"messages": QA}, {"messages": QA}, {"messages": _chat(
            ("user", "hi"), ("assistant", " "), ("user", "again"), ("assistant", "bob"))}]), ["messages"], "data.jsonl"),
     "error: data.jsonl, row 2, column 'messages', message 1: an assistant message before the last one is empty; it "
     "would train on the end-of-turn token alone. Remove the turn or fill it."),
    ("an empty last message", lambda: data.check_text(
        Dataset.from_list([{"prompt": _chat(("user", "hi"))}, {"prompt": _chat(("system", "be brief"), ("user", "\n"))}]),
        ["prompt"], "data.jsonl"),
     "error: data.jsonl, row 1, column 'prompt': the last user message is empty; an empty response would train on "
     "the end-of-turn token alone. Remove the row or fill it."),
    ("an empty string", lambda: data.check_text(Dataset.from_list([{"completion": "a"}, {"completion": "  "}]),
                                                ["completion"], "data.jsonl"),
     "error: data.jsonl, row 1, column 'completion': expected non-empty text or a list of {role, content} messages, "
     "got '  '."),
    ("an empty conversation", lambda: data.check_text(Dataset.from_dict({"prompt": [[]]}), ["prompt"], "data.jsonl"),
     "error: data.jsonl, row 0, column 'prompt': expected non-empty text or a list of {role, content} messages, "
     "got '[]'."),
    ("a value that is no text, shown cut", lambda: data.check_text(Dataset.from_dict({"prompt": [list(range(40))]}),
                                                                   ["prompt"], "data.jsonl"),
     "error: data.jsonl, row 0, column 'prompt': expected non-empty text or a list of {role, content} messages, "
     "got '[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 2'."),
    ("messages that do not end with the assistant", lambda: data.sft_pairs(
        Dataset.from_list([{"messages": QA}, {"messages": _chat(("user", "hi"), ("assistant", "bob"), ("user", "more"))}]),
        "data.jsonl"),
     "error: data.jsonl, row 1, column 'messages': must end with an assistant turn, and have at least one other turn "
     "before its first assistant turn."),
    ("messages that open with the assistant", lambda: data.sft_pairs(
        Dataset.from_list([{"messages": _chat(("assistant", "hello"), ("user", "hi"), ("assistant", "bob"))}]),
        "data.jsonl"),
     "error: data.jsonl, row 0, column 'messages': must end with an assistant turn, and have at least one other turn "
     "before its first assistant turn."),
    ("SFT messages whose last assistant message is empty", lambda: data.sft_pairs(
        Dataset.from_list([{"messages": QA}, {"messages": _chat(("user", "hi"), ("assistant", ""))}]), "data.jsonl"),
     "error: data.jsonl, row 1, column 'messages': the last assistant message is empty; an empty response would "
     "train on the end-of-turn token alone. Remove the row or fill it."),
    ("the language-modelling format", lambda: data.sft_pairs(Dataset.from_list([{"text": "alice bought a bike ."}]),
                                                             "data.jsonl"),
     "error: data.jsonl is in the language-modelling format (a 'text' column); this project trains on "
     "prompt+completion or messages, so split each row into 'prompt' and 'completion'."),
    ("SFT data in no format", lambda: data.sft_pairs(Dataset.from_list([{"question": "q", "answer": "a"}]), "data.jsonl"),
     "error: data.jsonl has no column 'prompt' (columns: question, answer). Expected prompt+completion or messages."),
    ("preference data without rejected", lambda: data.preference_triples(
        Dataset.from_list([{"prompt": "q", "chosen": "a"}]), "prefs.jsonl"),
     "error: prefs.jsonl has no column 'rejected' (columns: prompt, chosen). Preference data needs prompt + chosen "
     "+ rejected."),
    ("pairs that differ before the last turn", lambda: data.preference_triples(Dataset.from_list([
        {"chosen": QA, "rejected": _chat(("user", "hi"), ("assistant", "carol"))},
        {"chosen": QA, "rejected": _chat(("user", "hello"), ("assistant", "carol"))}]), "prefs.jsonl"),
     "error: prefs.jsonl, row 1: without a 'prompt' column, 'chosen' and 'rejected' must be conversations that "
     "differ only in the last turn."),
    ("pairs of plain strings without a prompt", lambda: data.preference_triples(
        Dataset.from_list([{"chosen": "a", "rejected": "b"}]), "embedded"),
     "error: the embedded world, row 0: without a 'prompt' column, 'chosen' and 'rejected' must be conversations "
     "that differ only in the last turn."),
    ("pairs of one turn", lambda: data.preference_triples(Dataset.from_list([
        {"chosen": _chat(("assistant", "a")), "rejected": _chat(("assistant", "b"))}]), "prefs.jsonl"),
     "error: prefs.jsonl, row 0: without a 'prompt' column, 'chosen' and 'rejected' must be conversations that "
     "differ only in the last turn."),
    ("an empty rejected turn", lambda: data.preference_triples(Dataset.from_list([
        {"chosen": QA, "rejected": _chat(("user", "hi"), ("assistant", "carol"))},
        {"chosen": QA, "rejected": _chat(("user", "hi"), ("assistant", " "))}]), "prefs.jsonl"),
     "error: prefs.jsonl, row 1, column 'rejected': the last assistant message is empty; an empty response would be "
     "the end-of-turn token alone. Remove the row or fill it."),
    ("pairs whose contents are lists of parts", lambda: data.preference_triples(Dataset.from_list([
        {"chosen": _chat(("user", ["hi"]), ("assistant", ["bob"])),
         "rejected": _chat(("user", ["hi"]), ("assistant", ["ca", "rol"]))}]), "prefs.jsonl"),
     "error: prefs.jsonl, row 0, column 'chosen', message 0 (user): the content is list ['hi'], not text; "
     "write each message's content as one string (join a list of parts into its text)."),
    ("an empty chosen turn", lambda: data.preference_triples(Dataset.from_list([
        {"chosen": _chat(("user", "hi"), ("assistant", "")), "rejected": QA}]), "prefs.jsonl"),
     "error: prefs.jsonl, row 0, column 'chosen': the last assistant message is empty; an empty response would be "
     "the end-of-turn token alone. Remove the row or fill it."),
    ("an empty chosen string", lambda: data.preference_triples(
        Dataset.from_list([{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "", "rejected": "b"}]),
        "prefs.jsonl"),
     "error: prefs.jsonl, row 1, column 'chosen': expected non-empty text or a list of {role, content} messages, "
     "got ''."),
    ("a conversation without a chat template", lambda: data.render_prompt(world.build_tokenizer(), _chat(("user", "hi"))),
     "error: conversational data needs a tokenizer with a chat template; this one has none."),
    ("a chat template that drops tools", lambda: data.check_renders_tools(
        chat_tokenizer(), "What is 2 + 3?", [{"name": "add"}], "the dataset's 'tools' column"),
     "error: the dataset's 'tools' column: this chat template renders no tools (a prompt with tools= renders as one "
     "without), so the model would never see their schemas; use a model whose chat template lists tools (e.g. "
     "Qwen2.5-Instruct), or save this model with a chat template that renders `tools` (its folder's "
     "chat_template.jinja)."),
    ("a prompt that is no prefix of prompt + completion", lambda: data.render_completion(
        chat_tokenizer_with(NO_PREFIX_TEMPLATE), "hi", _chat(("assistant", "bob"))),
     "error: the chat template does not render the prompt as a prefix of prompt + completion; pass "
     "prompt/completion as plain strings instead."),
    ("a turn that is no prefix of the next", lambda: data.render_turns(
        chat_tokenizer_with(NO_PREFIX_TEMPLATE), "hi", _chat(("assistant", "bob"))),
     "error: the chat template does not render each turn as a prefix of the next; pass prompt/completion as plain "
     "strings instead."),
    ("a prompt that leaves no trained token", lambda: data.encode_examples(
        world.build_tokenizer(), [" bob", " bob bob bob"], [[(" carol", True)], [(" carol", True)]], 3, spec="sft.jsonl"),
     "error: sft.jsonl, row 1: no token of its completion is left within --max_length 3 (the prompt alone has 3 "
     "tokens), so the row would train nothing; raise --max_length, or shorten or remove the row."),
    ("a judge that cannot spell A or B", lambda: judges.prob_first_better(None, _word_tokenizer(), ["q"], ["a"], ["b"]),
     "error: the --judge llm model's tokenizer has no single token for 'A' or 'B'; use a judge model whose "
     "vocabulary spells them (any instruction-tuned LM does)."),
]


@pytest.mark.parametrize("case,refuse,expected", CASES, ids=[c[0] for c in CASES])
def test_each_refusal_is_one_exact_sentence(case, refuse, expected):
    assert _refusal(refuse) == expected


# ------------------------------------------------------------------ files and folders (load_data)
def test_an_unsupported_file_type(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt,completion\nq,a\n")
    assert _refusal(data.load_data, str(path)) == f"error: {path}: unsupported file type '.csv'; use .jsonl, .json or .parquet."
    upper = tmp_path / "data.TXT"
    upper.write_text("q\n")
    assert _refusal(data.load_data, str(upper)) == f"error: {upper}: unsupported file type '.txt'; use .jsonl, .json or .parquet."


def test_a_missing_file_or_path(tmp_path):
    assert _refusal(data.load_data, str(tmp_path / "gone.jsonl")) == f"error: dataset file {tmp_path}/gone.jsonl does not exist."
    assert _refusal(data.load_data, "./gone") == "error: dataset ./gone does not exist."
    assert _refusal(data.load_data, str(tmp_path / "gone")) == f"error: dataset {tmp_path}/gone does not exist."


def test_an_unreadable_or_empty_parquet_file(tmp_path):
    import pyarrow.parquet as pq

    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet at all")
    with pytest.raises(Exception) as cause:
        pq.ParquetFile(bad)
    assert (_refusal(data.load_data, str(bad))
            == f"error: {bad} is not a readable parquet file ({type(cause.value).__name__}: {cause.value}).")
    empty = _parquet(tmp_path / "empty.parquet", {"prompt": []})
    assert _refusal(data.load_data, empty) == f"error: {empty} has no rows."


@pytest.mark.parametrize("lines,expected", [
    ([b'{"prompt": "q"}\n', b"\n", b'{"prompt": "caf\xe9"}\n'],
     "line 3: not UTF-8 (byte 0xe9 at column 16); re-encode the file as UTF-8."),
    ([b'{"prompt": "q"}\n', b'{"prompt": }\n'], "line 2: not valid JSON (Expecting value at column 12)."),
    ([b'{"prompt": "q", }\n'], "line 1: not valid JSON (Expecting property name enclosed in double quotes at column 17)."),
    ([b"\n", b'["prompt", "q"]\n'], "line 2: each line must be a JSON object, got list."),
    ([b'{"prompt": "q"}\n', b'"q"\n'], "line 2: each line must be a JSON object, got str."),
    ([b'{"prompt": "q"}\n', b"null\n"], "line 2: each line must be a JSON object, got NoneType."),
], ids=["not UTF-8", "not JSON", "a trailing comma", "a list", "a string", "null"])
def test_a_bad_jsonl_line_names_its_file_and_line(tmp_path, lines, expected):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"".join(lines))
    assert _refusal(data.load_data, str(path)) == f"error: {path}, {expected}"


def test_a_jsonl_line_cut_short_names_its_column(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "q"}\n{"prompt": "r"\n')
    assert (_refusal(data.load_data, str(path))
            == f"error: {path}, line 2: not valid JSON (Expecting ',' delimiter at column 15).")


@pytest.mark.parametrize("text", ["", "\n  \n\t\n"], ids=["nothing", "blank lines"])
def test_an_empty_jsonl_file(tmp_path, text):
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    assert _refusal(data.load_data, str(path)) == f"error: {path} is empty (no JSON rows, only blank lines or nothing)."


def test_a_byte_order_mark_and_blank_lines_are_read_past(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "q"}\n\n{"prompt": "r"}\n')
    data.check_jsonl(str(path))


def test_a_folder_with_no_data_files(tmp_path):
    (tmp_path / "notes.md").write_text("no data here")
    (tmp_path / ".hidden.jsonl").write_text('{"prompt": "q"}\n')
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "old.jsonl").write_text('{"prompt": "q"}\n')
    assert (_refusal(data.load_data, str(tmp_path))
            == f"error: dataset folder {tmp_path} holds no data files (.jsonl, .json, .parquet).")


def test_a_folder_mixing_file_types(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"prompt": "q"}])
    (tmp_path / "b.json").write_text('[{"prompt": "r"}]')  # JSON and JSONL are one type to datasets
    _parquet(tmp_path / "c.parquet", {"prompt": ["s"]})
    assert (_refusal(data.load_data, str(tmp_path))
            == f"error: dataset folder {tmp_path} mixes file types ({tmp_path}/a.jsonl and {tmp_path}/c.parquet); "
               "datasets would read one type and drop the other: keep one type per folder, or pass a file.")


def test_a_folder_mixing_columns(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"prompt": "q", "completion": "a"}])
    _jsonl(tmp_path / "b.jsonl", [{"prompt": "q", "completion": "b"}])
    _jsonl(tmp_path / "c.jsonl", [{"prompt": "q", "rejected": "b", "chosen": "a"}])
    assert (_refusal(data.load_data, str(tmp_path))
            == f"error: dataset folder {tmp_path} mixes formats: {tmp_path}/a.jsonl has the columns completion, prompt "
               f"and {tmp_path}/c.jsonl has chosen, prompt, rejected; keep one format per folder (e.g. SFT and "
               "preference files apart).")


def test_a_folder_mixing_parquet_columns(tmp_path):
    _parquet(tmp_path / "a.parquet", {"prompt": ["q"]})
    _parquet(tmp_path / "b.parquet", {"text": ["q"]})
    assert (_refusal(data.load_data, str(tmp_path))
            == f"error: dataset folder {tmp_path} mixes formats: {tmp_path}/a.parquet has the columns prompt and "
               f"{tmp_path}/b.parquet has text; keep one format per folder (e.g. SFT and preference files apart).")


def test_a_folder_whose_jsonl_file_is_bad_names_that_file(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"prompt": "q"}])
    (tmp_path / "b.jsonl").write_text('{"prompt": "q"}\n{"prompt": "r" "s"}\n')
    assert (_refusal(data.load_data, str(tmp_path))
            == f"error: {tmp_path}/b.jsonl, line 2: not valid JSON (Expecting ',' delimiter at column 16).")


def test_a_folder_with_an_unknown_split(tmp_path):
    from datasets import load_dataset

    _jsonl(tmp_path / "a.jsonl", [{"prompt": "q"}])
    message = _refusal(data.load_data, str(tmp_path), "validation")
    with pytest.raises(ValueError) as cause:
        load_dataset(str(tmp_path), split="validation")
    assert message == f"error: dataset {tmp_path}: {cause.value}"


def test_a_folder_that_is_not_one_table(tmp_path):
    from datasets import load_dataset

    (tmp_path / "a.txt").write_text("")
    message = _refusal(data.load_data, str(tmp_path))
    with pytest.raises(Exception) as cause:
        load_dataset(str(tmp_path), split="train")
    assert message == (f"error: dataset {tmp_path} cannot be read as one table ({type(cause.value).__name__}: "
                       f"{cause.value}); keep one format and one set of columns per folder.")


def test_a_split_with_no_rows(tmp_path, monkeypatch):
    import datasets

    _jsonl(tmp_path / "a.jsonl", [{"prompt": "q"}])  # datasets refuses an empty local split itself; a Hub one can be empty
    monkeypatch.setattr(datasets, "load_dataset", lambda spec, split: Dataset.from_dict({"prompt": []}))
    assert _refusal(data.load_data, str(tmp_path), "test") == f"error: dataset {tmp_path} (split test) has no rows."


def test_prompt_only_data_names_the_algorithm(tmp_path):
    good = _jsonl(tmp_path / "good.jsonl", [{"prompt": "q"}])
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "q"}])
    args = types.SimpleNamespace(dataset=bad, dataset_split="train", seed=0, eval_dataset=None)
    assert (_refusal(data.prompt_data, args, "GRPO")
            == f"error: {bad} has no column 'prompt' (columns: question). GRPO trains on prompt-only data.")
    args = types.SimpleNamespace(dataset=good, dataset_split="train", seed=0, eval_dataset=bad)
    assert (_refusal(data.prompt_data, args, "PPO")
            == f"error: {bad} has no column 'prompt' (columns: question). PPO evaluates on prompt-only data.")


# ------------------------------------------------------------------ the checks beside the refusals, at their edges
def test_an_empty_assistant_turn_is_refused_only_where_it_would_be_trained():
    where = "data.jsonl, row 0, column 'messages'"
    before_last = _chat(("user", "hi"), ("assistant", ""), ("user", "again"), ("assistant", "bob"))
    data.check_messages(before_last, where)  # not trained on (a prompt's conversation): allowed
    assert (_refusal(data.check_messages, before_last, where, trained=True)
            == "error: data.jsonl, row 0, column 'messages', message 1: an assistant message before the last one is "
               "empty; it would train on the end-of-turn token alone. Remove the turn or fill it.")
    data.check_messages(_chat(("user", "hi"), ("assistant", " ")), where, trained=True)  # the last one: check_text's
    just_before_last = _chat(("user", "hi"), ("assistant", ""), ("user", "again"))
    assert (_refusal(data.check_messages, just_before_last, where, trained=True)
            == "error: data.jsonl, row 0, column 'messages', message 1: an assistant message before the last one is "
               "empty; it would train on the end-of-turn token alone. Remove the turn or fill it.")


def test_unreadable_text_is_refused_past_half_of_the_first_rows():
    tok = world.build_tokenizer()  # has whole words: a single letter (or the lone space 'Ġ') is a word it cannot read
    name = f"{type(tok).__name__}, {len(tok)} tokens"
    data.check_readable(tok, [" bob bob q"], None, "data.jsonl")  # 'Ġ', 'q': 2 of 4, exactly half
    data.check_readable(tok, [" bob bob q"] * 16 + [" q q q q"], None, "data.jsonl")  # the 17th row is not read
    data.check_readable(tok, [""], None, "data.jsonl")  # no token: nothing to judge
    assert (_refusal(data.check_readable, tok, [" bob bob qq"], None, "data.jsonl")
            == "error: 3 of the 5 tokens of the first rows of data.jsonl are unknown or single letters to the "
               f"tokenizer of the from-scratch model ({name}): it cannot read this text. --model is probably missing: "
               "pass the Hub id or folder of a model whose tokenizer reads it (the default runs/sft is the embedded "
               "world's policy, which knows only the world's words).")
    words = _word_tokenizer()
    data.check_readable(words, ["yes nope"], "runs/sft", "data.jsonl")  # one unknown of 2
    assert (_refusal(data.check_readable, words, ["yes", "nope maybe"], "runs/sft", "embedded")
            == "error: 2 of the 3 tokens of the first rows of the embedded world are unknown or single letters to the "
               f"tokenizer of runs/sft ({type(words).__name__}, {len(words)} tokens): it cannot read this text. --model "
               "is probably missing: pass the Hub id or folder of a model whose tokenizer reads it (the default "
               "runs/sft is the embedded world's policy, which knows only the world's words).")


@pytest.mark.parametrize("epochs,steps", [(2, 7), (0.5, 2), (0.01, 1)])
def test_num_train_epochs_sets_max_steps(monkeypatch, capsys, epochs, steps):
    monkeypatch.setattr(sys, "argv", ["sft.py"])
    args = types.SimpleNamespace(num_train_epochs=epochs, max_steps=0)
    data.set_max_steps(args, 10, 3)
    assert args.max_steps == steps
    assert capsys.readouterr().out == f"sft: --num_train_epochs {epochs:g} over 10 examples, 3 per step: {steps} steps\n"


def test_without_num_train_epochs_max_steps_is_kept(capsys):
    args = types.SimpleNamespace(num_train_epochs=0, max_steps=5)
    data.set_max_steps(args, 10, 3)
    assert args.max_steps == 5 and capsys.readouterr().out == ""


def test_counting_cut_responses_needs_the_stop_ids():
    args = types.SimpleNamespace(max_prompt_length=4, max_completion_length=4)
    with pytest.raises(ValueError) as e:
        data.truncation_counts(world.build_tokenizer(), [" bob"], [" bob"], args, "sft")
    assert str(e.value) == "truncation_counts: pass the stop_ids training encodes the responses with"


def test_pairs_without_a_preference_are_kept_and_counted(capsys):
    ds = Dataset.from_list([{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "a", "rejected": "a"},
                            {"prompt": "r", "chosen": "c", "rejected": "c"}])
    assert len(data.preference_triples(ds, "prefs.jsonl")) == 3
    assert capsys.readouterr().out == ("note: 2 of 3 pairs of prefs.jsonl have chosen == rejected (first: row 1); they "
                                       "carry no preference and are kept, diluting the batch mean.\n")


# ------------------------------------------------------------------ the judges
@pytest.mark.parametrize("text,expected", [
    ("Prompt {prompt}\nA {a}\nB {b}\nVerdict:", None),
    ("A {a}\nB {b}\nVerdict:",
     "lacks {prompt}: the judge would not see the prompt; write them where they go."),
    ("Prompt {prompt}\nA {a}\nVerdict:",
     "lacks {b}: the judge would not see both responses; write them where they go."),
    ("Which is better?",
     "lacks {prompt}, {a}, {b}: the judge would not see both responses; write them where they go."),
], ids=["whole", "no prompt", "no b", "nothing"])
def test_a_judge_template_must_hold_prompt_a_and_b(tmp_path, text, expected):
    path = tmp_path / "judge.txt"
    path.write_text(text, encoding="utf-8")
    if expected is None:
        assert judges.load_judge_template(str(path)) == text
    else:
        assert _refusal(judges.load_judge_template, str(path)) == f"error: --judge_template {path} {expected}"


def test_a_judge_template_that_is_missing_or_not_utf8(tmp_path):
    assert judges.load_judge_template("") == judges.JUDGE_TEMPLATE
    assert (_refusal(judges.load_judge_template, str(tmp_path / "gone.txt"))
            == f"error: --judge_template {tmp_path}/gone.txt: no such file; pass a text file holding {{prompt}}, {{a}} "
               "and {b}.")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("{prompt} caf\xe9 {a} {b}".encode("latin-1"))
    assert (_refusal(judges.load_judge_template, str(latin))
            == f"error: --judge_template {latin} is not UTF-8 text (byte 12 is b'\\xe9'); save it as UTF-8.")


def _choice(**fields):
    return {"choices": [fields]}


def _tops(*pairs):
    return {"content": [{"top_logprobs": [{"token": t, "logprob": p} for t, p in pairs]}]}


@pytest.mark.parametrize("reply,expected", [
    ({"choices": []}, 'the reply {"choices": []} holds no choices[0] object'),
    ([1, 2], "the reply [1, 2] holds no choices[0] object"),
    ({"choices": ["A"]}, 'the reply {"choices": ["A"]} holds no choices[0] object'),
    (_choice(logprobs=_tops(("A", "-0.1"))),
     """the reply's top_logprobs entry {"token": "A", "logprob": "-0.1"} is not a token and a number"""),
    (_choice(logprobs=_tops(("A", -0.1), (" B", float("nan")))),
     "the reply gives the verdict 'B' the log-prob nan, which is no probability"),
    (_choice(logprobs=_tops((" A", float("-inf")))),
     "the reply gives the verdict 'A' the log-prob -inf, which is no probability"),
    (_choice(message={"content": "C"}), "the judge answered 'C', which is not a verdict (exactly A or B)"),
    (_choice(message={"content": "A or B"}), "the judge answered 'A or B', which is not a verdict (exactly A or B)"),
    (_choice(message={}), "the judge answered None, which is not a verdict (exactly A or B)"),
    (_choice(message={"content": "the first response is better " * 5}),
     "the judge answered 'the first response is better the first response is better the first response is better "
     "the first response is better the ..., which is not a verdict (exactly A or B)"),
], ids=["no choices", "a list", "a string choice", "a string log-prob", "a NaN log-prob", "an -inf log-prob",
        "another letter", "both letters", "no content", "a long answer, cut"])
def test_a_reply_that_is_no_verdict(reply, expected):
    with pytest.raises(judges.JudgeBadAnswer) as e:
        judges.answer_prob(reply)
    assert str(e.value) == expected


@pytest.fixture
def serve(monkeypatch):
    """serve(handle) -> the base URL of a server on 127.0.0.1 whose POST is handle(request handler)."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    servers = []

    def start(handle):
        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                handle(self)

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _reply(status, body=b"", headers=()):
    def handle(h):
        h.send_response(status)
        for name, value in headers:
            h.send_header(name, value)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
    return handle


def test_a_closed_port(serve):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(OSError) as e:
        judges.post_json(f"http://127.0.0.1:{port}/v1/chat/completions", b"{}", {}, 5)
    refused = ConnectionRefusedError(errno.ECONNREFUSED, os.strerror(errno.ECONNREFUSED))
    assert type(e.value) is OSError and str(e.value) == f"ConnectionRefusedError: {refused}"


def test_a_redirect_is_not_followed(serve):
    url = serve(_reply(302, headers=[("Location", "http://elsewhere.example/v1/chat/completions")])) + "/chat/completions"
    with pytest.raises(judges.JudgeUnreachable) as e:
        judges.post_json(url, b"{}", {}, 5)
    assert str(e.value) == (f"{url} redirected the request to http://elsewhere.example/v1/chat/completions, which the "
                            "judge does not follow (the API key would go there): pass the final URL as --judge_base_url")


def test_a_reply_too_large_or_too_slow(serve):
    url = serve(_reply(200, b'{"choices": []}'))
    with pytest.raises(ValueError) as e:
        judges.post_json(url, b"{}", {}, 5, max_bytes=8)
    assert str(e.value) == "the reply is larger than 8 bytes"

    def stall(h):
        h.send_response(200)
        h.send_header("Content-Length", "100")
        h.end_headers()
        h.wfile.write(b"{")
        h.wfile.flush()
        time.sleep(1)

    with pytest.raises(TimeoutError) as e:
        judges.post_json(serve(stall), b"{}", {}, 0.25)
    assert str(e.value) == "no complete reply within 0.25 s"


def _ask(url, retries):
    args = types.SimpleNamespace(judge_base_url=url + "/", judge_api_key_env="", judge_timeout=5.0,
                                 judge_max_retries=retries)
    return judges.http_first_better("judge", args, judges.JUDGE_TEMPLATE, ["q"], ["a"], ["b"])


def test_a_judge_that_refuses_the_request(serve):
    url = serve(_reply(403))
    with pytest.raises(judges.JudgeUnreachable) as e:
        _ask(url, retries=1)
    assert str(e.value) == f"{url}/chat/completions refused the request (HTTP 403 Forbidden)"


def test_a_judge_that_never_answers(serve):
    url = serve(_reply(200, b"not json"))
    with pytest.raises(judges.JudgeUnreachable) as e:
        _ask(url, retries=1)
    assert str(e.value) == f"{url}/chat/completions gave no answer in 2 tries (Expecting value: line 1 column 1 (char 0))"


def test_a_judge_that_fails_on_its_side_is_tried_again_and_named_by_its_status(serve):
    url = serve(_reply(500))
    with pytest.raises(judges.JudgeUnreachable) as e:
        _ask(url, retries=1)
    assert str(e.value) == f"{url}/chat/completions gave no answer in 2 tries (HTTP 500 Internal Server Error)"
    with pytest.raises(judges.JudgeUnreachable) as e:
        _ask(url, retries=0)
    assert str(e.value) == f"{url}/chat/completions gave no answer in 1 try (HTTP 500 Internal Server Error)"


# ------------------------------------------------------------------ the judges' own arithmetic and forms
def test_the_judges_question_goes_through_its_chat_template_as_one_user_turn():
    """judge_input with a chat template: the filled template as the user's one message, and the
    generation prompt after it (the judge answers next); without a template, the text itself."""
    tok = chat_tokenizer()
    text = judges.fill_template(judges.JUDGE_TEMPLATE, "say 3", " 3 ", "4")
    assert judges.judge_input(tok, "say 3", " 3 ", "4") == f"<|user|> {text} <|assistant|>"
    assert judges.judge_input(world.build_tokenizer(), "say 3", " 3 ", "4") == text
    assert text.endswith("Response A:\n3\n\nResponse B:\n4\n\nThe better response is")


def test_log_probs_of_every_spelling_of_a_letter_add_up():
    """answer_prob from top log-probs: "A" and " A" are the same verdict, their probabilities summed
    (0.3 + 0.3 against 0.4: 0.6); without both letters among them, the answer text decides, 1 or 0."""
    import math

    tops = [{"token": "A", "logprob": math.log(0.3)}, {"token": " A", "logprob": math.log(0.3)},
            {"token": "B", "logprob": math.log(0.4)}]
    reply = {"choices": [{"message": {"content": "A"}, "logprobs": {"content": [{"top_logprobs": tops}]}}]}
    assert judges.answer_prob(reply) == pytest.approx(0.6)
    assert judges.answer_prob({"choices": [{"message": {"content": " A\n"}}]}) == 1.0
    assert judges.answer_prob({"choices": [{"message": {"content": "B"}, "logprobs": []}]}) == 0.0


def test_a_long_or_non_finite_reply_is_shown_cut_and_as_json():
    """The reply a refusal shows: JSON (NaN written as NaN), cut to 200 characters; an answer that
    is no verdict cut to 120."""
    from rlhf import basics

    long = "x" * 300
    with pytest.raises(judges.JudgeBadAnswer) as e:
        judges.answer_prob({"score": float("nan"), "nothing": long})
    shown = basics.brief('{"score": NaN, "nothing": "' + long + '"}', 200)
    assert str(e.value) == f"the reply {shown} holds no choices[0] object"
    with pytest.raises(judges.JudgeBadAnswer) as e:
        judges.answer_prob({"choices": [{"message": {"content": "A"}, "logprobs": {"content": [{"top_logprobs": [
            {"token": "A", "logprob": float("nan")}, {"token": "B", "logprob": -1.0}]}]}}]})
    assert str(e.value) == "the reply gives the verdict 'A' the log-prob nan, which is no probability"
    with pytest.raises(judges.JudgeBadAnswer) as e:
        judges.answer_prob({"choices": [{"message": {"content": long}}]})
    assert len(str(e.value)) < 200 and str(e.value).startswith("the judge answered 'xxx")


def test_json_and_parquet_files_load_as_one_table_and_missing_ones_are_named(tmp_path):
    """A .json file (JSON lines) and a .parquet file load as a Dataset of their rows; a missing
    .json or .parquet file is named as a missing file before anything else is tried."""
    path = tmp_path / "data.json"
    path.write_text('{"prompt": "q"}\n{"prompt": "r"}\n')
    loaded = data.load_data(str(path))
    assert isinstance(loaded, Dataset) and loaded["prompt"] == ["q", "r"]
    parquet = data.load_data(_parquet(tmp_path / "data.parquet", {"prompt": ["q", "r", "s"]}))
    assert isinstance(parquet, Dataset) and parquet["prompt"] == ["q", "r", "s"]
    for name in ("gone.json", "gone.parquet"):
        missing = str(tmp_path / name)
        assert _refusal(data.load_data, missing) == f"error: dataset file {missing} does not exist."


@pytest.mark.parametrize("spec, hub", [("org/name", True), ("name", True), ("a/b/c", False), ("/nope", False),
                                       ("~nope", False), ("./nope", False)])
def test_a_name_that_is_no_path_is_asked_of_the_hub_and_a_path_is_named(spec, hub, monkeypatch):
    """load_data of something that does not exist: a Hub-shaped name (at most one '/', not starting
    with '.', '/' or '~') is asked of the Hub, whose refusal names it; any other is a missing path."""
    import huggingface_hub

    def offline(self, name, timeout):
        raise RuntimeError(f"offline: {name}")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", offline)
    expected = (f"error: {spec} is not a local file or folder and the Hugging Face Hub cannot provide it (RuntimeError: "
                f"offline: {spec}); check the path (relative to {os.getcwd()}), or download it while online."
                if hub else f"error: dataset {spec} does not exist.")
    assert _refusal(data.load_data, spec) == expected


def test_what_the_http_judge_sends_and_when_it_tries_again(serve, monkeypatch):
    """The request: one user message holding the filled template, one token at temperature 0 with
    the top 5 log-probs, JSON, and the key from --judge_api_key_env as a bearer token (none without
    it). A 400 is refused at once; 408 and 429 are tried again, after 0.5, 1, 2 ... seconds, at most 8."""
    import math

    seen = []

    def record(h):
        seen.append((h.path, dict(h.headers), json.loads(h.body)))
        tops = [{"token": "A", "logprob": math.log(0.75)}, {"token": "B", "logprob": math.log(0.25)}]
        _reply(200, json.dumps({"choices": [{"message": {"content": "A"}, "logprobs": {"content": [
            {"top_logprobs": tops}]}}]}).encode())(h)

    url = serve(record)
    monkeypatch.setenv("JUDGE_KEY", "secret")
    args = types.SimpleNamespace(judge_base_url=url + "/", judge_api_key_env="JUDGE_KEY", judge_timeout=5.0,
                                 judge_max_retries=0)
    assert judges.http_first_better("judge-model", args, judges.JUDGE_TEMPLATE, ["q"], ["a"], ["b"]).tolist() == [pytest.approx(0.75)]
    path, headers, body = seen[-1]
    assert path == "/v1/chat/completions"
    assert headers["Content-Type"] == "application/json" and headers["Authorization"] == "Bearer secret"
    assert body == {"model": "judge-model", "messages": [{"role": "user", "content": judges.fill_template(
        judges.JUDGE_TEMPLATE, "q", "a", "b")}], "max_tokens": 1, "temperature": 0.0, "logprobs": True, "top_logprobs": 5}
    for env in ("", "UNSET_JUDGE_KEY"):
        judges.http_first_better("judge-model", types.SimpleNamespace(**{**vars(args), "judge_api_key_env": env}),
                                 judges.JUDGE_TEMPLATE, ["q"], ["a"], ["b"])
        assert "Authorization" not in seen[-1][1]

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    with pytest.raises(judges.JudgeUnreachable) as e:
        _ask(serve(_reply(400)), retries=3)
    assert str(e.value).endswith("refused the request (HTTP 400 Bad Request)") and slept == []
    for status, reason in ((408, "Request Timeout"), (429, "Too Many Requests")):
        slept.clear()
        with pytest.raises(judges.JudgeUnreachable) as e:
            _ask(serve(_reply(status)), retries=6)
        assert str(e.value).endswith(f"gave no answer in 7 tries (HTTP {status} {reason})")
        assert slept == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]  # doubling, at most 8 s


def test_the_llm_judge_reads_both_spellings_of_each_letter_and_asks_with_the_given_template(monkeypatch):
    """answer_token_ids: "A" and " A" when each is one token of the vocabulary; llm_judge asks
    prob_first_better with the caller's template and batch size, in both orders."""
    import numpy as np
    from tokenizers import AddedToken

    tok = chat_tokenizer()
    tok.add_tokens([AddedToken("A", normalized=False), AddedToken(" A", normalized=False)])
    ids = judges.answer_token_ids(tok, "A")
    assert ids == sorted(tok.convert_tokens_to_ids(["A", " A"])) and len(set(ids)) == 2
    bos_tok, _ = bos_tokenizer()  # a tokenizer that puts BOS before every text: the letters are still one token each
    bos_tok.add_tokens([AddedToken("A", normalized=False), AddedToken(" A", normalized=False)])
    assert judges.answer_token_ids(bos_tok, "A") == sorted(bos_tok.convert_tokens_to_ids(["A", " A"]))
    asked = []

    def first_better(model, tokenizer, prompts, firsts, seconds, batch_size, template):
        asked.append((firsts, seconds, batch_size, template))
        return np.array([0.8 if firsts == ["a"] else 0.4])

    monkeypatch.setattr(judges, "prob_first_better", first_better)
    assert judges.llm_judge(None, tok, ["q"], ["a"], ["b"], batch_size=3, template="T {prompt} {a} {b}").tolist() == [0.7]
    assert asked == [(["a"], ["b"], 3, "T {prompt} {a} {b}"), (["b"], ["a"], 3, "T {prompt} {a} {b}")]
