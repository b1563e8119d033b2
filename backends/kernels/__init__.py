"""Native CPU kernels: C sources built on first use and called through ctypes.

The sources sit beside this file and are built once per CPU kind
(backends/execution.py: portable, avx2, avx512, avx512_bf16), each with that
kind's instruction-set flags and never -march=native, so the library a CPU
loads is chosen at run time by what it can do (and a lower kind can be forced
to test its path). The first process that needs a kind compiles it with the
system C compiler (``$CC``, else ``cc``) into a cache folder
(``$BATON_KERNEL_CACHE``, else ``~/.cache/baton/kernels``), named by a hash of
the sources and flags, so later processes load it at once. OpenMP resolves to
the libgomp torch has already loaded, so kernels share torch's thread pool.
ctypes drops the GIL for the length of a call.

Where no compiler is present ``load`` returns None and says why; the
execution plan then chooses the torch ops, with the same numerics.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before any kernel library)

from backends.progress import heartbeat

log = logging.getLogger("baton.kernels")

_SOURCES = [Path(__file__).with_name(name) for name in (
    "paged_attention.c", "fused_ops.c", "gemv_bf16.c", "decode_bf16.c")]
_HEADERS = [Path(__file__).with_name("kernels.h")]
# No -ffast-math: linked with it, GCC adds crtfastmath, whose constructor
# sets flush-to-zero / denormals-are-zero for the whole process the moment the
# library loads. -fno-math-errno only lets sqrtf inline; the vector exp the
# kernels need is their own (kernels.h).
_BASE_FLAGS = ["-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
KIND_FLAGS: dict[str, list[str]] = {
    "portable": [],
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": [*_AVX512, "-mavx512bf16"],
}
_lock = threading.Lock()
_state: dict[str, tuple[ctypes.CDLL | None, str]] = {}

_p = ctypes.c_void_p
_i64 = ctypes.c_int64


def cache_dir() -> Path:
    env = os.environ.get("BATON_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "baton" / "kernels"


def _compile(sources: list[Path], flags: list[str]) -> Path:
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in [*sources, *_HEADERS])
                            + " ".join(flags).encode()
                            + platform.machine().encode()).hexdigest()[:16]
    out_dir = cache_dir()
    target = out_dir / f"baton-kernels-{digest}.so"
    # A library built earlier (or at image build time: python -m
    # backends.kernels) needs no compiler.
    if target.exists():
        return target
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} is not on PATH) and no kernels built "
                           f"for these sources in {out_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("building the native CPU kernels (%s) with %s into %s: once per source "
             "version and CPU kind", " ".join(f for f in flags if f.startswith("-m")) or
             "portable", cc, out_dir)
    # Build beside the target and rename: concurrent processes never load a
    # half-written library.
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        with heartbeat("building the native CPU kernels"):
            proc = subprocess.run([cc, *flags, *map(str, sources), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:500]}")
        os.chmod(tmp, 0o755)  # readable by every user of a shared cache (an image's)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(kind: str) -> ctypes.CDLL:
    if kind not in KIND_FLAGS:
        raise ValueError(f"unknown CPU kind {kind!r}")
    if kind != "portable" and platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the {kind} kernels are x86-64 code")
    try:
        lib = ctypes.CDLL(str(_compile(_SOURCES, [*_BASE_FLAGS, *KIND_FLAGS[kind]])))
    except OSError as exc:
        raise RuntimeError(str(exc)) from exc
    fn = lib.baton_paged_decode_attention_f32
    fn.argtypes = [_p, _p, _p, ctypes.c_int, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64,
                   _i64, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.baton_rms_norm_f32.argtypes = [_p, _p, _p, _p, _i64, _i64, ctypes.c_float, ctypes.c_int]
    lib.baton_silu_mul_f32.argtypes = [_p, _p, _i64, _i64, ctypes.c_int]
    lib.baton_qkv_rope_store_f32.argtypes = [
        _p, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _p, ctypes.c_float, _p, _p, _p,
        ctypes.c_int, _p, ctypes.c_int]
    lib.baton_gemv_bf16.argtypes = [_p, _p, _p, _p, _i64, _i64, _i64, ctypes.c_int]
    lib.baton_gemv_bf16_max_rows.argtypes = []
    lib.baton_decode_bf16.argtypes = [_p, _p, _i64, _p, _p, _p, _i64, _p, _i64, _p, ctypes.c_int]
    lib.baton_decode_bf16_struct_sizes.argtypes = [ctypes.POINTER(_i64), ctypes.POINTER(_i64)]
    lib.baton_kernels_avx2.argtypes = []
    for fn in (lib.baton_rms_norm_f32, lib.baton_silu_mul_f32, lib.baton_qkv_rope_store_f32,
               lib.baton_gemv_bf16, lib.baton_gemv_bf16_max_rows, lib.baton_decode_bf16,
               lib.baton_decode_bf16_struct_sizes, lib.baton_kernels_avx2):
        fn.restype = ctypes.c_int
    return lib


def load_with_reason(kind: str) -> tuple[ctypes.CDLL | None, str]:
    """The kernel library of CPU ``kind``, built if needed, or None and why
    not. The caller checks that this CPU can run ``kind``."""
    with _lock:
        if kind not in _state:
            try:
                _state[kind] = (_load(kind), "")
            except (RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("native CPU kernels (%s) unavailable, using the torch ops: %s",
                            kind, exc)
                _state[kind] = (None, str(exc))
        return _state[kind]  # type: ignore[return-value]


def buildable_kinds() -> list[str]:
    """The CPU kinds this machine's compiler can build (x86-64: all)."""
    x86 = platform.machine() in ("x86_64", "AMD64")
    return [kind for kind in KIND_FLAGS if x86 or kind == "portable"]


