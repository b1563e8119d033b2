"""Embedding requests through the engine: the pooled vectors against
transformers' hidden states (last-token and mean pooling, float32), across
prefill chunks, with prefix-cache hits, through preemption and beside
generation; the pooler's own invariants; the model's pooling config as
sentence-transformers writes it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from backends.config import PoolingConfig
from backends.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError
from backends.interface import PoolingParams, SamplingParams
from backends.loader.hf import load_hf_folder
from backends.loader.pooling_config import read_pooling_config
from backends.pooling import Pooler, PoolSpan
from tests.engine_helpers import assert_all_free, make_engine

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

COSINE = 0.9999
# Lengths on both sides of a 16-token chunk and a 16-token block, and one token.
LENGTHS = (1, 7, 16, 37, 90)


def _prompts(lengths=LENGTHS, seed=0) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {f"p{n}": torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths}


def _reference(folder: Path, prompts: dict[str, list[int]], pooling: str
               ) -> dict[str, torch.Tensor]:
    """transformers' last hidden state (after the final norm), pooled and
    L2-normalised, as sentence-transformers pools a decoder."""
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for rid, ids in prompts.items():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            vector = hidden[-1] if pooling == "last" else hidden.mean(0)
            out[rid] = torch.nn.functional.normalize(vector, dim=-1)
    return out


def embed_all(core, prompts: dict[str, list[int]], pooling: PoolingParams | dict,
              max_steps: int = 2000, outputs: dict | None = None) -> dict[str, torch.Tensor]:
    """Add every prompt as an embedding request and step until all end
    (their final outputs go to ``outputs`` when given); every block must
    come back."""
    for rid, ids in prompts.items():
        p = pooling[rid] if isinstance(pooling, dict) else pooling
        core.add_request(rid, ids, SamplingParams(), pooling=p)
    vectors = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            break
        for out in core.step().outputs:
            if out.request_id not in prompts:
                continue  # a generation beside them
            assert out.finished and out.finish_reason == "stop", out
            assert out.new_token_ids == [] and out.num_output_tokens == 0
            vectors[out.request_id] = torch.tensor(out.embedding)
            if outputs is not None:
                outputs[out.request_id] = out
    assert_all_free(core)
    return vectors


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for rid, vector in want.items():
        assert got[rid].shape == vector.shape, rid
        assert abs(float(got[rid].norm()) - 1.0) < 1e-5, rid
        cosine = float(torch.dot(got[rid], vector))
        assert cosine >= COSINE, (rid, cosine)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_vectors_equal_transformers_pooled_hidden_states(tiny_model_dir, pooling):
    arch, folder = tiny_model_dir
    prompts = _prompts()
    got = embed_all(make_engine(folder), prompts, PoolingParams(pooling))
    _assert_close(got, _reference(folder, prompts, pooling))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_many_chunks_equal_one(tiny_llama_dir, pooling):
    """A 16-token budget prefills a 90-token input over six steps (mean
    pooling adds each chunk's sum); the vectors equal those of one chunk,
    and transformers'."""
    prompts = _prompts()
    whole = embed_all(make_engine(tiny_llama_dir), prompts, PoolingParams(pooling))
    core = make_engine(tiny_llama_dir, max_num_batched_tokens=16,
                       long_prefill_token_threshold=16)
    chunked = embed_all(core, prompts, PoolingParams(pooling))
    _assert_close(chunked, whole)
    _assert_close(chunked, _reference(tiny_llama_dir, prompts, pooling))


def test_sliding_window_family(new_arch_dirs):
    """Mistral with a 6-token window: every input outgrows it."""
    folder = new_arch_dirs("mistral")
    prompts = _prompts((9, 40))
    for pooling in ("last", "mean"):
        core = make_engine(folder, max_num_batched_tokens=16, long_prefill_token_threshold=16)
        _assert_close(embed_all(core, prompts, PoolingParams(pooling)),
                      _reference(folder, prompts, pooling))


def test_last_token_pooling_uses_the_prefix_cache_and_mean_does_not(tiny_llama_dir):
    """A cached prefix skips computing its positions: last-token pooling
    still computes the last one (same vector, cached tokens counted), mean
    pooling needs them all and so never looks the prefix up."""
    core = make_engine(tiny_llama_dir, enable_prefix_caching=True)
    shared = _prompts((64,))["p64"]
    prompts = {"a": shared + [5, 6, 7], "b": shared + [8, 9]}
    want_last = _reference(tiny_llama_dir, prompts, "last")
    want_mean = _reference(tiny_llama_dir, prompts, "mean")
    _assert_close(embed_all(core, {"a": prompts["a"]}, PoolingParams("last")),
                  {"a": want_last["a"]})
    core.add_request("b-last", prompts["b"], SamplingParams(), pooling=PoolingParams("last"))
    core.add_request("b-mean", prompts["b"], SamplingParams(), pooling=PoolingParams("mean"))
    outs = {}
    while core.has_unfinished():
        for out in core.step().outputs:
            outs[out.request_id] = out
    assert outs["b-last"].num_cached_tokens == 64
    assert outs["b-mean"].num_cached_tokens == 0
    assert float(torch.dot(torch.tensor(outs["b-last"].embedding), want_last["b"])) >= COSINE
    assert float(torch.dot(torch.tensor(outs["b-mean"].embedding), want_mean["b"])) >= COSINE
    assert_all_free(core)


def test_preempted_embeddings_recompute_from_the_start(tiny_llama_dir):
    """A pool of 12 blocks (192 tokens), two generations growing from 60 to
    100 tokens each and embedding inputs prefilled in 16-token chunks beside
    them: the embeddings (admitted last) are preempted mid-prefill and
    recomputed; mean pooling restarts its sums, and every vector is right."""
    core = make_engine(tiny_llama_dir, num_kv_blocks=12, max_num_batched_tokens=32,
                       long_prefill_token_threshold=16)
    for i, ids in enumerate(_prompts((60, 61), seed=7).values()):
        core.add_request(f"g{i}", ids, SamplingParams(max_tokens=40, temperature=0.0,
                                                      ignore_eos=True))
    core.step()
    prompts = {f"e{i}": _prompts((40 + i,), seed=i)[f"p{40 + i}"] for i in range(4)}
    pooling = {rid: PoolingParams("last" if i % 2 else "mean")
               for i, rid in enumerate(prompts)}
    finals: dict = {}
    got = embed_all(core, prompts, pooling, outputs=finals)
    preempted = {rid for rid, out in finals.items() if out.num_preemptions}
    assert any(pooling[rid].pooling_type == "mean" for rid in preempted), \
        f"the tiny pool preempted no mean-pooled input mid-prefill ({sorted(preempted)})"
    for rid, p in pooling.items():
        _assert_close({rid: got[rid]},
                      {rid: _reference(tiny_llama_dir, {rid: prompts[rid]},
                                       p.pooling_type)[rid]})


def test_embeddings_beside_generation_leave_tokens_unchanged(tiny_llama_dir):
    """Greedy tokens are the same with embedding requests in the same steps."""
    prompts = _prompts((20, 33))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def generate(core):
        for rid, ids in prompts.items():
            core.add_request(rid, ids, params)
        tokens: dict[str, list[int]] = {}
        vectors = {}
        while core.has_unfinished():
            for out in core.step().outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.embedding is not None:
                    vectors[out.request_id] = torch.tensor(out.embedding)
        assert_all_free(core)
        return tokens, vectors

    alone, _ = generate(make_engine(tiny_llama_dir))
    core = make_engine(tiny_llama_dir, max_num_batched_tokens=24,
                       long_prefill_token_threshold=24)
    embeds = _prompts((50, 9), seed=5)
    for rid, ids in embeds.items():
        core.add_request(f"e-{rid}", ids, SamplingParams(), pooling=PoolingParams("mean"))
    mixed, vectors = generate(core)
    assert {k: v for k, v in mixed.items() if not k.startswith("e-")} == alone
    want = _reference(tiny_llama_dir, embeds, "mean")
    _assert_close({k[2:]: v for k, v in vectors.items()}, want)


def test_dimensions_cut_then_normalise(tiny_llama_dir):
    prompts = _prompts((21,))
    full = embed_all(make_engine(tiny_llama_dir), prompts, PoolingParams("last"))["p21"]
    cut = embed_all(make_engine(tiny_llama_dir), prompts, PoolingParams("last", 16))["p21"]
    want = torch.nn.functional.normalize(full[:16], dim=-1)
    assert cut.shape == (16,) and torch.allclose(cut, want, atol=1e-6)


def test_validation(tiny_llama_dir):
    core = make_engine(tiny_llama_dir, max_model_len=64)
    pooling = PoolingParams("last")
    with pytest.raises(InvalidRequestError) as info:
        core.add_request("a", [], SamplingParams(), pooling=pooling)
    assert info.value.param == "input"
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        core.add_request("a", [1, 9999], SamplingParams(), pooling=pooling)
    # The whole context is the input's: nothing is generated after it.
    core.add_request("fits", list(range(3, 67)), SamplingParams(), pooling=pooling)
    with pytest.raises(ContextLengthExceededError) as info:
        core.add_request("long", list(range(3, 68)), SamplingParams(), pooling=pooling)
    assert info.value.param == "input"
    with pytest.raises(InvalidRequestError) as info:
        core.add_request("wide", [5], SamplingParams(), pooling=PoolingParams("last", 65))
    assert info.value.param == "dimensions"
    with pytest.raises(InvalidRequestError):
        PoolingParams("cls")
    assert core.abort("fits") is not None
    core.step()
    assert_all_free(core)


def test_abort_mid_prefill_frees_everything(tiny_llama_dir):
    core = make_engine(tiny_llama_dir, max_num_batched_tokens=16,
                       long_prefill_token_threshold=16)
    core.add_request("e", _prompts((90,))["p90"], SamplingParams(),
                     pooling=PoolingParams("mean"))
    core.step()
    core.step()
    assert core.backend._pooler.request_ids() == {"e"}
    out = core.abort("e")
    assert out.finished and out.finish_reason == "abort" and out.embedding is None
    core.step()  # tells the backend
    assert_all_free(core)


# ------------------------------------------------------------------ the pooler

def test_pooler_rerun_and_restart_are_idempotent():
    """A chunk run twice (a failed step re-run in halves) is counted once; a
    chunk from position 0 (recompute after preemption) starts over; a gap
    fails the request instead of pooling what is there."""
    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    mean = PoolingParams("mean")
    pooler = Pooler()
    first = PoolSpan("r", mean, 0, 3, 0, False)
    last = PoolSpan("r", mean, 3, 3, 3, True)
    assert pooler.pool(hidden, [first]) == ({}, {})
    assert pooler.pool(hidden, [first]) == ({}, {})
    pooled, failed = pooler.pool(hidden, [last])
    pooled_again, _ = pooler.pool(hidden, [last])
    want = torch.nn.functional.normalize(hidden.mean(0), dim=-1).tolist()
    assert not failed and pooled["r"] == pytest.approx(want) and pooled_again == pooled
    pooler.release(["r"])
    assert pooler.request_ids() == set()
    assert pooler.pool(hidden, [last])[1].keys() == {"r"}  # positions 0-2 never seen
    # Two chunks, then preempted and recomputed in one.
    pooler.pool(hidden, [PoolSpan("s", mean, 0, 3, 3, False)])
    pooler.pool(hidden, [PoolSpan("s", mean, 3, 2, 0, False)])
    pooled, failed = pooler.pool(hidden, [PoolSpan("s", mean, 0, 6, 0, True)])
    assert not failed and pooled["s"] == pytest.approx(want)
    bad = torch.full((2, 2), float("nan"))
    assert "non-finite" in pooler.pool(bad, [PoolSpan("n", PoolingParams(), 0, 2, 0, True)]
                                       )[1]["n"]


# ------------------------------------------------------------- pooling config

def _folder_with(tmp_path: Path, src: Path, files: dict[str, object], config: dict | None = None
                 ) -> Path:
    out = tmp_path / "model"
    shutil.copytree(src, out)
    for name, content in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(content))
    if config:
        raw = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**raw, **config}))
    return out


