"""A tiny from-scratch model for any dataset: a small Qwen2 and a tokenizer fitted to the text.

Both embedded worlds train one (world.py: the summarization world's fixed word vocabulary;
world_arith.py: characters), and `python sft.py --dataset data.jsonl` (no --model) builds one
for a user's own data. Two tokenizers, both saved as one `tokenizer.json`:

- **char**: one token per character (per byte-level symbol: for ASCII text, per character),
  built as a byte-level BPE without merges, with Qwen2's own normaliser, pre-tokenizer and
  decoder. transformers 5's `AutoTokenizer` loads any `qwen2` folder as `Qwen2Tokenizer`, which
  rebuilds exactly these parts from the saved vocabulary, so plain
  `AutoTokenizer.from_pretrained(folder)` loads it exactly as saved. Like Qwen2's, its BPE has
  no unknown token: a character absent from the fitted text is dropped when encoding (the
  arithmetic world's splits share their 16 characters; fit a user dataset on all of its text);
- **word**: one token per whitespace-separated word (WordLevel, unknown words -> `<unk>`).
  `Qwen2Tokenizer` cannot express it, so `AutoTokenizer` would rebuild it wrongly for a qwen2
  folder: load it with `common.load_tokenizer` (or `TokenizersBackend.from_pretrained`), as every
  script here does.

Pad and EOS are distinct tokens, so masks and stop tokens never depend on each other.
"""

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]  # word level
CHAR_SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]  # <unk> is never produced: every symbol of the text is in
MAX_LENGTH = 256  # model_max_length and max_position_embeddings of the tiny model


def word_tokenizer(words):
    """A word-level tokenizer: SPECIAL_TOKENS, then `words` in the order given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIAL_TOKENS + [w for w in words if w not in SPECIAL_TOKENS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return _wrap(tok)


def char_tokenizer(texts):
    """A character-level tokenizer over the byte-level symbols that occur in `texts`, laid
    out as Qwen2Tokenizer rebuilds it (see the module docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = sorted({s for text in texts for piece, _ in byte_level.pre_tokenize_str(text) for s in piece})
    vocab = {t: i for i, t in enumerate(CHAR_SPECIAL_TOKENS + symbols)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], dropout=None, unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                 byte_level])
    tok.decoder = decoders.ByteLevel()
    return _wrap(tok)


def _wrap(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        model_max_length=MAX_LENGTH, padding_side="right", clean_up_tokenization_spaces=False,
    )


def fit_tokenizer(texts, level):
    """A `level` ('char' or 'word') tokenizer fitted to `texts`: every character, or every
    whitespace-separated word (in order of first appearance), that they contain."""
    if level == "char":
        return char_tokenizer(texts)
    return word_tokenizer(list(dict.fromkeys(w for text in texts for w in text.split())))


def build_model(tokenizer, hidden_size=192, num_layers=2, seed=0):
    """A tiny Qwen2ForCausalLM from a Qwen2Config: the same code path as Qwen/Qwen2.5-1.5B."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = max(2, hidden_size // 32)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=heads,
        # every head has its own keys and values (Qwen2.5-1.5B shares 2 among 12): with shared
        # KV heads the SFT policy copies facts wrongly far more often, and a reward model can't
        # see such copy errors (`probe_pairs`); the README's Results give the measurements.
        num_key_value_heads=heads,
        max_position_embeddings=MAX_LENGTH, tie_word_embeddings=True, rope_theta=10000.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, use_cache=True,
        from_scratch=True,  # a toy policy: common.is_embedded_policy gives it the embedded-world defaults
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)