def build(kinds: list[str] | None = None) -> dict[str, Path]:
    """Build (or find) the library of each kind, whatever this CPU runs, so
    an image can carry them all and need no compiler: the Dockerfile runs
    ``python -m backends.kernels`` with BATON_KERNEL_CACHE set. Raises
    RuntimeError when a build fails."""
    return {kind: _compile(_SOURCES, [*_BASE_FLAGS, *KIND_FLAGS[kind]])
            for kind in (kinds or buildable_kinds())}


def load(kind: str | None = None) -> ctypes.CDLL | None:
    """The kernel library of ``kind`` (default: this CPU's own), or None."""
    if kind is None:
        from backends.execution import CpuFeatures
        kind = CpuFeatures.detect().kind
    return load_with_reason(kind)[0]


def _kv_bf16(cache: torch.Tensor) -> int:
    if cache.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"native kernels take a float32 or bfloat16 KV cache, not {cache.dtype}")
    return int(cache.dtype == torch.bfloat16)


class PagedDecodeAttention:
    """Callable wrapper: float32 decode attention over the paged pool (the
    pool float32 or bfloat16)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.baton_paged_decode_attention_f32

    @staticmethod
    def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return num_kv_heads >= 1 and num_heads % num_kv_heads == 0

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, ctx_lens: torch.Tensor, max_ctx: int,
                 block_size: int, scale: float) -> torch.Tensor:
        """q [T, H, D] float32 -> [T, H, D]; tables [T, NB] and lens [T] int64."""
        t, h, d = q.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        rc = self._fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _kv_bf16(k_cache),
                      block_tables.data_ptr(), ctx_lens.data_ptr(), out.data_ptr(),
                      t, h, k_cache.shape[1], d, block_tables.shape[1], block_size, max_ctx,
                      scale, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"paged decode attention kernel failed (code {rc})")
        return out


def paged_decode_attention(kind: str | None = None) -> PagedDecodeAttention | None:
    lib = load(kind)
    return None if lib is None else PagedDecodeAttention(lib)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedOps:
    """One native call each for a decoder layer's elementwise steps (CPU,
    float32, contiguous tensors). Same results as the torch formulas up to
    float rounding."""

    MAX_HEAD_DIM = 1024

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = lib.baton_rms_norm_f32
        self._silu_mul = lib.baton_silu_mul_f32
        self._qkv = lib.baton_qkv_rope_store_f32

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual_delta: torch.Tensor | None = None) -> torch.Tensor:
        """rms_norm(x) * weight; with ``residual_delta``, ``x += residual_delta``
        first, in place (x is the residual stream)."""
        out = torch.empty_like(x)
        t, n = x.shape
        self._norm(x.data_ptr(), _ptr(residual_delta), weight.data_ptr(), out.data_ptr(),
                   t, n, eps, torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        t, two_i = gate_up.shape
        out = gate_up.new_empty(t, two_i // 2)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2,
                       torch.get_num_threads())
        return out

    def qkv_rope_store(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                       head_dim: int, positions: torch.Tensor, cos_table: torch.Tensor,
                       sin_table: torch.Tensor, q_norm: torch.Tensor | None,
                       k_norm: torch.Tensor | None, eps: float, slot_mapping: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Rotated q [T, heads, head_dim]; rotated k and v stored in the caches
        (float32, or bfloat16 rounded to nearest even)."""
        t = qkv.shape[0]
        q = qkv.new_empty(t, num_heads, head_dim)
        self._qkv(qkv.data_ptr(), t, num_heads, num_kv_heads, head_dim, positions.data_ptr(),
                  cos_table.data_ptr(), sin_table.data_ptr(), _ptr(q_norm), _ptr(k_norm), eps,
                  slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                  _kv_bf16(k_cache), q.data_ptr(), torch.get_num_threads())
        return q


