"""Data and tokenisation: a --dataset in TRL's formats (prompt+completion, messages, preference
pairs standard or conversational, prompt-only with extra columns) read from the Hub, a file or a
folder and checked row by row; prompts and completions rendered through the chat template and
encoded (prompts left-padded, completions right-padded and ending with a stop token); the
stateless batch order that makes a resumed run see the data an uninterrupted one sees.
"""

import json
import math
import os

import torch

from rlhf import basics
from rlhf import parallel
from rlhf import humaneval
from worlds import reasoning_gym_tasks


def load_data(spec, split="train"):
    """A `datasets.Dataset` from a Hub name, a local .jsonl/.json/.parquet file, or a folder.

    JSONL is checked line by line first, so a malformed row names its file and line.
    """
    from datasets import load_dataset

    if os.path.isfile(spec):
        ext = os.path.splitext(spec)[1].lower()
        if ext in (".jsonl", ".json"):
            if ext == ".jsonl":
                check_jsonl(spec)
            return load_dataset("json", data_files=spec, split="train")
        if ext == ".parquet":
            import pyarrow.parquet as pq

            try:
                rows = pq.ParquetFile(spec).metadata.num_rows
            except Exception as e:  # noqa: BLE001 -- not parquet at all
                basics.fail(f"{spec} is not a readable parquet file ({type(e).__name__}: {e}).")
            if rows == 0:
                basics.fail(f"{spec} has no rows.")
            return load_dataset("parquet", data_files=spec, split="train")
        basics.fail(f"{spec}: unsupported file type {ext!r}; use .jsonl, .json or .parquet.")
    if spec.endswith((".jsonl", ".json", ".parquet")) and not os.path.exists(spec):
        basics.fail(f"dataset file {spec} does not exist.")
    if os.path.isdir(spec):  # a folder of data files: each JSONL file is checked line by line too
        check_folder(spec)
    elif not os.path.exists(spec) and spec.count("/") <= 1 and not spec.startswith((".", "/", "~")):
        basics.check_hub_id(spec, "dataset")
    else:
        basics.fail(f"dataset {spec} does not exist.")
    try:
        ds = load_dataset(spec, split=split)
    except ValueError as e:  # e.g. an unknown split
        basics.fail(f"dataset {spec}: {basics.brief(e)}")
    except Exception as e:  # noqa: BLE001 -- datasets' own errors (e.g. rows that do not fit one schema), named
        basics.fail(f"dataset {spec} cannot be read as one table ({type(e).__name__}: {basics.brief(e, 200)}); "
                    "keep one format and one set of columns per folder.")
    if len(ds) == 0:
        basics.fail(f"dataset {spec} (split {split}) has no rows.")
    return ds


def training_data(args, world_split):
    """The script's --dataset: on the embedded world its `world_split` split (sft, prefs or rl),
    otherwise load_data(--dataset, --dataset_split)."""
    return named_data(args.dataset, args.dataset_split, world_split, args.seed)


def named_data(spec, split, world_split, seed):
    """An embedded world's `world_split` split when `spec` names one (embedded, embedded:arith...,
    embedded:code), a Reasoning Gym task's (reasoning_gym:TASK), HumanEval's (humaneval), otherwise load_data(spec, split)."""
    if spec == basics.EMBEDDED:
        return basics.embedded_world(seed)[world_split]
    if spec.startswith(basics.ARITH):
        return basics.arith_split(spec, world_split, seed)
    if spec == basics.CODE:
        return basics.code_split(world_split, seed)
    if spec == basics.IFEVAL:
        return basics.ifeval_split(world_split, seed)
    if spec.startswith(reasoning_gym_tasks.SPEC):
        return reasoning_gym_split(spec, world_split, seed)
    if spec == humaneval.SPEC:
        return humaneval.build_split(world_split)
    return load_data(spec, split)


_TASK_CACHE = {}


