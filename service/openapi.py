"""GET /openapi.json, generated from the msgspec request and response types."""

from __future__ import annotations

import functools

import msgspec

from service import messages_protocol as m
from service import embeddings_protocol as e
from service import protocol as p
from service import responses_protocol as r

_JSON = "application/json"

# (method, path, summary, request type, response type)
_ROUTES = [
    ("post", "/v1/completions", "Create a text completion (stream=true for SSE)",
     p.CompletionRequest, p.CompletionResponse),
    ("post", "/v1/chat/completions", "Create a chat completion (stream=true for SSE)",
     p.ChatCompletionRequest, p.ChatCompletionResponse),
    ("post", "/v1/embeddings", "Embed strings or token ids (pooled, L2-normalised)",
     e.EmbeddingRequest, e.EmbeddingResponse),
    ("get", "/v1/models", "List the served model", None, p.ModelList),
    ("get", "/v1/models/{model}", "The served model's card (404 for another id)", None,
     p.ModelCard),
    ("post", "/tokenize", "Text or messages to token ids", p.TokenizeRequest,
     p.TokenizeResponse),
    ("post", "/detokenize", "Token ids to text", p.DetokenizeRequest, p.DetokenizeResponse),
    ("get", "/tokenizer_info", "The tokenizer's settings (as vLLM's)", None,
     p.TokenizerInfoResponse),
    ("get", "/version", "Baton's version", None, p.VersionResponse),
    ("post", "/v1/responses", "Create a response (OpenAI Responses API; stream=true for its "
     "typed events)", r.ResponsesRequest, r.Response),
    ("get", "/v1/responses/{response_id}", "A stored response (404 once deleted or expired)",
     None, r.Response),
    ("delete", "/v1/responses/{response_id}", "Delete a stored response", None,
     r.DeletedResponse),
    ("post", "/v1/messages", "Create a message (Anthropic Messages API; stream=true for its "
     "events; errors in Anthropic's envelope)", m.MessagesRequest, m.MessageOut),
]
_STREAM_CHUNKS = {"/v1/completions": p.CompletionChunk,
                  "/v1/chat/completions": p.ChatCompletionChunk,
                  "/v1/responses": r.ResponseEvent, "/v1/messages": m.StreamEvent}
_NAMED_EVENTS = {"/v1/responses", "/v1/messages"}


def _event_stream(path: str, chunk) -> dict:
    """With stream=true the body is text: server-sent events, not one JSON
    document; each event's data is a chunk (its schema is in components)."""
    name = chunk.__name__
    if path in _NAMED_EVENTS:
        kinds = ", ".join(f"#/components/schemas/{e.__name__}" for e in chunk.__subclasses__())
        return {"type": "string",
                "description": f"Server-sent events (stream=true). Each event is a line "
                              f"`event: <type>`, a line `data: <the event as JSON>` (one of "
                              f"{kinds}; its `type` is the event's) and a blank line; the "
                              f"last event ends the stream."}
    return {"type": "string",
            "description": f"Server-sent events (stream=true). Each event is a line "
                          f"`data: <{name} as JSON>` (#/components/schemas/{name}) and a "
                          f"blank line; an error after the stream began is sent as "
                          f"`data: <ErrorResponse as JSON>`; the stream ends with "
                          f"`data: [DONE]`."}


@functools.lru_cache(maxsize=2)
def openapi_document(version: str) -> bytes:
    types = [t for _, _, _, req, resp in _ROUTES for t in (req, resp) if t is not None]
    types += [p.ErrorResponse, m.ErrorEvent, p.CompletionChunk, p.ChatCompletionChunk,
              *r.ResponseEvent.__subclasses__(), *m.StreamEvent.__subclasses__()]
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}")
    refs = dict(zip(types, schemas))
    error = {"description": "an error in OpenAI's envelope",
             "content": {_JSON: {"schema": refs[p.ErrorResponse]}}}
    anthropic_error = {"description": "an error in Anthropic's envelope",
                       "content": {_JSON: {"schema": refs[m.ErrorEvent]}}}
    paths: dict = {}
    for method, path, summary, req, resp in _ROUTES:
        content = {_JSON: {"schema": refs[resp]}}
        if path in _STREAM_CHUNKS:
            content["text/event-stream"] = {"schema": _event_stream(path, _STREAM_CHUNKS[path])}
        op = {"summary": summary,
              "responses": {"200": {"description": "success", "content": content},
                            "default": anthropic_error if path == "/v1/messages" else error}}
        for name in ("model", "response_id"):
            if "{" + name + "}" in path:
                op["parameters"] = [{"name": name, "in": "path", "required": True,
                                     "schema": {"type": "string"}}]
        if req is not None:
            op["requestBody"] = {"required": True,
                                 "content": {_JSON: {"schema": refs[req]}}}
        paths.setdefault(path, {})[method] = op
    paths["/health"] = {"get": {"summary": "200 while the engine loop makes progress",
                                "responses": {"200": {"description": "healthy"},
                                              "503": {"description": "loading, draining "
                                                                     "or stalled"}}}}
    doc = {"openapi": "3.1.0",
           "info": {"title": "Baton", "version": version,
                    "description": "OpenAI-compatible LLM inference server"},
           "paths": paths, "components": {"schemas": components}}
    return msgspec.json.encode(doc)
