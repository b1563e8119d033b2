"""Baton's native CPU kernels, as torch operators (``torch.ops.baton.*``).

One library holds every CPU kind's build of the C kernels beside this file
(backends/execution.py: portable, avx2, avx512, avx512_bf16; each compiled
with that kind's instruction-set flags, never -march=native, its names
suffixed with the kind) and ``ops.cpp``, which registers the operators with
torch's dispatcher and calls the kind each call names (the execution plan's
choice; a kind this CPU cannot run is refused, not attempted).

When it is built: by ``scripts/setup.sh`` (the install step), else on first
use by the first process that needs it (a progress line in the log says so;
about a minute on two cores, most of it compiling ops.cpp against torch's
headers), or ahead of time with
``baton build-kernels`` or ``python -m backends.kernels`` (the Docker image's
build stage does that; its runtime stage has no compiler). It is kept in
``$BATON_KERNEL_CACHE`` (default ``~/.cache/baton/kernels``) under a hash of
the sources, flags and torch version (not where torch or the checkout lie: a
second clone finds the first one's library), so later processes load it at
once; a library found there needs no compiler. Beside it lies its SHA-256,
checked before it is loaded: a truncated, altered or empty library (which
crashed every start with SIGBUS or SIGSEGV, or silently meant the torch ops)
is built again, and the log says why. Building it needs a C and a C++
compiler (``$CC``/``cc``, ``$CXX``/``c++``); without them ``load`` returns
None and says why, and the execution plan chooses the torch ops. OpenMP resolves to the libgomp torch has already
loaded, so kernels share torch's thread pool.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from backends.execution import GEMV_ROWS
from backends.progress import heartbeat

log = logging.getLogger("baton.kernels")

_HERE = Path(__file__).parent
_C_SOURCES = [_HERE / name for name in (
    "paged_attention.c", "fused_ops.c", "bf16_ops.c", "gemv_bf16.c", "amx_bf16.c",
    "int4_linear.c")]
_HEADERS = [_HERE / "kernels.h"]
_CPP_SOURCE = _HERE / "ops.cpp"

# Kinds in the order ops.cpp numbers them (backends.execution.CPU_KINDS).
KINDS = ("portable", "avx2", "avx512", "avx512_bf16")
# No -ffast-math: linked with it, GCC adds crtfastmath, whose constructor
# sets flush-to-zero / denormals-are-zero for the whole process the moment the
# library loads. -fno-math-errno only lets sqrtf inline; the vector exp the
# kernels need is their own (kernels.h).
_C_FLAGS = ["-O3", "-fno-math-errno", "-fopenmp", "-fPIC"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
KIND_FLAGS: dict[str, list[str]] = {
    "portable": [],
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": [*_AVX512, "-mavx512bf16"],
}

_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_dir() -> Path:
    env = os.environ.get("BATON_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "baton" / "kernels"


def _x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def _kinds_built() -> tuple[str, ...]:
    """The kinds the library holds: those this CPU runs (portable and up to
    its own; code this CPU cannot execute is neither built nor shipped
    untested), or every x86 kind with BATON_KERNEL_KINDS=all (an image built
    on one machine for others)."""
    if not _x86():
        return ("portable",)
    if os.environ.get("BATON_KERNEL_KINDS", "").strip().lower() == "all":
        return KINDS
    from backends.execution import CpuFeatures
    return CpuFeatures.detect(capped=False).kinds


def _compilers() -> tuple[str, str]:
    cc = os.environ.get("CC") or "cc"
    cxx = os.environ.get("CXX") or "c++"
    for tool, what in ((cc, "C"), (cxx, "C++")):
        if shutil.which(tool) is None:
            raise RuntimeError(f"no {what} compiler ({tool!r} is not on PATH)")
    return cc, cxx


def torch_include_paths() -> list[str]:
    """torch.utils.cpp_extension.include_paths() for CPU code, without
    importing cpp_extension (and setuptools with it) at every start only to
    compute the library's cache key (0.06 s on a quiet 2-core VM, 0.3 s on a
    busy one).
    tests/test_cpu_kernels.py checks the two agree."""
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    return [include, os.path.join(include, "torch", "csrc", "api", "include")]


def _torch_flags() -> tuple[list[str], list[str]]:
    """Compile and link flags for code that includes torch's headers."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = ["-O2", "-std=c++17", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                     "-w", *(f"-I{p}" for p in torch_include_paths())]
    compile_flags += [f"-DBATON_HAS_{kind.upper()}" for kind in _kinds_built()]
    link_flags = [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}", "-ltorch_cpu", "-lc10"]
    return compile_flags, link_flags


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed: {proc.stderr.strip()[-800:]}")