def is_task(spec):
    """Whether --dataset names a task from a package (reasoning_gym:TASK, humaneval): a fixed test
    split, as the worlds have."""
    return spec.startswith(reasoning_gym_tasks.SPEC) or spec == humaneval.SPEC


def reasoning_gym_split(spec, world_split, seed=0):
    """A split of `--dataset reasoning_gym:TASK[:options]` (worlds/reasoning_gym_tasks.py: `test` the
    same for every seed, the others drawn with `seed` and disjoint from it), built once per process."""
    key = (spec, world_split, None if world_split == "test" else seed)
    if key not in _TASK_CACHE:
        _TASK_CACHE[key] = reasoning_gym_tasks.build_split(spec, world_split, seed)
    return _TASK_CACHE[key]


def set_max_steps(args, num_examples, examples_per_step):
    """--num_train_epochs E (TRL's): max_steps = ceil(E * examples / examples per optimizer step)."""
    if args.num_train_epochs:
        args.max_steps = max(1, math.ceil(args.num_train_epochs * num_examples / examples_per_step))
        print(f"{basics.script_name()}: --num_train_epochs {args.num_train_epochs:g} over {num_examples} examples, "
              f"{examples_per_step} per step: {args.max_steps} steps")


def eval_data(args):
    """--eval_dataset (a file, a Hub name's 'test' split, or an embedded world's name: its held-out
    'test' split, whose prompts no training split of that --seed holds), or None when not given."""
    return named_data(args.eval_dataset, "test", "test", args.seed) if args.eval_dataset else None


DATA_FILES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".arrow")  # what datasets reads from a folder


def check_folder(folder):
    """A --dataset folder: datasets reads the files of one format only and one set of columns, and
    drops the rest without a word; refuse such a folder (and an empty one), naming the files."""
    files = sorted(os.path.join(root, n) for root, dirs, names in os.walk(folder) for n in names
                   if n.endswith(DATA_FILES) and not n.startswith(".") and "/." not in root[len(folder):])
    if not files:
        basics.fail(f"dataset folder {folder} holds no data files ({', '.join(DATA_FILES[:3])}).")
    kinds = {}
    for f in files:
        kinds.setdefault(".json" if f.endswith(".jsonl") else os.path.splitext(f)[1], f)
    if len(kinds) > 1:
        first, second = list(kinds.values())[:2]
        basics.fail(f"dataset folder {folder} mixes file types ({first} and {second}); datasets would read one "
                    "type and drop the other: keep one type per folder, or pass a file.")
    columns = {}
    for f in files:
        if f.endswith(".jsonl"):
            check_jsonl(f)
            with open(f, encoding="utf-8-sig") as fh:
                row = next(json.loads(line) for line in fh if line.strip())
            columns.setdefault(tuple(sorted(row)), f)
        elif f.endswith(".parquet"):
            import pyarrow.parquet as pq

            columns.setdefault(tuple(sorted(pq.read_schema(f).names)), f)
    if len(columns) > 1:
        (a, fa), (b, fb) = list(columns.items())[:2]
        basics.fail(f"dataset folder {folder} mixes formats: {fa} has the columns {', '.join(a)} and {fb} has "
                    f"{', '.join(b)}; keep one format per folder (e.g. SFT and preference files apart).")


def check_jsonl(path):
    rows = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a byte-order mark is read past
            except UnicodeDecodeError as e:
                basics.fail(f"{path}, line {n}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); re-encode the file as UTF-8.")
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # without its newline: a line cut short is named at its own end
            except json.JSONDecodeError as e:
                basics.fail(f"{path}, line {n}: not valid JSON ({e.msg} at column {e.colno}).")
            if not isinstance(row, dict):
                basics.fail(f"{path}, line {n}: each line must be a JSON object, got {type(row).__name__}.")
            rows += 1
    if rows == 0:
        basics.fail(f"{path} is empty (no JSON rows, only blank lines or nothing).")


def dataset_name(spec):
    return "the embedded world" if spec == basics.EMBEDDED else spec


