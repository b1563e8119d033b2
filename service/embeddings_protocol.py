"""POST /v1/embeddings: OpenAI's request and response shapes, decoded and
validated by msgspec (unknown fields are a 400 naming them, as for every
route; docs/serving.md lists what each field does)."""

from __future__ import annotations

from typing import Literal, Union

import msgspec


class EmbeddingRequest(msgspec.Struct, kw_only=True, omit_defaults=True,
                       forbid_unknown_fields=True):
    # A string, a list of strings, a list of token ids, or a list of token-id
    # lists; msgspec takes one list type per union, so items are checked later.
    input: Union[str, list[Union[str, int, list[int]]]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    # Metadata only: recorded nowhere, changes nothing (as on the other routes).
    user: str | None = None
    # vLLM's: keep only each input's last k tokens (-1: the context length).
    truncate_prompt_tokens: int | None = None
    # vLLM's: BOS (and whatever the tokenizer adds) for text inputs.
    add_special_tokens: bool = True
    # Scheduling priority (lower first; needs --scheduling-policy priority).
    priority: int = 0


class Embedding(msgspec.Struct):
    index: int
    # floats, or with encoding_format "base64" the little-endian float32
    # bytes in base64 (what OpenAI's SDK decodes)
    embedding: Union[list[float], str]
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"