def library_path() -> Path:
    """Where the library for these sources, flags and torch lives (built or
    not). The compilers are not part of the key: a library built elsewhere
    (the Docker image's build stage) loads where none is installed. Nor is
    where torch is installed: the flags name its folder, the key does not."""
    compile_flags, link_flags = _torch_flags()
    torch_dir = os.path.dirname(torch.__file__)
    digest = hashlib.sha256()
    for path in [*_C_SOURCES, *_HEADERS, _CPP_SOURCE]:
        digest.update(path.read_bytes())
    for part in (" ".join(_C_FLAGS), repr(KIND_FLAGS), " ".join(compile_flags),
                 " ".join(link_flags), torch.__version__, platform.machine()):
        digest.update(part.replace(torch_dir, "<torch>").encode())
    return cache_dir() / f"baton-kernels-{digest.hexdigest()[:16]}.so"


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _damage(library: Path) -> str | None:
    """Why the cached library must not be loaded (its SHA-256 is missing or
    differs from the one written when it was built), or None."""
    try:
        expected = _digest_path(library).read_text().strip()
    except OSError:
        return "it has no digest beside it"
    actual = _file_digest(library)
    if actual != expected:
        return (f"its SHA-256 is {actual[:16]}..., not the {expected[:16]}... it was built "
                f"with ({library.stat().st_size} bytes: truncated or altered)")
    return None


def build() -> Path:
    """Build the library unless it is cached; returns its path. Raises
    RuntimeError when a compiler is missing or fails."""
    target = library_path()
    if target.exists():
        damage = _damage(target)
        if damage is None:
            return target
        log.warning("the cached native CPU kernel library %s is not used: %s; building it "
                    "again", target, damage)
    cc, cxx = _compilers()
    compile_flags, link_flags = _torch_flags()
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the native CPU kernels for %s into %s (once per source version)",
             ", ".join(_kinds_built()), target.parent)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp, \
            heartbeat("building the native CPU kernels", done_line=False):
        jobs = [[cxx, *compile_flags, "-c", str(_CPP_SOURCE), "-o", f"{tmp}/ops.o"]]
        for kind in _kinds_built():
            for src in _C_SOURCES:
                jobs.append([cc, *_C_FLAGS, *KIND_FLAGS[kind], f"-DBATON_KIND={kind}", "-c",
                             str(src), "-o", f"{tmp}/{src.stem}-{kind}.o"])
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            list(pool.map(_run, jobs))
        objects = sorted(str(p) for p in Path(tmp).glob("*.o"))
        # Link beside the target and rename: concurrent processes never load
        # a half-written library.
        _run([cxx, "-shared", "-fopenmp", *objects, "-o", f"{tmp}/lib.so", *link_flags, "-lm"])
        os.chmod(f"{tmp}/lib.so", 0o755)  # readable by every user of a shared cache (an image's)
        Path(f"{tmp}/lib.sha256").write_text(_file_digest(Path(f"{tmp}/lib.so")) + "\n")
        os.chmod(f"{tmp}/lib.sha256", 0o644)
        os.replace(f"{tmp}/lib.sha256", _digest_path(target))
        os.replace(f"{tmp}/lib.so", target)
    log.info("built the native CPU kernels in %.0f s", time.perf_counter() - start)
    return target


