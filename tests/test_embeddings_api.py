"""POST /v1/embeddings through a live server: the OpenAI SDK's
``embeddings.create`` (float, and base64 as the SDK asks by default),
token-id inputs, ``dimensions`` on a Matryoshka model, errors as 400s naming
the field, a model whose pooling Baton cannot serve, embeddings beside
streaming generations, the request span and metrics."""

from __future__ import annotations

import base64
import json
import shutil
import threading

import numpy as np
import openai
import pytest
import requests
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from service.config import ServerConfig
from telemetry.tracing import setup_tracing
from tests.engine_helpers import make_engine
from tests.server_helpers import running_server
from tests.test_embeddings_engine import COSINE, MODULES, _pooling_file, _reference

TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Paged attention stores keys and values in fixed-size blocks of memory.",
         "Hello"]
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def exporter():
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(tiny_llama_dir, exporter):
    tracing = setup_tracing(exporter=exporter, detail="request")
    core = make_engine(tiny_llama_dir, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32,
                       long_prefill_token_threshold=32)
    with running_server(core, ServerConfig(), tracing=tracing) as srv:
        yield srv
    tracing.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                         timeout=60)


@pytest.fixture(autouse=True)
def ends_idle(request):
    """After every scenario nothing runs, every block is back, every table empty."""
    yield
    for name in ("server", "matryoshka_server"):
        if name in request.fixturenames:
            request.getfixturevalue(name).wait_idle(timeout=10)


def _want(server, folder, texts, pooling="last") -> list[torch.Tensor]:
    tok = server.engine.tokenizer
    prompts = {str(i): tok.encode(t) for i, t in enumerate(texts)}
    ref = _reference(folder, prompts, pooling)
    return [ref[str(i)] for i in range(len(texts))]


def _cosines(data, want) -> list[float]:
    return [float(torch.dot(torch.tensor(d.embedding, dtype=torch.float32), w))
            for d, w in zip(data, want)]


def test_sdk_float_vectors_match_transformers(server, client, tiny_llama_dir):
    res = client.embeddings.create(model=server.state.model_name, input=TEXTS,
                                   encoding_format="float")
    assert res.object == "list" and res.model == server.state.model_name
    assert [d.index for d in res.data] == [0, 1, 2]
    assert all(d.object == "embedding" and len(d.embedding) == 64 for d in res.data)
    tok = server.engine.tokenizer
    n = sum(len(tok.encode(t)) for t in TEXTS)
    assert (res.usage.prompt_tokens, res.usage.total_tokens) == (n, n)
    assert min(_cosines(res.data, _want(server, tiny_llama_dir, TEXTS))) >= COSINE


def test_sdk_default_base64_equals_float(server, client):
    """Without encoding_format the SDK asks for base64 and decodes it
    (little-endian float32); the floats are the same values."""
    floats = client.embeddings.create(model=server.state.model_name, input=TEXTS[0],
                                      encoding_format="float").data[0].embedding
    decoded = client.embeddings.create(model=server.state.model_name,
                                       input=TEXTS[0]).data[0].embedding
    assert list(np.asarray(decoded, dtype=np.float32)) == list(np.float32(floats))
    raw = client.embeddings.create(model=server.state.model_name, input=TEXTS[0],
                                   encoding_format="base64").data[0].embedding
    assert isinstance(raw, str)
    assert np.frombuffer(base64.b64decode(raw), dtype="<f4").tolist() == \
        np.float32(floats).tolist()


def test_token_id_inputs_and_user(server, client, tiny_llama_dir):
    tok = server.engine.tokenizer
    ids = [tok.encode(t) for t in TEXTS[:2]]
    single = client.embeddings.create(model=server.state.model_name, input=ids[0],
                                      encoding_format="float", user="someone")
    many = client.embeddings.create(model=server.state.model_name, input=ids,
                                    encoding_format="float")
    want = _want(server, tiny_llama_dir, TEXTS[:2])
    assert min(_cosines(single.data, want[:1]) + _cosines(many.data, want)) >= COSINE
    assert single.usage.prompt_tokens == len(ids[0])