_ST = "sentence_transformers.models."
MODULES = [{"idx": 0, "name": "0", "path": "", "type": _ST + "Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": _ST + "Pooling"},
           {"idx": 2, "name": "2", "path": "2_Normalize", "type": _ST + "Normalize"}]


def _pooling_file(mode: str) -> dict:
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
             "weightedmean_tokens", "lasttoken")
    return {"word_embedding_dimension": 64, "include_prompt": True,
            **{f"pooling_mode_{m}": m == mode for m in modes}}


def test_generative_folder_pools_last_token(tiny_llama_dir):
    assert load_hf_folder(tiny_llama_dir).pooling == PoolingConfig()


@pytest.mark.parametrize("mode, pooling", [("mean_tokens", "mean"), ("lasttoken", "last")])
def test_sentence_transformers_pooling_is_read(tmp_path, tiny_llama_dir, mode, pooling):
    folder = _folder_with(tmp_path, tiny_llama_dir, {
        "modules.json": MODULES, "1_Pooling/config.json": _pooling_file(mode)},
        {"matryoshka_dimensions": [32, 16, 64]})
    config = load_hf_folder(folder).pooling
    assert (config.pooling_type, config.source, config.unsupported) == (
        pooling, "1_Pooling/config.json", None)
    assert config.matryoshka and config.matryoshka_dimensions == (16, 32, 64)
    # The engine pools as the folder says.
    prompts = _prompts((30,))
    core = make_engine(folder)
    assert core.info.pooling == config and core.info.hidden_size == 64
    _assert_close(embed_all(core, prompts, PoolingParams(core.info.pooling.pooling_type)),
                  _reference(tiny_llama_dir, prompts, pooling))


