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


def test_header_matches_gguf_py_on_the_embedded_model():
    path = embedded_model_path()
    ours = read_gguf(path)
    theirs = GGUFReader(path)
    assert set(ours.fields) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert ours.fields[key] == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == ref.tensor_type
        assert mine.shape == tuple(int(d) for d in ref.shape)
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        assert np.array_equal(mine.data[:2], ref.data[:2]), mine.name
        assert np.array_equal(mine.data[-1:], ref.data[-1:]), mine.name


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