def test_long_input_spans_chunks_and_truncation(server, tiny_llama_dir):
    """A 120-token input is prefilled in 32-token chunks; a 200-token one is
    a 400 unless truncate_prompt_tokens keeps its last tokens."""
    tok = server.engine.tokenizer
    ids = (tok.encode(" ".join(TEXTS)) * 20)[:200]
    resp = requests.post(f"{server.base_url}/v1/embeddings", json={"input": ids[:120]})
    assert resp.status_code == 200, resp.text
    want = _reference(tiny_llama_dir, {"a": ids[:120]}, "last")["a"]
    assert float(torch.dot(torch.tensor(resp.json()["data"][0]["embedding"]), want)) >= COSINE
    too_long = requests.post(f"{server.base_url}/v1/embeddings", json={"input": ids})
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
    for k, kept in ((100, 100), (-1, MAX_MODEL_LEN)):
        resp = requests.post(f"{server.base_url}/v1/embeddings",
                             json={"input": ids, "truncate_prompt_tokens": k})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] == kept
        want = _reference(tiny_llama_dir, {"a": ids[-kept:]}, "last")["a"]
        got = torch.tensor(resp.json()["data"][0]["embedding"])
        assert float(torch.dot(got, want)) >= COSINE


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": ["a", 5]}, "input"),
    ({"input": [1, 99999]}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "dimensions": 16}, "dimensions"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": "16"}, "dimensions"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "a", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),
    ({"input": "a", "normalize": False}, "normalize"),
    ({"input": "a", "model": "other"}, "model"),
    ({"input": "a", "priority": 3}, "priority"),
    ({}, "input"),
])
def test_errors_name_the_field(server, body, param):
    resp = requests.post(f"{server.base_url}/v1/embeddings", json=body)
    assert resp.status_code == (404 if param == "model" else 400), resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert error["type"] in ("invalid_request_error", "not_found_error")


def test_sdk_errors_are_typed(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=server.state.model_name, input="a", dimensions=8)
    assert info.value.body["param"] == "dimensions"


def test_full_dimensions_are_accepted(server, client):
    res = client.embeddings.create(model=server.state.model_name, input="a", dimensions=64,
                                   encoding_format="float")
    assert len(res.data[0].embedding) == 64


def test_embeddings_beside_streaming_generations(server, client):
    """Streams and embedding batches at once: all finish, and the autouse
    fixture then finds every block back and every table empty."""
    errors: list[BaseException] = []
    texts: list[str] = []

    def stream():
        try:
            chunks = client.chat.completions.create(
                model=server.state.model_name, stream=True, max_tokens=24,
                messages=[{"role": "user", "content": TEXTS[1]}],
                extra_body={"ignore_eos": True})
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks
                                 if c.choices))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def embed():
        try:
            res = client.embeddings.create(model=server.state.model_name,
                                           input=TEXTS * 4, encoding_format="float")
            assert len(res.data) == 12
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=f) for f in (stream, embed, stream, embed, embed)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(texts) == 2 and all(texts)


def test_span_and_metrics(server, client, exporter):
    exporter.clear()
    client.embeddings.create(model=server.state.model_name, input=TEXTS[:2],
                             encoding_format="base64")
    server.wait_idle()
    spans = [s for s in exporter.get_finished_spans()
             if s.name == f"embeddings {server.state.model_name}"]
    assert len(spans) == 1
    attrs = spans[0].attributes
    assert attrs["gen_ai.operation.name"] == "embeddings"
    assert list(attrs["gen_ai.request.encoding_formats"]) == ["base64"]
    assert attrs["gen_ai.embeddings.dimension.count"] == 64
    assert attrs["gen_ai.usage.output_tokens"] == 0
    assert attrs["gen_ai.usage.input_tokens"] > 0
    assert "gen_ai.latency.time_to_first_token" not in attrs
    text = requests.get(f"{server.base_url}/metrics").text
    samples = {(s.name, s.labels.get("gen_ai_operation_name"), s.labels.get("error_type")):
               s.value for family in text_string_to_metric_families(text)
               for s in family.samples}
    # One sample per input, as a completion counts each of its prompts.
    assert samples[("gen_ai_server_request_duration_seconds_count", "embeddings", "")] >= 2
    # Embeddings produce no first token: no TTFT sample under their name.
    assert ("gen_ai_server_time_to_first_token_seconds_count", "embeddings", None) \
        not in samples