@pytest.mark.parametrize("files, why", [
    ({"modules.json": MODULES, "1_Pooling/config.json": _pooling_file("cls_token")},
     "pooling_mode_cls_token"),
    ({"modules.json": MODULES + [{"idx": 3, "name": "3", "path": "3_Dense",
                                  "type": _ST + "Dense"}],
      "1_Pooling/config.json": _pooling_file("lasttoken")}, "Dense"),
    ({"modules.json": MODULES[:1]}, "no single Pooling module"),
])
def test_unsupported_pooling_is_recorded_not_fatal(tmp_path, tiny_llama_dir, files, why):
    folder = _folder_with(tmp_path, tiny_llama_dir, files)
    config = read_pooling_config(folder, {})
    assert config.unsupported is not None and why in config.unsupported


def test_broken_pooling_files_fail_the_load(tmp_path, tiny_llama_dir):
    folder = _folder_with(tmp_path, tiny_llama_dir, {"modules.json": MODULES})
    with pytest.raises(ModelLoadError, match="1_Pooling/config.json is missing"):
        load_hf_folder(folder)
    with pytest.raises(ModelLoadError, match="matryoshka_dimensions"):
        read_pooling_config(tmp_path, {"matryoshka_dimensions": [0]})


def test_tensor_parallel_pools_beside_sampled_rows(tiny_llama_dir):
    """Two ranks: a step that samples some rows and pools others keeps every
    row past the last layer on every rank alike (a rank that cut the rows
    would hang the collectives); vectors and tokens equal one rank's."""
    from backends.parallel.config import ParallelConfig
    sharded = make_engine(tiny_llama_dir, max_num_batched_tokens=24,
                          long_prefill_token_threshold=24,
                          parallel=ParallelConfig(tensor_parallel_size=2, pin_cpus=False))
    threads = torch.get_num_threads()
    try:
        prompts = _prompts((9, 40), seed=11)
        for rid, ids in _prompts((12,), seed=12).items():
            sharded.add_request(f"g-{rid}", ids, SamplingParams(max_tokens=8, temperature=0.0,
                                                               ignore_eos=True))
        got = embed_all(sharded, prompts, {"p9": PoolingParams("last"),
                                           "p40": PoolingParams("mean")})
        want = {**_reference(tiny_llama_dir, {"p9": prompts["p9"]}, "last"),
                **_reference(tiny_llama_dir, {"p40": prompts["p40"]}, "mean")}
        _assert_close(got, want)
    finally:
        sharded.backend.shutdown()
        torch.set_num_threads(threads)


def test_a_final_chunk_without_its_vector_fails_alone(tiny_llama_dir):
    """A backend that returns no vector for a finished input (a bug) fails
    that request with an error instead of leaving it running with nothing
    to compute; the other inputs and every block come back."""
    core = make_engine(tiny_llama_dir)
    real = core.backend.execute

    def drop_one(output):
        result = real(output)
        result.pooled.pop("lost", None)
        return result

    core.backend.execute = drop_one
    try:
        prompts = _prompts((7, 12))
        core.add_request("lost", prompts["p7"], SamplingParams(), pooling=PoolingParams())
        core.add_request("kept", prompts["p12"], SamplingParams(), pooling=PoolingParams())
        outs = {}
        for _ in range(10):
            for out in core.step().outputs:
                outs[out.request_id] = out
            if not core.has_unfinished():
                break
        assert outs["lost"].finish_reason == "error" and "no vector" in outs["lost"].error
        assert outs["kept"].finish_reason == "stop" and outs["kept"].embedding is not None
    finally:
        del core.backend.execute
    core.step()
    assert_all_free(core)