def fused_ops(kind: str | None = None) -> FusedOps | None:
    lib = load(kind)
    return None if lib is None else FusedOps(lib)


class GemvBf16:
    """y = x @ W^T (+ bias) for up to ``max_rows`` float32 rows and bfloat16
    weights, accumulated in float32. W is passed as ``tile(W)``: the layout
    the kernel streams (rows padded to 8, columns to 16, tile by tile)."""

    TILE_ROWS = 8
    TILE_COLS = 16

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.baton_gemv_bf16
        self.max_rows = lib.baton_gemv_bf16_max_rows()

    @classmethod
    def tile(cls, w: torch.Tensor) -> torch.Tensor:
        """[N, K] -> bfloat16 [N/8, K/16, 8, 16] (padded with zeros)."""
        n, k = w.shape
        r, c = cls.TILE_ROWS, cls.TILE_COLS
        padded = torch.zeros(-(-n // r) * r, -(-k // c) * c, dtype=torch.bfloat16)
        padded[:n, :k] = w.detach().to(torch.bfloat16)
        return padded.view(padded.shape[0] // r, r, padded.shape[1] // c, c).permute(
            0, 2, 1, 3).contiguous()

    def __call__(self, x: torch.Tensor, w_tiled: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        m, k = x.shape
        if w_tiled.shape[1] * self.TILE_COLS != -(-k // self.TILE_COLS) * self.TILE_COLS:
            raise ValueError(f"tiled weight has {w_tiled.shape[1]} column tiles, x has {k} columns")
        x = x.contiguous()
        y = x.new_empty(m, out_features)
        rc = self._fn(x.data_ptr(), w_tiled.data_ptr(), _ptr(bias), y.data_ptr(), m,
                      out_features, k, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"bf16 gemv kernel failed (code {rc}) for {m} rows")
        return y


def gemv_bf16(kind: str | None = None) -> GemvBf16 | None:
    lib = load(kind)
    return None if lib is None else GemvBf16(lib)


class _Layer(ctypes.Structure):
    _fields_ = [(name, _p) for name in (
        "input_norm", "post_norm", "qkv_bias", "q_norm", "k_norm",
        "qkv_w", "o_w", "gate_up_w", "down_w", "k_cache", "v_cache")]


class _Model(ctypes.Structure):
    _fields_ = [*[(name, _i64) for name in (
        "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
        "block_size", "kv_bf16")],
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("cos_table", _p), ("sin_table", _p), ("final_norm", _p), ("layers", _p)]


@dataclass(frozen=True)
class DecodeLayerWeights:
    """One layer's tensors for ``DecodeBf16``: norms and bias float32; caches
    float32 or bfloat16 (all layers alike); matrices tiled bfloat16
    (``GemvBf16.tile``); bias and q/k norms optional."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class DecodeBf16:
    """A whole decode step (every layer and the final norm) in one native call,
    for up to ``max_rows`` single-token rows, bfloat16 weights and float32
    arithmetic (decode_bf16.c). Holds references to every tensor it points at."""

    def __init__(self, lib: ctypes.CDLL, *, hidden: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate: int, block_size: int, eps: float,
                 cos_table: torch.Tensor, sin_table: torch.Tensor, final_norm: torch.Tensor,
                 layers: list[DecodeLayerWeights]) -> None:
        layer_size, model_size = _i64(), _i64()
        lib.baton_decode_bf16_struct_sizes(ctypes.byref(layer_size), ctypes.byref(model_size))
        if (layer_size.value, model_size.value) != (ctypes.sizeof(_Layer), ctypes.sizeof(_Model)):
            raise RuntimeError("decode_bf16.c and its ctypes mirror disagree on struct layout")
        self._fn = lib.baton_decode_bf16
        self.max_rows = lib.baton_gemv_bf16_max_rows()
        self.hidden = hidden
        tensors = [cos_table, sin_table, final_norm]
        for w in layers:
            tensors.extend(t for t in vars(w).values() if t is not None)
        for t in tensors:
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("DecodeBf16 needs contiguous CPU tensors")
        self._keep = (tensors, layers)
        self._layers = (_Layer * len(layers))(*[
            _Layer(input_norm=w.input_norm.data_ptr(), post_norm=w.post_norm.data_ptr(),
                   qkv_bias=_ptr(w.qkv_bias), q_norm=_ptr(w.q_norm), k_norm=_ptr(w.k_norm),
                   qkv_w=w.qkv.data_ptr(), o_w=w.o.data_ptr(), gate_up_w=w.gate_up.data_ptr(),
                   down_w=w.down.data_ptr(), k_cache=w.k_cache.data_ptr(),
                   v_cache=w.v_cache.data_ptr())
            for w in layers])
        self._model = _Model(
            num_layers=len(layers), hidden=hidden, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate=intermediate,
            block_size=block_size, kv_bf16=_kv_bf16(layers[0].k_cache) if layers else 0,
            eps=eps, scale=head_dim ** -0.5,
            cos_table=cos_table.data_ptr(), sin_table=sin_table.data_ptr(),
            final_norm=final_norm.data_ptr(), layers=ctypes.addressof(self._layers))

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, max_ctx: int) -> torch.Tensor:
        """hidden [M, hidden] float32 embeddings (overwritten: the residual
        stream) -> final-normed hidden [M, hidden]. positions, slot_mapping,
        ctx_lens [M] and block_tables [M, NB] int64."""
        m = hidden.shape[0]
        out = torch.empty_like(hidden)
        rc = self._fn(ctypes.byref(self._model), hidden.data_ptr(), m, positions.data_ptr(),
                      slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
                      ctx_lens.data_ptr(), max_ctx, out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"native decode step failed (code {rc}) for {m} rows")
        return out


def decode_bf16(kind: str | None = None, **kwargs) -> DecodeBf16 | None:
    lib = load(kind)
    return None if lib is None else DecodeBf16(lib, **kwargs)