# ------------------------------------------------- a Matryoshka, mean-pooled model

@pytest.fixture(scope="module")
def matryoshka_dir(tmp_path_factory, tiny_qwen2_dir):
    out = tmp_path_factory.mktemp("matryoshka") / "model"
    shutil.copytree(tiny_qwen2_dir, out)
    (out / "modules.json").write_text(json.dumps(MODULES))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(_pooling_file("mean_tokens")))
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "matryoshka_dimensions": [16, 32]}))
    return out


@pytest.fixture(scope="module")
def matryoshka_server(matryoshka_dir):
    with running_server(make_engine(matryoshka_dir), ServerConfig()) as srv:
        yield srv


def test_matryoshka_dimensions_cut_and_renormalise(matryoshka_server, matryoshka_dir):
    client = openai.OpenAI(base_url=f"{matryoshka_server.base_url}/v1", api_key="x",
                           max_retries=0)
    name = matryoshka_server.state.model_name
    full = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    want = _want(matryoshka_server, matryoshka_dir, TEXTS, pooling="mean")
    assert min(_cosines(full.data, want)) >= COSINE
    cut = client.embeddings.create(model=name, input=TEXTS, dimensions=16,
                                   encoding_format="float")
    for d, f in zip(cut.data, full.data):
        vector = torch.tensor(d.embedding)
        expected = torch.nn.functional.normalize(torch.tensor(f.embedding[:16]), dim=0)
        assert vector.shape == (16,) and torch.allclose(vector, expected, atol=1e-6)
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=name, input="a", dimensions=20)
    assert info.value.body["param"] == "dimensions" and "16, 32" in info.value.body["message"]


def test_model_whose_pooling_is_unsupported_refuses(tmp_path, tiny_llama_dir):
    folder = tmp_path / "cls"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "modules.json").write_text(json.dumps(MODULES))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(_pooling_file("cls_token")))
    with running_server(make_engine(folder), ServerConfig()) as srv:
        resp = requests.post(f"{srv.base_url}/v1/embeddings", json={"input": "a"})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["param"] == "model" and "pooling_mode_cls_token" in error["message"]
        # It still generates.
        resp = requests.post(f"{srv.base_url}/v1/completions",
                             json={"prompt": "a", "max_tokens": 2})
        assert resp.status_code == 200


def test_a_full_queue_is_a_429_with_retry_after(server, monkeypatch):
    """Embedding inputs queue as generation prompts do: past the waiting
    queue's requests or tokens, 429 queue_full with Retry-After, counted by
    reason."""
    import dataclasses
    engine = server.state.engine
    real = engine.load
    for field, reason in (("num_waiting", "queue_full"),
                          ("num_waiting_tokens", "queue_tokens_full")):
        monkeypatch.setattr(engine, "load",
                            lambda f=field: dataclasses.replace(real(), **{f: 10**9}))
        resp = requests.post(f"{server.base_url}/v1/embeddings", json={"input": TEXTS[:2]})
        assert resp.status_code == 429, resp.text
        assert resp.headers["Retry-After"] == "1"
        assert resp.json()["error"]["code"] == "queue_full"
        metrics = requests.get(f"{server.base_url}/metrics").text
        assert f'reason="{reason}"' in metrics
    monkeypatch.setattr(engine, "load", real)
    assert requests.post(f"{server.base_url}/v1/embeddings",
                         json={"input": TEXTS[:1]}).status_code == 200