def prompt_data(args, algorithm):
    """--dataset and --eval_dataset (None when not given) as prompt-only data, TRL's format: a
    `prompt` column of texts or conversations; every other column goes to the reward functions."""
    ds = training_data(args, "rl")
    require_columns(ds, ["prompt"], args.dataset, f"{algorithm} trains on prompt-only data.")
    check_text(ds, ["prompt"], args.dataset)
    eval_ds = eval_data(args)
    if eval_ds is not None:
        require_columns(eval_ds, ["prompt"], args.eval_dataset, f"{algorithm} evaluates on prompt-only data.")
        check_text(eval_ds, ["prompt"], args.eval_dataset)
    return ds, eval_ds


def require_columns(ds, columns, spec, hint=""):
    """Stop with a message naming the missing column and the dataset."""
    for col in columns:
        if col not in ds.column_names:
            basics.fail(f"{dataset_name(spec)} has no column {col!r} (columns: {', '.join(ds.column_names)}). {hint}".strip())
    if len(ds) == 0:
        basics.fail(f"{dataset_name(spec)} is empty.")


def is_conversational(value):
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def check_messages(msgs, where, trained=False):
    """Every message's content is text (not None, not a list of parts), and with `trained` (the
    assistant turns are trained on: SFT's messages or completion) no assistant message is empty:
    an empty one would train on the end-of-turn token alone. `where`: "<data>, row i, column c"."""
    for j, m in enumerate(msgs):
        if not isinstance(m["content"], str):
            basics.fail(f"{where}, message {j} ({m['role']}): the content is {type(m['content']).__name__} "
                        f"{repr(m['content'])[:60]}, not text; write each message's content as one string (join a list "
                        "of parts into its text).")
        if trained and m["role"] == "assistant" and j < len(msgs) - 1 and not m["content"].strip():
            basics.fail(f"{where}, message {j}: an assistant message before the last one is empty; it would train on the "
                        "end-of-turn token alone. Remove the turn or fill it.")


def check_text(ds, columns, spec):
    """Every value of these columns is a non-empty string or a list of {role, content} messages,
    each with text content (check_messages)."""
    for col in columns:
        for i, v in enumerate(ds[col]):
            if is_conversational(v):
                check_messages(v, f"{dataset_name(spec)}, row {i}, column {col!r}", trained=col in ("messages", "completion"))
            # a conversation's last message is the response (or the prompt's question): empty is an error too
            if is_conversational(v) and v and not str(v[-1]["content"]).strip():
                basics.fail(f"{dataset_name(spec)}, row {i}, column {col!r}: the last {v[-1]['role']} message is empty; an empty "
                     "response would train on the end-of-turn token alone. Remove the row or fill it.")
            if not ((isinstance(v, str) and v.strip()) or (is_conversational(v) and v)):
                basics.fail(f"{dataset_name(spec)}, row {i}, column {col!r}: expected non-empty text or a list of "
                     f"{{role, content}} messages, got {str(v)[:80]!r}.")


def check_readable(tokenizer, texts, model, spec, rows=16):
    """Stop when most tokens of the first `rows` texts are the unknown token, or single letters
    from a tokenizer that has whole words: the data is in words this tokenizer cannot read
    (typically --dataset without --model, which trains the embedded world's policy on it)."""
    ids = [i for t in texts[:rows] for i in tokenizer(t, add_special_tokens=False)["input_ids"]]
    if not ids:
        return
    has_words = any(len(t.strip()) > 1 and t.strip().isalpha() for t in tokenizer.get_vocab())  # not a character-level one
    pieces = tokenizer.convert_ids_to_tokens(ids)
    n_bad = sum(i == tokenizer.unk_token_id or (has_words and len(p) == 1 and p.isalpha()) for i, p in zip(ids, pieces))
    if n_bad > len(ids) / 2:
        basics.fail(f"{n_bad} of the {len(ids)} tokens of the first rows of {dataset_name(spec)} are unknown or single letters "
             f"to the tokenizer of {model or 'the from-scratch model'} ({type(tokenizer).__name__}, {len(tokenizer)} tokens): "
             "it cannot read this text. --model is probably missing: pass the Hub id or folder of a model whose "
             "tokenizer reads it (the default runs/sft is the embedded world's policy, which knows only the world's words).")