def load() -> tuple[Path | None, str]:
    """The kernel library, built if needed and loaded into torch (its
    operators registered), or None and why not. Loads once per process."""
    with _lock:
        if "result" not in _state:
            try:
                path = build()
                torch.ops.load_library(str(path))
                _register_fakes()
                _follow_the_cap()
                _state["result"] = (path, "")
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                log.warning("native CPU kernels unavailable, using the torch ops: %s", exc)
                _state["result"] = (None, str(exc))
        return _state["result"]  # type: ignore[return-value]


def _follow_the_cap() -> None:
    """A process capped below AMX (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``:
    ``CpuFeatures.detect``) plans no tiles; its decode attention, which
    chooses AMX scores at run time, keeps them off the tiles too, as an
    AVX512_BF16 CPU without AMX runs it."""
    from backends.execution import CpuFeatures
    k = kind_id("avx512_bf16")
    if "avx512_bf16" in _kinds_built() and torch.ops.baton.kind_runs(k) \
            and not CpuFeatures.detect().amx_bf16:
        torch.ops.baton.attention_amx(k, 0)


def loaded() -> bool:
    """Whether the library is loaded in this process (without loading it)."""
    result = _state.get("result")
    return result is not None and result[0] is not None


def available(kind: str) -> tuple[bool, str]:
    """Whether ``kind``'s kernels can run here: the library loads, holds the
    kind and this CPU runs it. With the reason when not."""
    path, reason = load()
    if path is None:
        return False, reason
    if kind not in _kinds_built():
        return False, (f"the kernel library holds no {kind} build (built for "
                       f"{', '.join(_kinds_built())})")
    if not torch.ops.baton.kind_runs(kind_id(kind)):
        return False, f"this CPU cannot run the {kind} kernels"
    return True, ""


def kind_id(kind: str) -> int:
    """The number ops.cpp knows ``kind`` by (the operators' last argument)."""
    return KINDS.index(kind)


def _register_fakes() -> None:
    """Shapes and dtypes of each operator's result without running it, for
    torch.compile and meta tensors."""
    fake = torch.library.register_fake

    @fake("baton::rms_norm")
    def _rms_norm(residual, delta, weight, eps, kind):
        return torch.empty_like(residual)

    @fake("baton::silu_mul")
    def _silu_mul(gate_up, kind):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @fake("baton::qkv_rope_store")
    def _qkv(qkv, num_heads, num_kv_heads, head_dim, positions, cos_table, sin_table, q_norm,
             k_norm, eps, slot_mapping, k_cache, v_cache, kind):
        return qkv.new_empty(qkv.shape[0], num_heads, head_dim)

    @fake("baton::paged_decode_attention")
    def _attention(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, block_size,
                   scale, kind):
        return torch.empty_like(q)

    @fake("baton::paged_decode_attention_lse")
    def _attention_lse(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, block_size,
                       scale, kind):
        return torch.empty_like(q), q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)

    @fake("baton::gemv_bf16")
    def _gemv(x, w_tiled, out_features, bias, kind):
        return x.new_empty(x.shape[0], out_features)

    @fake("baton::linear_amx")
    def _linear_amx(x, w_tiled, out_features, bias, kind):
        return x.new_empty(x.shape[0], out_features)

    @fake("baton::packed_linear")
    def _packed_linear(x, packed, bias, out_features):
        return x.new_empty(*x.shape[:-1], out_features)

    @fake("baton::int4_linear")
    def _int4_linear(x, codes, scales, mins, bias, group, kind, q8=False):
        return x.new_empty(x.shape[0], codes.shape[0])

    @fake("baton::int8_linear_q8")
    def _int8_linear_q8(x, codes, scales, bias, kind):
        return x.new_empty(x.shape[0], codes.shape[0])

    @fake("baton::linear_tiled")
    def _linear_tiled(x, w_tiled, packed, weight, bias, out_features, gemv_rows, amx_rows, kind):
        return x.new_empty(x.shape[0], out_features)


