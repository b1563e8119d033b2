"""A GGUF file's header read in one pass: the metadata as plain Python values
and the tensor table, each tensor's data a view of a private memory map.

gguf-py's ``GGUFReader`` builds a numpy object for every element of every
metadata array: about 18 s for SmolLM2's 49,152 tokens and 48,900 merges on
a 2-core VM (minutes for Llama 3's 128k vocabulary). This reads the same
header with ``struct`` and ``numpy.frombuffer`` in a fraction of a second.
It follows the GGUF v2/v3 layout (little-endian; big-endian files, rare,
are refused with a clear error) and keeps gguf-py's conventions where the
loader relies on them: ``shape`` lists dimensions fastest-first, and
``data`` is typed for F32/F16/F64/I* tensors, raw bytes shaped
``[..., bytes_per_row]`` otherwise.
"""

from __future__ import annotations

import mmap
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from backends.errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: scalar code -> struct format; 8 string, 9 array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
            10: "Q", 11: "q", 12: "d"}
_NUMPY = {"B": np.uint8, "b": np.int8, "H": np.uint16, "h": np.int16, "I": np.uint32,
          "i": np.int32, "f": np.float32, "?": np.bool_, "Q": np.uint64, "q": np.int64,
          "d": np.float64}
_STRING, _ARRAY = 8, 9
# Tensor types gguf-py hands out as typed arrays; every other type is bytes.
_TYPED = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass(slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]      # GGUF order: the fastest-varying dimension first
    data: np.ndarray            # typed elements, or bytes with one row per matrix row

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


@dataclass(slots=True)
class GGUFFile:
    path: pathlib.Path
    version: int
    fields: dict[str, Any]          # metadata key -> str, int, float, bool or list
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads GGUF values from ``buf`` at ``pos``; every read is bounds-checked
    by struct (a truncated header raises struct.error)."""

    def __init__(self, buf: mmap.mmap, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        if start + n > len(self.buf):
            raise struct.error("string runs past the end of the file")
        self.pos = start + n
        return self.buf[start:self.pos].decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.take("<IQ")
            if elem in _SCALARS:
                dtype = np.dtype(_NUMPY[_SCALARS[elem]]).newbyteorder("<")
                if self.pos + count * dtype.itemsize > len(self.buf):
                    raise struct.error("array runs past the end of the file")
                array = np.frombuffer(self.buf, dtype, count, self.pos)
                self.pos += count * dtype.itemsize
                return array.tolist()
            if elem == _STRING:
                return [self.string() for _ in range(count)]
            return [self.value(elem) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.take("<" + _SCALARS[kind])[0]


def read_gguf(path: str | pathlib.Path) -> GGUFFile:
    """Parse ``path``'s header and map its tensors. Raises ModelLoadError for
    a missing file, another format, an unsupported version or byte order, or
    a header or tensor that runs past the end of the file."""
    path = pathlib.Path(path)
    if not path.exists():
        raise ModelLoadError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"{path}: not a file")
    try:
        with path.open("rb") as handle:
            # ACCESS_COPY: writable, private pages, so torch.from_numpy takes the
            # views without a warning and nothing can ever write to the file.
            buf = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise ModelLoadError(f"{path}: cannot read the file ({exc})") from exc
    if buf[:4] != MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (starts with {bytes(buf[:4])!r}, "
                             f"expected {MAGIC!r})")
    try:
        return _parse(path, buf)
    except (struct.error, ValueError, UnicodeDecodeError, KeyError) as exc:
        raise ModelLoadError(
            f"{path}: the GGUF file is truncated or corrupt ({type(exc).__name__}: {exc})"
        ) from exc


def _parse(path: pathlib.Path, buf: mmap.mmap) -> GGUFFile:
    cursor = _Cursor(buf, 4)
    (version,) = cursor.take("<I")
    if version not in VERSIONS:
        if version & 0xFFFF == 0:
            raise ModelLoadError(f"{path}: a big-endian GGUF file; Baton reads little-endian "
                                 f"ones (convert it with gguf-py's gguf_convert_endian)")
        raise ModelLoadError(f"{path}: GGUF version {version}; Baton reads versions 2 and 3")
    num_tensors, num_fields = cursor.take("<QQ")
    fields: dict[str, Any] = {}
    for _ in range(num_fields):
        key = cursor.string()
        (kind,) = cursor.take("<I")
        if key in fields:
            raise ValueError(f"duplicate metadata key {key!r}")
        fields[key] = cursor.value(kind)
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        (n_dims,) = cursor.take("<I")
        dims = cursor.take(f"<{n_dims}Q")
        raw_type, offset = cursor.take("<IQ")
        infos.append((name, dims, GGMLQuantizationType(raw_type), offset))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors, names = [], set()
    for name, dims, ggml_type, offset in infos:
        if name in names:
            raise ValueError(f"duplicate tensor {name!r}")
        names.add(name)
        tensors.append(_tensor(buf, data_start + offset, name, dims, ggml_type))
    return GGUFFile(path=path, version=version, fields=fields, tensors=tensors)


def _tensor(buf: mmap.mmap, start: int, name: str, dims: tuple[int, ...],
            ggml_type: GGMLQuantizationType) -> GGUFTensor:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
    if dims and dims[0] % block_size:
        raise ValueError(f"tensor {name!r}: rows of {dims[0]} are not whole "
                         f"{ggml_type.name} blocks of {block_size}")
    n_bytes = n_elements // block_size * type_size
    if start + n_bytes > len(buf):
        raise ValueError(f"tensor {name!r} runs past the end of the file")
    shape = tuple(reversed(dims))
    if ggml_type in _TYPED:
        data = np.frombuffer(buf, _TYPED[ggml_type], n_elements, start).reshape(shape)
    else:
        byte_shape = (*shape[:-1], shape[-1] // block_size * type_size) if shape else (n_bytes,)
        data = np.frombuffer(buf, np.uint8, n_bytes, start).reshape(byte_shape)
    return GGUFTensor(name=name, tensor_type=ggml_type, shape=tuple(int(d) for d in dims),
                      data=data)
