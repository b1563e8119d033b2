"""Rebuild a ``tokenizers.Tokenizer`` from the tokenizer a GGUF file describes.

A GGUF carries no tokenizer.json, only llama.cpp's metadata: the token list,
token types, merges (byte-level BPE) or scores (SentencePiece), and the *name*
of a pre-tokenizer (``tokenizer.ggml.pre``). The name stands for regexes that
live in llama.cpp's source (``llm_tokenizer_bpe`` in src/llama-vocab.cpp), so
they are copied here; a name we do not know is refused rather than guessed,
because a wrong split gives plausible but different token ids.

Two tokenizer models are supported:

* ``gpt2``: byte-level BPE. The pre-tokenizer regexes run in sequence, each
  splitting the pieces of the one before (text between matches stays a piece of
  its own, as in llama.cpp), then bytes map to GPT-2's printable alphabet.
* ``llama``: SentencePiece (Llama 2, Mistral v0.1). Spaces become "▁", one is
  prepended to each run of text, merges follow the token scores and unknown
  characters fall back to ``<0xNN>`` byte tokens.

The tokenizer built here never adds BOS by itself: ``TokenizerSpec.add_bos_token``
tells the caller whether to prepend ``bos_token_id``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from backends.config import TokenizerSpec
from backends.errors import ModelLoadError

# llama.cpp's token types (enum llama_token_type / gguf.TokenType).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp spells (?i:'s|...) out as character classes because std::regex
# lacks inline flags; the two are the same pattern.
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the regexes llama.cpp applies, in order.
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    # LLAMA_VOCAB_PRE_TYPE_DEFAULT; also what llama.cpp uses when the key is absent.
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt-2": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "dbrx": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    # Digits one by one, then GPT-2's split (LLAMA_VOCAB_PRE_TYPE_SMOLLM, _STARCODER, _REFACT).
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
}

# llama.cpp sets tokenizer_ignore_merges for these: a word that is itself a
# token is emitted whole without running merges (tokenizer.json: ignore_merges).
_IGNORE_MERGES_PRE = frozenset({"llama3", "llama-v3", "llama-bpe"})


def field_value(fields: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """The decoded value of a GGUF metadata key (str, int, float, bool or list)."""
    field = fields.get(key)
    if field is None:
        return default
    # gguf_file.read_gguf gives plain values; gguf-py's GGUFReader, ReaderFields.
    return field.contents() if hasattr(field, "contents") else field


def build_tokenizer_spec(fields: Mapping[str, Any], source: str = "GGUF file") -> TokenizerSpec:
    """Build the tokenizer and its surroundings from a GGUF file's metadata
    (``GGUFFile.fields``, or gguf-py's ``GGUFReader.fields``).

    ``source`` names the file in error messages. Raises ModelLoadError when the
    metadata lacks a vocabulary or names a tokenizer model / pre-tokenizer this
    module cannot reproduce exactly.
    """
    tokens = field_value(fields, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{source}: no tokenizer vocabulary (tokenizer.ggml.tokens) in the file")
    token_types = field_value(fields, "tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise ModelLoadError(
            f"{source}: {len(token_types)} token types for {len(tokens)} tokens")

    kind = field_value(fields, "tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(fields, tokens, source)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(fields, tokens, token_types, source)
    else:
        raise ModelLoadError(
            f"{source}: tokenizer model {kind!r} not supported (Baton supports 'gpt2' and 'llama')")
    _add_special_tokens(tokenizer, tokens, token_types, source)

    bos_id = _token_id(fields, "tokenizer.ggml.bos_token_id", len(tokens), source)
    eos_id = _token_id(fields, "tokenizer.ggml.eos_token_id", len(tokens), source)
    # llama.cpp adds BOS for SentencePiece vocabularies unless told otherwise.
    add_bos = bool(field_value(fields, "tokenizer.ggml.add_bos_token", kind == "llama"))
    return TokenizerSpec(
        tokenizer=tokenizer,
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        add_bos_token=add_bos and bos_id is not None,
        chat_template=field_value(fields, "tokenizer.chat_template"),
        special_token_ids=frozenset(
            i for i, t in enumerate(token_types) if t == TOKEN_TYPE_CONTROL),
    )


def _token_id(fields: Mapping[str, Any], key: str, vocab_size: int, source: str) -> int | None:
    value = field_value(fields, key)
    if value is None:
        return None
    if not 0 <= int(value) < vocab_size:
        raise ModelLoadError(f"{source}: {key}={value} is outside the vocabulary (size {vocab_size})")
    return int(value)


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    # A few files repeat a token string (padding entries); the first id wins,
    # which is the one llama.cpp's text_to_token finds as well.
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    return vocab


def _byte_level_bpe(fields: Mapping[str, Any], tokens: Sequence[str], source: str) -> Tokenizer:
    pre = field_value(fields, "tokenizer.ggml.pre", "default")
    regexes = PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        raise ModelLoadError(
            f"{source}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) not supported; "
            f"Baton knows: {', '.join(sorted(PRE_TOKENIZER_REGEXES))}")
    merges = []
    for line in field_value(fields, "tokenizer.ggml.merges") or ():
        left, sep, right = line.partition(" ")
        if not sep or not left or not right or " " in right:
            raise ModelLoadError(f"{source}: malformed merge {line!r} in tokenizer.ggml.merges")
        merges.append((left, right))
    if not merges:
        raise ModelLoadError(f"{source}: a 'gpt2' tokenizer needs tokenizer.ggml.merges, found none")

    tokenizer = Tokenizer(models.BPE(
        vocab=_vocab(tokens), merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRE))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(fields: Mapping[str, Any], tokens: Sequence[str],
                       token_types: Sequence[int], source: str) -> Tokenizer:
    scores = field_value(fields, "tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise ModelLoadError(
            f"{source}: a 'llama' tokenizer needs one score per token in tokenizer.ggml.scores")
    vocab = _vocab(tokens)
    unk_id = field_value(fields, "tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    tokenizer = Tokenizer(models.BPE(
        vocab=vocab, merges=_merges_from_scores(tokens, token_types, scores, vocab),
        unk_token=unk, fuse_unk=True, byte_fallback=True))

    # llama.cpp escapes every space to "▁" and, with add_space_prefix (default
    # on), puts one in front of each run of text, including runs that follow a
    # special token; a normalizer runs once per such run, Metaspace would not.
    add_prefix = bool(field_value(fields, "tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    return tokenizer


def _merges_from_scores(tokens: Sequence[str], token_types: Sequence[int],
                        scores: Sequence[float], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """SentencePiece merges best-score first: llama.cpp merges the adjacent pair
    whose concatenation is the highest-scoring normal token, which is BPE with
    merges ranked by that token's score."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for index, token in enumerate(tokens):
        if token_types[index] not in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED) or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[index]), vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _add_special_tokens(tokenizer: Tokenizer, tokens: Sequence[str], token_types: Sequence[int],
                        source: str) -> None:
    """Control tokens (<|im_start|>) become special added tokens, user-defined
    ones plain added tokens, so both are matched whole in text as llama.cpp
    does. Both are already in the vocabulary, so no id is created."""
    before = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_CONTROL and tok])
    tokenizer.add_tokens([
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_USER_DEFINED and tok])
    after = tokenizer.get_vocab_size(with_added_tokens=True)
    if after != before:
        raise ModelLoadError(
            f"{source}: special tokens added {after - before} ids outside the vocabulary")