def render_prompt(tokenizer, prompt, tools=None):
    """Prompt text: plain strings as they are; conversations through the chat template (with
    `tools`, JSON schemas of functions the model may call: grpo.py --tools, tools.py)."""
    if isinstance(prompt, str):
        return prompt
    if not tokenizer.chat_template:
        basics.fail("conversational data needs a tokenizer with a chat template; this one has none.")
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, tools=tools,
                                         **basics.CHAT_TEMPLATE_KWARGS)


def check_renders_tools(tokenizer, prompt, tools, what):
    """Stop when the chat template drops `tools=` (SmolLM2's, many others'): the prompt rendered
    with the tools' schemas is the prompt without them, so the model would never see them and the
    run would go on as if no tool existed. `what`: the flag or column that gave the tools."""
    if not tools or not tokenizer.chat_template:
        return
    conversation = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if render_prompt(tokenizer, conversation, tools) == render_prompt(tokenizer, conversation):
        basics.fail(f"{what}: this chat template renders no tools (a prompt with tools= renders as one without), so the "
                    "model would never see their schemas; use a model whose chat template lists tools (e.g. "
                    "Qwen2.5-Instruct), or save this model with a chat template that renders `tools` (its folder's "
                    "chat_template.jinja).")


def render_completion(tokenizer, prompt, completion):
    """Completion text: plain strings as they are; assistant messages as the chat template
    writes them after the prompt (so the end-of-turn token is trained on)."""
    if isinstance(completion, str):
        return completion
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    head = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **basics.CHAT_TEMPLATE_KWARGS)
    full = tokenizer.apply_chat_template(prompt + completion, tokenize=False, **basics.CHAT_TEMPLATE_KWARGS)
    if not full.startswith(head):
        basics.fail("the chat template does not render the prompt as a prefix of prompt + completion; "
             "pass prompt/completion as plain strings instead.")
    return full[len(head):]


def render_turns(tokenizer, prompt, completion, tools=None):
    """The completion as [(text, trained), ...] segments after the rendered prompt (TRL's
    assistant_only_loss): a string is one trained segment; messages alternate trained assistant
    turns (as the chat template writes them, end-of-turn token included) and masked others
    (user/tool turns and the next generation prompt). Joined, the texts are render_completion's.
    `tools`: JSON schemas for the template, as render_prompt's (a row's `tools` column)."""
    if isinstance(completion, str):
        return [(completion, True)]
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    msgs = prompt + completion

    def upto(k, gen):  # the conversation's first k messages, rendered
        return tokenizer.apply_chat_template(msgs[:k], tokenize=False, add_generation_prompt=gen, tools=tools,
                                             **basics.CHAT_TEMPLATE_KWARGS)

    segments, done = [], upto(len(prompt), True)
    for k in range(len(prompt), len(msgs)):
        is_assistant = msgs[k]["role"] == "assistant"
        # after an assistant turn, the text up to the next generation prompt (if one follows) is masked
        nxt = upto(k + 1, not is_assistant and k + 1 < len(msgs) and msgs[k + 1]["role"] == "assistant")
        if not nxt.startswith(done):
            basics.fail("the chat template does not render each turn as a prefix of the next; pass prompt/completion "
                 "as plain strings instead.")
        if len(nxt) > len(done):
            segments.append((nxt[len(done):], is_assistant))
        done = nxt
    return segments


