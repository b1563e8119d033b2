"""Convert a GGUF file once, then start from the conversion.

Loading a GGUF expands its blocks to the serving dtype and rebuilds a
``tokenizers.Tokenizer`` from llama.cpp's metadata: about a second for the
embedded SmolLM2-135M on a 2-core VM, at every start. This keeps what that
produced (the weights as safetensors, the tokenizer as tokenizer.json, the
config and the rest as JSON) in one folder per GGUF file and dtype, so later
starts read them back (a memory map and a small JSON) instead of converting.

An entry is used only while its fingerprint matches: the GGUF's resolved
path, size and modification time, the dtype, and a digest of the loader
code that shaped the result (a Baton upgrade that converts differently
converts again). A missing, stale, half-written or unreadable entry is a
miss: the file is converted as before and the entry rewritten; the cache
never makes a load fail. Writers write beside the entry and rename, and the
manifest names the weights file's random id, so two processes converting
the same file at once (tensor-parallel ranks, parallel test servers) never
mix their halves. Files whose converted weights exceed ``MAX_ENTRY_BYTES``
are not cached (the cache would double a large model's disk footprint for
a start-up that its dequantization no longer dominates).

Where the folder is and whether there is one: ``--conversion-cache``
(``EngineArgs.conversion_cache``; None: no cache).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import shutil
import time
import uuid

import msgspec
import torch

from backends.config import GenerationDefaults, LoadedModel, ModelConfig, TokenizerSpec

log = logging.getLogger("baton.loader")

FORMAT_VERSION = 1
MAX_ENTRY_BYTES = 4 * 2**30
_MANIFEST = "manifest.json"
_WEIGHTS = "weights.safetensors"
_TOKENIZER = "tokenizer.json"
# The modules whose code decides what a GGUF converts to.
_LOADER_FILES = ("gguf.py", "gguf_dequant.py", "gguf_file.py", "gguf_tokenizer.py",
                 "conversion_cache.py")


class _TokenizerFields(msgspec.Struct, frozen=True):
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    special_token_ids: list[int]


class _Manifest(msgspec.Struct, frozen=True):
    fingerprint: dict[str, str]
    weights_id: str
    config: ModelConfig
    tokenizer: _TokenizerFields
    generation: GenerationDefaults
    source_formats: dict[str, str]


def default_cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "baton" / "converted"


def _loader_digest() -> str:
    digest = hashlib.sha256(f"format {FORMAT_VERSION}".encode())
    here = pathlib.Path(__file__).parent
    for name in _LOADER_FILES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def fingerprint(path: pathlib.Path, dtype: torch.dtype) -> dict[str, str]:
    """What an entry must match to stand for ``path`` converted to ``dtype``."""
    resolved = path.resolve()
    stat = resolved.stat()
    return {"path": str(resolved), "size": str(stat.st_size),
            "mtime_ns": str(stat.st_mtime_ns), "dtype": str(dtype).removeprefix("torch."),
            "loader": _loader_digest()}


def entry_dir(cache_dir: pathlib.Path, path: pathlib.Path, dtype: torch.dtype) -> pathlib.Path:
    """One entry per file and dtype: a newer version of the file replaces its
    entry rather than adding one."""
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return pathlib.Path(cache_dir) / f"{path.stem}-{key}-{str(dtype).removeprefix('torch.')}"


def load_cached(cache_dir: pathlib.Path, path: pathlib.Path,
                dtype: torch.dtype) -> LoadedModel | None:
    """The conversion of ``path`` to ``dtype`` from the cache, or None (a miss)."""
    from safetensors import safe_open
    from tokenizers import Tokenizer

    entry = entry_dir(cache_dir, path, dtype)
    start = time.perf_counter()
    try:
        manifest = msgspec.json.decode((entry / _MANIFEST).read_bytes(), type=_Manifest)
        if manifest.fingerprint != fingerprint(path, dtype):
            log.info("conversion cache: %s changed since %s was written; converting again",
                     path.name, entry)
            return None
        weights = {}
        with safe_open(entry / _WEIGHTS, framework="pt") as f:
            if (f.metadata() or {}).get("weights_id") != manifest.weights_id:
                return None  # another process is rewriting the entry
            for name in f.keys():
                weights[name] = f.get_tensor(name)
        tokenizer = Tokenizer.from_file(str(entry / _TOKENIZER))
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a damaged entry is a miss, never a failure
        log.warning("conversion cache: ignoring the unreadable entry %s (%s: %s)", entry,
                    type(exc).__name__, exc)
        return None
    fields = manifest.tokenizer
    spec = TokenizerSpec(tokenizer=tokenizer, bos_token=fields.bos_token,
                         eos_token=fields.eos_token, bos_token_id=fields.bos_token_id,
                         eos_token_id=fields.eos_token_id, add_bos_token=fields.add_bos_token,
                         chat_template=fields.chat_template,
                         special_token_ids=frozenset(fields.special_token_ids))
    log.info("conversion cache: %s read from %s in %.2fs (not converted again)",
             path.name, entry, time.perf_counter() - start)
    return LoadedModel(config=manifest.config, weights=weights, tokenizer=spec,
                       generation=manifest.generation, source=str(path),
                       source_formats=dict(manifest.source_formats))


def store(cache_dir: pathlib.Path, path: pathlib.Path, dtype: torch.dtype,
          loaded: LoadedModel) -> pathlib.Path | None:
    """Write ``loaded`` (``path`` converted to ``dtype``) as the file's entry;
    returns the entry, or None when it was not written (too large, or the
    folder is not writable: a warning, never an error)."""
    from safetensors.torch import save_file

    tensors = {name: w for name, w in loaded.weights.items() if isinstance(w, torch.Tensor)}
    if len(tensors) != len(loaded.weights):
        return None  # blocks kept quantized: nothing slow to skip
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if size > MAX_ENTRY_BYTES:
        log.info("conversion cache: %s converts to %.1f GiB, above the %.0f GiB an entry may "
                 "take; not cached", path.name, size / 2**30, MAX_ENTRY_BYTES / 2**30)
        return None
    entry = entry_dir(cache_dir, path, dtype)
    spec = loaded.tokenizer
    manifest = _Manifest(
        fingerprint=fingerprint(path, dtype), weights_id=uuid.uuid4().hex,
        config=loaded.config,
        tokenizer=_TokenizerFields(spec.bos_token, spec.eos_token, spec.bos_token_id,
                                   spec.eos_token_id, spec.add_bos_token, spec.chat_template,
                                   sorted(spec.special_token_ids)),
        generation=loaded.generation, source_formats=dict(loaded.source_formats))
    start = time.perf_counter()
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir(parents=True)
        save_file({n: t.contiguous() for n, t in tensors.items()}, tmp / _WEIGHTS,
                  metadata={"weights_id": manifest.weights_id})
        spec.tokenizer.save(str(tmp / _TOKENIZER))
        os.chmod(tmp / _WEIGHTS, 0o644)  # readable by every user of a shared cache (an image's)
        (tmp / _MANIFEST).write_bytes(msgspec.json.encode(manifest))
        entry.mkdir(parents=True, exist_ok=True)
        # The manifest goes last: until it names the new weights, readers miss.
        for name in (_WEIGHTS, _TOKENIZER, _MANIFEST):
            os.replace(tmp / name, entry / name)
    except OSError as exc:
        log.warning("conversion cache: could not write %s (%s); the next start converts "
                    "again", entry, exc)
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("conversion cache: wrote %s (%.0f MiB) in %.2fs; later starts read it instead "
             "of converting %s", entry, size / 2**20, time.perf_counter() - start, path.name)
    return entry

