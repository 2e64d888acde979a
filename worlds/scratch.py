"""A tiny from-scratch model for any dataset: a small Qwen2 and a tokenizer fitted to the text.

Both embedded worlds train one (world.py: the summarization world's fixed word list;
world_arith.py: characters), and `python sft.py --dataset data.jsonl` (no --model) builds one
for a user's own data. Both tokenizers are byte-level BPEs laid out exactly as Qwen2's (its NFC
normaliser, its pre-tokenizer regex + ByteLevel, its ByteLevel decoder, no unknown token).
transformers 5's `AutoTokenizer` loads any `qwen2` folder as `Qwen2Tokenizer`, which rebuilds
these parts from the saved vocabulary and merges, so plain `AutoTokenizer.from_pretrained(folder)`
(TRL, vLLM, lm-eval) encodes and decodes exactly as the scripts here do. Pad and EOS are distinct
special tokens, so masks and stop tokens never depend on each other.

- **char**: one token per character (per byte-level symbol: for ASCII text, per character), a
  BPE without merges over the symbols that occur in the text. Like Qwen2's, it has no unknown
  token: a character absent from the fitted text is dropped when encoding (the arithmetic
  world's splits share their 16 characters; fit a user dataset on all of its text);
- **word**: one token per word. The alphabet is all 256 bytes, so any text encodes, and merges
  are learned (tokenizers' BpeTrainer, deterministic) until every pre-token of the fitted text
  -- a word with its leading space, " carol", or a run of punctuation, " .\n" -- is one token.
  Text outside the fitted words falls back to shorter pieces, down to single bytes.
"""

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]  # <unk> is never produced (Qwen2's BPE has no unknown token)
MAX_LENGTH = 256  # model_max_length and max_position_embeddings of the tiny model


def _qwen2_layout(merges_or_vocab):
    """A BPE tokenizer with Qwen2's normaliser, pre-tokenizer and decoder (Qwen2Tokenizer.__init__)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE(**merges_or_vocab, dropout=None, unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def word_tokenizer(texts):
    """A byte-level BPE whose merges make every pre-token of `texts` one token (module docstring)."""
    from tokenizers import pre_tokenizers, trainers

    tok = _qwen2_layout({})
    trainer = trainers.BpeTrainer(vocab_size=1 << 20, min_frequency=0, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # merges until none is left
    tok.train_from_iterator(texts, trainer)
    return _wrap(tok)


def added_words_tokenizer(words, bare=()):
    """A byte-level tokenizer in Qwen2's layout over all 256 bytes, without merges, in which every
    word of `words` with its leading space (" carol"), and each of `bare` as it is ("POST:"), is an
    added token: one token per word, and any other text byte by byte. A BPE whose merges make each
    word one token also holds every intermediate merge (" c", " ca", ...), rows the text never uses
    that made the TL;DR world's from-scratch policy copy facts wrongly (docs/worlds.md)."""
    from tokenizers import AddedToken, pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = _qwen2_layout({"vocab": {t: i for i, t in enumerate(SPECIAL_TOKENS + symbols)}, "merges": []})
    tok.add_tokens([AddedToken(" " + w, normalized=False) for w in words] + [AddedToken(w, normalized=False) for w in bare])
    return _wrap(tok)


def char_tokenizer(texts):
    """A character-level tokenizer over the byte-level symbols that occur in `texts`."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = sorted({s for text in texts for piece, _ in byte_level.pre_tokenize_str(text) for s in piece})
    return _wrap(_qwen2_layout({"vocab": {t: i for i, t in enumerate(SPECIAL_TOKENS + symbols)}, "merges": []}))


def _wrap(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        model_max_length=MAX_LENGTH, padding_side="right", clean_up_tokenization_spaces=False,
    )


def fit_tokenizer(texts, level):
    """A `level` ('char' or 'word') tokenizer fitted to `texts`: one token for every character,
    or for every word, that they contain."""
    return char_tokenizer(texts) if level == "char" else word_tokenizer(texts)


def build_model(tokenizer, hidden_size=192, num_layers=2, seed=0, texts=None):
    """A tiny Qwen2ForCausalLM from a Qwen2Config: the same code path as Qwen/Qwen2.5-1.5B.

    `texts` (the training text, optional): the embedding rows of the (non-special) tokens that it
    never contains start at zero instead of random. A byte-level vocabulary holds many such tokens
    (the 256 byte symbols: 256 of the TL;DR world's 365; a word-level BPE also holds its
    intermediate merges); a char-level one holds none. With tied embeddings a
    random row is a random output direction that the softmax must push down; a few hundred of them span
    the hidden space, and an SFT policy trained among them copies facts wrongly far more often
    (docs/worlds.md). Zero rows get equal logits, equal gradients and equal Adam
    updates, so they stay one shared direction (exactly with fp32 AdamW states; with the default
    8-bit states, or bf16's stochastic rounding, within their quantisation noise): one extra class to push down, as if the vocabulary held
    only the text's tokens. The tokenizer, and so AutoTokenizer, is unchanged."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = max(2, hidden_size // 32)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=heads,
        # every head has its own keys and values (Qwen2.5-1.5B shares 2 among 12): with shared
        # KV heads the SFT policy copies facts wrongly far more often, and a reward model can't
        # see such copy errors (`probe_pairs`); docs/worlds.md gives the measurements.
        num_key_value_heads=heads,
        max_position_embeddings=MAX_LENGTH, tie_word_embeddings=True, rope_theta=10000.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, use_cache=True,
        from_scratch=True,  # a toy policy: common.is_embedded_policy gives it the embedded-world defaults
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    if texts is not None:
        used = set(tokenizer.all_special_ids)  # pad, EOS, <unk>: their usual init
        for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
            used.update(ids)
        unused = torch.tensor(sorted(set(range(len(tokenizer))) - used), dtype=torch.long)
        with torch.no_grad():
            model.get_input_embeddings().weight[unused] = 0.0  # tied: the output rows too
    return model
