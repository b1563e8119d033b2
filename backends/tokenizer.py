"""Encoding and decoding text for a loaded model. No torch here."""

from __future__ import annotations

from backends.config import TokenizerSpec


class Tokenizer:
    """A thin, typed face over ``tokenizers.Tokenizer`` plus BOS handling."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self.backend = spec.tokenizer
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self.spec.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With ``add_special_tokens`` the model's BOS is
        put in front when the model wants one (once, even if the tokenizer's
        own post-processor already added it)."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.spec.bos_token_id
        if (add_special_tokens and self.spec.add_bos_token and bos is not None
                and (not ids or ids[0] != bos)):
            ids = [bos, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_bytes_text(self, token_id: int) -> str:
        """The text a single token stands for (for logprob listings)."""
        return self.backend.decode([token_id], skip_special_tokens=False)