def sft_pairs(ds, spec):
    """(prompt, completion) pairs from TRL's SFT formats: prompt+completion, or messages (the
    prompt is everything before the first assistant turn, the completion the rest: every
    assistant turn is trained, the turns between them masked; see render_turns)."""
    if "messages" in ds.column_names:
        check_text(ds, ["messages"], spec)
        pairs = []
        for i, msgs in enumerate(ds["messages"]):
            first = next((j for j, m in enumerate(msgs) if m["role"] == "assistant"), 0) if is_conversational(msgs) else 0
            if not is_conversational(msgs) or msgs[-1]["role"] != "assistant" or first < 1:
                basics.fail(f"{dataset_name(spec)}, row {i}, column 'messages': must end with an assistant turn, and have "
                     "at least one other turn before its first assistant turn.")
            pairs.append((msgs[:first], msgs[first:]))
        return pairs
    if "text" in ds.column_names and "completion" not in ds.column_names:
        basics.fail(f"{dataset_name(spec)} is in the language-modelling format (a 'text' column); this project trains on "
             "prompt+completion or messages, so split each row into 'prompt' and 'completion'.")
    require_columns(ds, ["prompt", "completion"], spec, "Expected prompt+completion or messages.")
    check_text(ds, ["prompt", "completion"], spec)
    return list(zip(ds["prompt"], ds["completion"]))


def preference_triples(ds, spec):
    """(prompt, chosen, rejected) from TRL's preference formats, standard or conversational;
    without a prompt column, the prompt is the shared conversation before the last turn."""
    require_columns(ds, ["chosen", "rejected"], spec, "Preference data needs prompt + chosen + rejected.")
    if "prompt" not in ds.column_names:
        triples = []
        for i, (c, r) in enumerate(zip(ds["chosen"], ds["rejected"])):
            if not (is_conversational(c) and is_conversational(r) and c[:-1] == r[:-1] and len(c) > 1):
                basics.fail(f"{dataset_name(spec)}, row {i}: without a 'prompt' column, 'chosen' and 'rejected' must be "
                     "conversations that differ only in the last turn.")
            for col, v in (("chosen", c), ("rejected", r)):
                check_messages(v, f"{dataset_name(spec)}, row {i}, column {col!r}")  # each content is text
                if not str(v[-1]["content"]).strip():
                    basics.fail(f"{dataset_name(spec)}, row {i}, column {col!r}: the last {v[-1]['role']} message is empty; an empty "
                         "response would be the end-of-turn token alone. Remove the row or fill it.")
            triples.append((c[:-1], c[-1:], r[-1:]))
    else:
        check_text(ds, ["prompt", "chosen", "rejected"], spec)
        triples = list(zip(ds["prompt"], ds["chosen"], ds["rejected"]))
    # chosen == rejected: kept (no preference: zero gradient in DPO's and Bradley-Terry's loss), but counted
    same = [i for i, (_, c, r) in enumerate(triples) if c == r]
    if same:
        print(f"note: {len(same)} of {len(triples)} pairs of {dataset_name(spec)} have chosen == rejected (first: row "
              f"{same[0]}); they carry no preference and are kept, diluting the batch mean.")
    return triples


def batch_indices(n, batch_size, seed, step):
    """The example indices of micro-batch `step`: a fresh permutation every epoch, cycling
    forever. Stateless, so a resumed run sees exactly the data it would have seen."""
    out = []
    start = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.extend(perm[offset:offset + batch_size - len(out)].tolist())
    return out


def rank_batch(n, batch_size, seed, position):
    """This rank's examples of global micro-batch `position` (`batch_size` per rank): the same
    global batch on any number of ranks, each rank its contiguous slice (parallel.shard)."""
    return parallel.shard(batch_indices(n, batch_size * parallel.world_size(), seed, position))