class GemvBf16:
    """y = x @ W^T (+ bias) for up to ``max_rows`` rows and bfloat16 weights,
    accumulated in float32 (``torch.ops.baton.gemv_bf16``). x float32: y
    float32; x bfloat16: y rounded to bfloat16 (the avx512_bf16 build
    multiplies with VDPBF16PS). W is passed as ``tile(W)``: the layout the
    kernel streams (kernels.h), which the AMX tile linear reads too."""

    TILE_ROWS = 16
    TILE_COLS = 32
    max_rows = GEMV_ROWS  # BATON_GEMV_MAX_ROWS

    def __init__(self, kind: str) -> None:
        self.kind = kind_id(kind)

    @classmethod
    def tile(cls, w: torch.Tensor) -> torch.Tensor:
        """[N, K] -> bfloat16 [N/16, K/32, 16, 32] (padded with zeros): blocks
        of 16 features by 32 columns, each block [16 column pairs][16
        features][2 values] (a feature's two values of a pair side by side, the
        16 features' pairs in one 64-byte line: AMX's B operand as stored)."""
        n, k = w.shape
        r, c = cls.TILE_ROWS, cls.TILE_COLS
        w = w.detach().to(torch.bfloat16)
        if n % r or k % c:
            padded = torch.zeros(-(-n // r) * r, -(-k // c) * c, dtype=torch.bfloat16)
            padded[:n, :k] = w
            w = padded
        w = w.contiguous()
        rows, cols = w.shape
        # Moved as 32-bit words (a column pair each): [N/16, 16 f, K/32, 16 p]
        # -> [N/16, K/32, 16 p, 16 f].
        words = w.view(torch.int32).view(rows // r, r, cols // c, c // 2)
        return words.permute(0, 2, 3, 1).contiguous().view(torch.bfloat16).view(
            rows // r, cols // c, c // 2, 2 * r)

    def __call__(self, x: torch.Tensor, w_tiled: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.baton.gemv_bf16(x.contiguous(), w_tiled, out_features, bias, self.kind)


def amx_ready(kind: str) -> tuple[bool, str]:
    """Whether ``kind``'s kernels have the AMX tile linear here: only the
    avx512_bf16 build has it, and it needs AMX-BF16 and the OS's leave to use
    tile data (Linux grants it per process on request). With the reason when
    not."""
    ok, reason = available(kind)
    if not ok:
        return False, reason
    if not torch.ops.baton.amx_ready(kind_id(kind)):
        return False, (f"the {kind} kernels have no AMX tile linear" if kind != "avx512_bf16"
                       else "this CPU or OS gives no AMX-BF16 tile data")
    return True, ""


def attention_amx(kind: str, mode: int = -1) -> bool:
    """Whether ``kind``'s decode attention takes its bf16 scores (bf16 query
    and cache) on AMX tiles: only the avx512_bf16 build can, where amx_ready
    says so. mode 1 lets it (the default), 0 keeps them on VDPBF16PS (what
    an AVX512_BF16 CPU without AMX runs; tests force each path), -1 only
    asks. Process-wide."""
    ok, _ = available(kind)
    if not ok:
        return False
    return bool(torch.ops.baton.attention_amx(kind_id(kind), int(mode)))


class LinearAmx:
    """y = x @ W^T (+ bias) on AMX tiles (``torch.ops.baton.linear_amx``,
    amx_bf16.c) for bfloat16 rows, reading ``GemvBf16.tile(W)``: float32
    accumulation, the output rounded once to bf16 (as oneDNN's bf16 linear).
    ``max_rows``: the most rows the plan gives it a call."""

    def __init__(self, kind: str, max_rows: int) -> None:
        ok, reason = amx_ready(kind)
        if not ok:
            raise RuntimeError(reason)
        self.kind = kind_id(kind)
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor, w_tiled: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.baton.linear_amx(x.contiguous(), w_tiled, out_features, bias, self.kind)
