"""The GGUF conversion cache (backends/loader/conversion_cache.py): a second
load reads the conversion back instead of converting, and what it reads is
the same model (weights bit for bit, config, tokenizer, generation defaults,
greedy tokens); a changed, damaged or half-written entry is a miss, never an
error; `--conversion-cache` reaches the loader and `none` turns it off."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest
import torch

import backends.loader.gguf as gguf_loader
from backends.interface import SamplingParams
from backends.loader import conversion_cache, load_model
from service.cli import build_parser, engine_args_from
from tests.engine_helpers import make_engine, run_all
from tests.test_gguf_loader import MIXED_TEXT, random_weights, write_gguf

TEXTS = (MIXED_TEXT, "abc ab a <|endoftext|> <think>")


@pytest.fixture
def tiny_file(tmp_path) -> pathlib.Path:
    path = tmp_path / "tiny.Q8_0.gguf"
    arrays = random_weights(tied=False, seed=3)
    write_gguf(path, "llama", arrays, pre="llama-bpe",
               quantized=[n for n in arrays if n.endswith(("attn_q.weight", "ffn_up.weight"))])
    return path


def _entries(cache: pathlib.Path) -> list[pathlib.Path]:
    return [p for p in cache.iterdir() if p.name != "sources"]


def _forbid_converting(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF was converted again instead of read from the cache")
    monkeypatch.setattr(gguf_loader, "load_gguf", refuse)


def _assert_same_model(got, want) -> None:
    assert got.config == want.config
    assert got.generation == want.generation
    assert got.source == want.source and got.source_formats == want.source_formats
    assert got.source_formats  # the Q8_0 tensors say what the file stored
    assert sorted(got.weights) == sorted(want.weights)
    for name, weight in want.weights.items():
        assert got.weights[name].dtype == weight.dtype, name
        assert torch.equal(got.weights[name], weight), name
    for field in ("bos_token", "eos_token", "bos_token_id", "eos_token_id", "add_bos_token",
                  "chat_template", "special_token_ids"):
        assert getattr(got.tokenizer, field) == getattr(want.tokenizer, field), field
    for text in TEXTS:
        assert (got.tokenizer.tokenizer.encode(text).ids
                == want.tokenizer.tokenizer.encode(text).ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_second_load_reads_the_same_model_back(tiny_file, tmp_path, monkeypatch, dtype):
    cache = tmp_path / "cache"
    reference = load_model(tiny_file, dtype=dtype)
    first = load_model(tiny_file, dtype=dtype, conversion_cache=cache)
    entries = _entries(cache)
    assert len(entries) == 1 and not [p for p in entries if ".tmp-" in p.name]
    _forbid_converting(monkeypatch)
    second = load_model(tiny_file, dtype=dtype, conversion_cache=cache)
    _assert_same_model(first, reference)
    _assert_same_model(second, reference)


def test_engine_from_the_cache_generates_the_same_tokens(tiny_file, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    prompts = {"a": [258, 97, 98, 99, 10, 32], "b": [258, 256, 257, 97]}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    direct = run_all(make_engine(tiny_file), prompts, params)
    make_engine(tiny_file, conversion_cache=cache)  # writes the entry
    _forbid_converting(monkeypatch)
    cached = run_all(make_engine(tiny_file, conversion_cache=cache), prompts, params)
    for rid in prompts:
        assert cached[rid].token_ids == direct[rid].token_ids
        assert cached[rid].logprobs == direct[rid].logprobs


def test_a_changed_file_is_converted_again(tiny_file, tmp_path):
    cache = tmp_path / "cache"
    load_model(tiny_file, conversion_cache=cache)
    arrays = random_weights(tied=False, seed=4)  # new weights, same shapes
    write_gguf(tiny_file, "llama", arrays, pre="llama-bpe")
    stat = tiny_file.stat()
    os.utime(tiny_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    again = load_model(tiny_file, conversion_cache=cache)
    assert np.array_equal(again.weights["model.embed_tokens.weight"].numpy(),
                          arrays["token_embd.weight"])
    assert len(_entries(cache)) == 1  # the entry was replaced, not joined by another


def test_other_dtype_is_another_entry(tiny_file, tmp_path):
    cache = tmp_path / "cache"
    load_model(tiny_file, dtype=torch.float32, conversion_cache=cache)
    load_model(tiny_file, dtype=torch.bfloat16, conversion_cache=cache)
    assert sorted(p.name.rsplit("-", 1)[1] for p in _entries(cache)) == ["bfloat16", "float32"]


@pytest.mark.parametrize("damage", ["truncate weights", "garbage manifest", "other weights id",
                                    "no tokenizer"])
def test_a_damaged_entry_is_a_miss_and_is_rewritten(tiny_file, tmp_path, damage):
    cache = tmp_path / "cache"
    reference = load_model(tiny_file, conversion_cache=cache)
    entry = conversion_cache.entry_dir(cache, tiny_file, torch.float32)
    weights = entry / "weights.safetensors"
    if damage == "truncate weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "garbage manifest":
        (entry / "manifest.json").write_text("{not json")
    elif damage == "other weights id":  # a second writer's weights under the first manifest
        manifest = (entry / "manifest.json").read_text()
        weights_id = conversion_cache.msgspec.json.decode(manifest)["weights_id"]
        (entry / "manifest.json").write_text(manifest.replace(weights_id, "0" * 32))
    else:
        (entry / "tokenizer.json").unlink()
    assert conversion_cache.load_cached(cache, tiny_file, torch.float32) is None
    _assert_same_model(load_model(tiny_file, conversion_cache=cache), reference)
    assert conversion_cache.load_cached(cache, tiny_file, torch.float32) is not None


def test_an_unwritable_cache_still_loads(tiny_file, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would go")
    loaded = load_model(tiny_file, conversion_cache=blocker)
    _assert_same_model(loaded, load_model(tiny_file))


def test_too_large_a_conversion_is_not_cached(tiny_file, tmp_path, monkeypatch):
    monkeypatch.setattr(conversion_cache, "MAX_ENTRY_BYTES", 1000)
    cache = tmp_path / "cache"
    load_model(tiny_file, conversion_cache=cache)
    assert not cache.exists() or not _entries(cache)


def test_the_flag_reaches_the_engine_args(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("BATON_CONVERSION_CACHE", raising=False)
    default = engine_args_from(build_parser().parse_args(["serve"]))
    assert default.conversion_cache == str(tmp_path / "baton" / "converted")
    off = engine_args_from(build_parser().parse_args(["serve", "--conversion-cache", "none"]))
    assert off.conversion_cache is None
    there = engine_args_from(build_parser().parse_args(
        ["serve", "--conversion-cache", str(tmp_path / "x")]))
    assert there.conversion_cache == str(tmp_path / "x")
    monkeypatch.setenv("BATON_CONVERSION_CACHE", "off")
    assert engine_args_from(build_parser().parse_args(["serve"])).conversion_cache is None


# ---------------------------------------- entries check themselves; keyed by content

@pytest.mark.parametrize("damage", ["flipped weight byte", "flipped tokenizer byte",
                                    "truncated weights", "empty weights"])
def test_an_entry_that_fails_its_digest_is_converted_again(tiny_file, tmp_path, damage,
                                                            caplog):
    """Before: flipped bytes in the weights were read as they were (the
    embedded model served every answer as "", /health 200)."""
    cache = tmp_path / "cache"
    reference = load_model(tiny_file, conversion_cache=cache)
    entry = conversion_cache.entry_dir(cache, tiny_file, torch.float32)
    name = "tokenizer.json" if "tokenizer" in damage else "weights.safetensors"
    data = (entry / name).read_bytes()
    if damage.startswith("flipped"):
        at = len(data) - 7  # in the last tensor's data, or the tokenizer's text
        (entry / name).write_bytes(data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:])
    else:
        (entry / name).write_bytes(data[:len(data) // 2] if "truncated" in damage else b"")
    with caplog.at_level("WARNING", logger="baton.loader"):
        assert conversion_cache.load_cached(cache, tiny_file, torch.float32) is None
    assert "fails its digest check" in caplog.text and name in caplog.text
    _assert_same_model(load_model(tiny_file, conversion_cache=cache), reference)
    assert conversion_cache.load_cached(cache, tiny_file, torch.float32) is not None


def test_a_second_copy_of_the_file_finds_the_first_ones_entry(tiny_file, tmp_path,
                                                             monkeypatch):
    """Before: the key held the GGUF's path, so every clone (every
    environment with its own copy of the embedded model) converted again."""
    cache = tmp_path / "cache"
    load_model(tiny_file, conversion_cache=cache)
    elsewhere = tmp_path / "another-clone" / tiny_file.name
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(tiny_file.read_bytes())
    reference = load_model(elsewhere)
    _forbid_converting(monkeypatch)
    _assert_same_model(load_model(elsewhere, conversion_cache=cache), reference)
    assert len(_entries(cache)) == 1


def test_an_unchanged_file_is_hashed_once(tiny_file, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    load_model(tiny_file, conversion_cache=cache)
    hashed = []
    real = conversion_cache.chunk_digests
    monkeypatch.setattr(conversion_cache, "chunk_digests",
                        lambda path: hashed.append(path.name) or real(path))
    assert conversion_cache.load_cached(cache, tiny_file, torch.float32) is not None
    assert tiny_file.name not in hashed  # its digest is remembered for its path and stamp
    assert sorted(hashed) == ["tokenizer.json", "weights.safetensors"]  # the entry's are checked