def count_truncated(tokenizer, texts, max_length, stop_ids=None):
    """How many texts training will cut at max_length tokens: prompts as encode_prompts encodes
    them (`stop_ids` None), or completions as encode_completions (render_turns segments: as
    encode_turns) encodes them with `stop_ids`, the stop rule training uses
    (sampling.stop_token_ids): a completion already ending in a stop token gets no EOS."""
    if not max_length:
        return 0

    def cut(batch):
        if stop_ids is None:
            mask = encode_prompts(tokenizer, batch)[1]
        elif isinstance(batch[0], list):
            mask = encode_turns(tokenizer, batch, None, stop_ids)[1]
        else:
            mask = encode_completions(tokenizer, batch, None, stop_ids)[1]
        return int((mask.sum(1) > max_length).sum())
    return sum(cut(texts[i:i + 1024]) for i in range(0, len(texts), 1024))


def truncation_counts(tokenizer, prompts, responses, args, name, stop_ids=None):
    """prompts_truncated / completions_truncated for summary.json, counted up front and printed:
    prompts longer than --max_prompt_length keep their last tokens, responses (dataset completions,
    None for sampled ones, which the scripts count as they sample) keep their first
    --max_completion_length tokens, encoded with `stop_ids` (sampling.stop_token_ids) as training encodes them."""
    if responses and stop_ids is None:
        raise ValueError("truncation_counts: pass the stop_ids training encodes the responses with")
    counts = {"prompts_truncated": count_truncated(tokenizer, prompts, args.max_prompt_length),
              "completions_truncated": count_truncated(tokenizer, responses, args.max_completion_length, stop_ids)
              if responses else 0}
    if any(counts.values()):
        print(f"{name}: {counts['prompts_truncated']} of {len(prompts)} prompts are longer than --max_prompt_length "
              f"{args.max_prompt_length} and keep their last tokens"
              + (f"; {counts['completions_truncated']} of {len(responses)} responses are longer than --max_completion_length "
                 f"{args.max_completion_length} and are cut (their EOS is not seen)" if responses else ""))
    return counts


def encode_prompts(tokenizer, texts, max_length=None, device=None):
    """Left-padded prompt ids (B, P) and mask (on `device`, if given); too-long prompts keep their end."""
    seqs = [tokenizer(t, add_special_tokens=not _has_bos(tokenizer, t))["input_ids"] for t in texts]
    if max_length:
        seqs = [s[-max_length:] for s in seqs]
    ids, mask = _pad(seqs, tokenizer.pad_token_id, left=True)
    return (ids, mask) if device is None else (ids.to(device), mask.to(device))


def encode_completions(tokenizer, texts, max_length=None, stop_ids=None):
    """Right-padded completion ids (B, C) and mask, each ending with a stop token: EOS is added
    unless the text already ends with one of `stop_ids` (sampling.stop_token_ids; default: EOS
    alone), e.g. a chat template's end-of-turn, or with one and whitespace (Qwen's template
    writes "<|im_end|>\n"). The mask, not the ids, says where a completion ends (cut at
    max_length, the stop token is lost)."""
    eos = tokenizer.eos_token_id
    stops = set(stop_ids or [eos])
    seqs = []
    for t in texts:
        ids = tokenizer(t, add_special_tokens=False)["input_ids"]
        if not _ends_with_stop(tokenizer, ids, stops):
            ids = ids + [eos]
        seqs.append(ids[:max_length] if max_length else ids)
    return _pad(seqs, tokenizer.pad_token_id, left=False)


def encode_turns(tokenizer, turns, max_length=None, stop_ids=None):
    """encode_completions for completions given as render_turns segments: right-padded ids
    (B, C), mask, and the loss mask (B, C): 1 on the tokens of trained segments and on EOS
    (added unless the text already ends with one of `stop_ids`, as in encode_completions)."""
    eos = tokenizer.eos_token_id
    stops = set(stop_ids or [eos])
    seqs, trained = [], []
    for segments in turns:
        ids, train = [], []
        for text, is_trained in segments:  # each segment encoded alone, as prompt and completion are
            t = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, train = ids + t, train + [int(is_trained)] * len(t)
        if not _ends_with_stop(tokenizer, ids, stops):
            ids, train = ids + [eos], train + [1]
        seqs.append(ids[:max_length] if max_length else ids)
        trained.append(train[:max_length] if max_length else train)
    ids, mask = _pad(seqs, tokenizer.pad_token_id, left=False)
    return ids, mask, _pad(trained, 0, left=False)[0] * mask


