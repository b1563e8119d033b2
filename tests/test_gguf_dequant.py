"""GGUF's header reader and torch dequantization against gguf-py's own: the
same metadata and tensor table, and float32 weights equal bit for bit for
every block type Baton decodes in torch (blocks of random bytes with finite
fp16 scales), so the fast paths change nothing but the time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from backends.errors import ModelLoadError
from backends.loader.embedded import embedded_model_path
from backends.loader.gguf_dequant import TORCH_TYPES, dequantize
from backends.loader.gguf_file import read_gguf

T = GGMLQuantizationType
# Byte offsets of the fp16 scale / minimum fields in one block of each type.
_FP16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2),
                T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(ggml_type: GGMLQuantizationType, rows: int, cols: int,
                  seed: int = 0) -> np.ndarray:
    """Raw bytes [rows, bytes per row] of random blocks whose fp16 fields hold
    finite values of either sign (random bytes there would give NaN / inf)."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in _FP16_FIELDS[ggml_type]:
        values = (rng.standard_normal(data.shape[0]) * 0.01).astype(np.float16)
        data[:, at:at + 2] = values.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, cols // block * size)


@pytest.mark.parametrize("ggml_type", sorted(_FP16_FIELDS, key=lambda t: t.name),
                         ids=lambda t: t.name)
def test_block_types_match_gguf_py_bit_for_bit(ggml_type):
    assert ggml_type in TORCH_TYPES
    rows, cols = 6, 512
    data = random_blocks(ggml_type, rows, cols, seed=int(ggml_type))
    expected = np.asarray(gguf_dequantize(data, ggml_type), dtype=np.float32)
    got = dequantize(data, ggml_type, (rows, cols))
    assert got.dtype == torch.float32 and tuple(got.shape) == (rows, cols)
    assert torch.equal(got, torch.from_numpy(expected.reshape(rows, cols)))


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_types(ggml_type):
    values = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    if ggml_type == T.F32:
        data = values.numpy()
    elif ggml_type == T.F16:
        data = values.to(torch.float16).numpy()
    else:
        data = values.to(torch.bfloat16).view(torch.uint8).numpy()  # gguf-py: bytes
    expected = np.asarray(gguf_dequantize(data, ggml_type), dtype=np.float32).reshape(4, 64)
    got = dequantize(data, ggml_type, (4, 64))
    assert torch.equal(got, torch.from_numpy(expected))
    before = data.copy()
    got.fill_(123.0)  # the result owns its memory: the file's bytes are untouched
    assert np.array_equal(data, before)


def test_other_types_fall_back_on_gguf_py():
    block, size = GGML_QUANT_SIZES[T.Q2_K]
    data = np.random.default_rng(2).integers(0, 256, (3, size), dtype=np.uint8)
    data[:, -4:] = np.array([0.01, -0.02], dtype=np.float16).view(np.uint8)  # d and dmin
    got = dequantize(data, T.Q2_K, (3, block))
    expected = np.asarray(gguf_dequantize(data, T.Q2_K), dtype=np.float32)
    assert torch.equal(got, torch.from_numpy(expected.reshape(3, block)))


def _write_small_gguf(path) -> None:
    """Every metadata value type and tensors of several types, with an
    alignment other than the default."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_name("tiny")
    writer.add_block_count(3)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_float64("test.f64", 1.25)
    writer.add_int8("test.i8", -3)
    writer.add_uint16("test.u16", 65000)
    writer.add_int64("test.i64", -2**40)
    writer.add_bool("test.flag", True)
    writer.add_token_list(["<s>", "a", "é", "🙂", ""] * 200)
    writer.add_token_types([1, 2, 3, 4, 5] * 200)
    writer.add_array("test.floats", [0.5, -1.5])
    writer.add_array("test.bools", [True, False])
    rng = np.random.default_rng(3)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    q8 = random_blocks(T.Q8_0, 4, 64)
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=T.Q8_0)
    q4k = random_blocks(T.Q4_K, 2, 256)
    writer.add_tensor("q4k", q4k, raw_shape=q4k.shape, raw_dtype=T.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_header_and_tensors_match_gguf_py(tmp_path):
    path = tmp_path / "small.gguf"
    _write_small_gguf(path)
    ours = read_gguf(path)
    theirs = GGUFReader(path)
    assert ours.version == 3
    assert set(ours.fields) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert ours.fields[key] == field.contents(), key
    assert ours.fields["tokenizer.ggml.tokens"][:5] == ["<s>", "a", "é", "🙂", ""]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == ref.tensor_type
        assert mine.shape == tuple(int(d) for d in ref.shape)
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        assert np.array_equal(mine.data, ref.data), mine.name
    q4k = next(t for t in ours.tensors if t.name == "q4k")
    assert q4k.torch_shape == (2, 256)


def test_the_embedded_model_reads_as_transformers_reads_it():
    """The vocabulary of the embedded GGUF as transformers' own (independent,
    fast) GGUF reader sees it."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    ours = read_gguf(embedded_model_path())
    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
            "general.architecture", "llama.context_length")
    theirs, _ = read_gguf_metadata(str(embedded_model_path()), keys)
    for key in keys:
        value = theirs[key]
        assert ours.fields[key] == (list(value) if isinstance(value, (list, tuple)) else value)
    assert {t.tensor_type.name for t in ours.tensors} == {"F32", "Q8_0", "Q4_1"}


def test_truncated_and_foreign_files_are_refused(tmp_path):
    data = embedded_model_path().read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        read_gguf(short)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:5000])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        read_gguf(header_only)
    other = tmp_path / "model.gguf"
    other.write_bytes(b"PK\x03\x04" + data[4:100])
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_gguf(other)
    version = tmp_path / "v9.gguf"
    version.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + data[8:200])
    with pytest.raises(ModelLoadError, match="version 9"):
        read_gguf(version)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError):
        read_gguf(empty)
