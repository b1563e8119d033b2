"""Encoding and decoding text for a loaded model. No torch here."""

from __future__ import annotations

from backends.config import TokenizerSpec


class Tokenizer:
    """A thin, typed face over ``tokenizers.Tokenizer`` plus BOS handling."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self.backend = spec.tokenizer
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(
            token_id for token_id, added in self.backend.get_added_tokens_decoder().items()
            if added.special)
        self._as_text = None  # a copy that reads special-token strings as text
        self._max_chars: int | None = None

    @property
    def special_tokens(self) -> dict[str, int]:
        """Control tokens (added tokens marked special), by their text."""
        return {self.backend.id_to_token(i): i for i in self.special_ids}

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with every special-token string in it split
        into ordinary tokens, never read as the control token; no BOS."""
        if self._as_text is None:
            import tokenizers
            plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._as_text = plain
        return self._as_text.encode_batch([text], add_special_tokens=False)[0].ids

    @property
    def max_chars_per_token(self) -> int:
        """The most input characters one token can stand for: its longest
        vocabulary entry (a byte-level entry is one character per byte, a
        SentencePiece one its own characters), four times that where a
        normalizer may shorten the text first (NFC composes up to three
        characters into one). A text longer than this many times N
        characters holds more than N tokens."""
        if self._max_chars is None:
            vocab = self.backend.get_vocab(with_added_tokens=True)
            longest = max((len(token) for token in vocab), default=1)
            self._max_chars = longest * (4 if self.backend.normalizer is not None else 1)
        return self._max_chars

    @property
    def chat_template(self) -> str | None:
        return self.spec.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With ``add_special_tokens`` the model's BOS is
        put in front when the model wants one (once, even if the tokenizer's
        own post-processor already added it)."""
        # encode_batch releases the GIL while it works (encode does not), so a
        # long text tokenized on a worker thread does not stall the event loop.
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.spec.bos_token_id
        if (add_special_tokens and self.spec.add_bos_token and bos is not None
                and (not ids or ids[0] != bos)):
            ids = [bos, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # decode_batch, like encode_batch, releases the GIL while it works.
        return self.backend.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_bytes_text(self, token_id: int) -> str:
        """The text a single token stands for (for logprob listings)."""
        return self.backend.decode([token_id], skip_special_tokens=False)