def encode_examples(tokenizer, prompts, turns, max_length, stop_ids=None, spec=None):
    """sft.py --max_length: each example as one token list, the prompt's tokens as encode_prompts
    writes them, then the completion's as encode_turns writes them, and its loss mask (0 on the
    prompt), both cut to the first max_length tokens (TRL's max_length: the whole conversation,
    with no prompt/completion split). Returns ([ids], [loss mask]) as lists and how many were cut.
    With `spec` (the training data), an example with no trained token left (a prompt of max_length
    tokens or more) is refused, naming its row (an evaluation row scores no token: harmless)."""
    ids, masks, cut = [], [], 0
    for i in range(0, len(prompts), 1024):  # the padded tensors of 1024 examples at a time
        p_ids, p_mask = encode_prompts(tokenizer, prompts[i:i + 1024])
        c_ids, c_mask, loss_mask = encode_turns(tokenizer, turns[i:i + 1024], None, stop_ids)
        for j in range(p_ids.shape[0]):
            prompt, completion = p_ids[j][p_mask[j].bool()].tolist(), c_ids[j][c_mask[j].bool()].tolist()
            ids.append((prompt + completion)[:max_length])
            masks.append(([0] * len(prompt) + loss_mask[j][c_mask[j].bool()].tolist())[:max_length])
            cut += len(prompt) + len(completion) > max_length
            if spec is not None and not any(masks[-1]):
                basics.fail(f"{dataset_name(spec)}, row {i + j}: no token of its completion is "
                            f"left within --max_length {max_length} (the prompt alone has {len(prompt)} tokens), so "
                            "the row would train nothing; raise --max_length, or shorten or remove the row.")
    return ids, masks, cut


def pack(lengths, max_length):
    """Examples into rows of at most max_length tokens, best-fit decreasing (TRL's packing_strategy
    'bfd'): the longest first, each into the fullest row it still fits, else a new row. Returns
    [[example indices]] per row; no example is split."""
    import bisect

    rows, free = [], []  # free: sorted (tokens left, row) of the open rows
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = bisect.bisect_left(free, (lengths[i], -1))  # the row with the fewest tokens left that still fits
        if k == len(free):
            rows.append([])
            left, row = max_length, len(rows) - 1
        else:
            left, row = free.pop(k)
        rows[row].append(i)
        bisect.insort(free, (left - lengths[i], row))
    return rows


def packed_batch(rows, ids, masks, pad_id):
    """Rows of packed examples as right-padded tensors: input ids, position ids that restart at 0
    with each example (and with the padding), the mask of real tokens and the loss mask (0 on
    padding): (B, T) each."""
    seqs = [[t for i in row for t in ids[i]] for row in rows]
    positions = [[p for i in row for p in range(len(ids[i]))] for row in rows]
    trained = [[m for i in row for m in masks[i]] for row in rows]
    input_ids, real = _pad(seqs, pad_id, left=False)
    position_ids = torch.tensor([p + list(range(input_ids.shape[1] - len(p))) for p in positions])
    return input_ids, position_ids, real, _pad(trained, 0, left=False)[0] * real * (position_ids > 0)  # position 0: unpredicted


def _ends_with_stop(tokenizer, ids, stops):
    """Whether `ids` end with a stop token, possibly followed by whitespace tokens."""
    for k in range(len(ids) - 1, -1, -1):
        if ids[k] in stops:
            return True
        if tokenizer.decode(ids[k:k + 1]).strip():
            return False
    return False


def _has_bos(tokenizer, text):
    return tokenizer.bos_token is not None and text.startswith(tokenizer.bos_token)


def _pad(seqs, pad_id, left):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, sl] = torch.tensor(s, dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask
