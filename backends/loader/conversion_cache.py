"""Convert a GGUF file once, then start from the conversion.

Loading a GGUF expands its blocks to the serving dtype and rebuilds a
``tokenizers.Tokenizer`` from llama.cpp's metadata: about 16 s for the
embedded SmolLM2-135M on a 2-core VM, at every start. This keeps what that
produced (the weights as safetensors, the tokenizer as tokenizer.json, the
config and the rest as JSON) in one folder per GGUF content and dtype, so
later starts read them back (a memory map and a small JSON) instead of
converting.

Entries are keyed by what the GGUF holds (its SHA-256), not by where it
lies: a second checkout or environment with the same file finds the first
one's entry. Hashing a file is done once per path, size, modification time
and inode (``sources/`` remembers the digest), so a start reads the GGUF in
full only when it is new or changed. An entry is used only while its
fingerprint matches: the GGUF's digest and size, the dtype, and a digest of
the loader code that shaped the result (a Baton upgrade that converts
differently converts again).

Each entry's files carry SHA-256 digests (one per 16 MiB chunk, checked in
parallel: ~1 s for SmolLM2's 513 MiB in float32 on a busy two-core VM, where
converting took ~15 s), checked before anything
is read from them: flipped bytes, a truncated or swapped file are a miss
with a log line saying so (before, flipped bytes served a silently wrong
model), and the file is converted again. A missing, stale, half-written or
unreadable entry is a miss too: the cache never makes a load fail. Writers
write beside the entry and rename, and the manifest names the weights file's
random id, so two processes converting the same file at once
(tensor-parallel ranks, parallel test servers) never mix their halves. An
entry whose source no remembered path holds any more is removed when its
replacement is written. Files whose converted weights exceed
``MAX_ENTRY_BYTES`` are not cached (the cache would double a large model's
disk footprint for a start-up that its dequantization no longer dominates).

Where the folder is and whether there is one: ``--conversion-cache``
(``EngineArgs.conversion_cache``; None: no cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch

from backends.config import GenerationDefaults, LoadedModel, ModelConfig, TokenizerSpec

log = logging.getLogger("baton.loader")

FORMAT_VERSION = 2
MAX_ENTRY_BYTES = 4 * 2**30
_MANIFEST = "manifest.json"
_WEIGHTS = "weights.safetensors"
_TOKENIZER = "tokenizer.json"
_SOURCES = "sources"
_CHUNK = 16 * 2**20
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
    # Per file of the entry: its size and the SHA-256 of each _CHUNK of it.
    digests: dict[str, tuple[int, list[str]]] = {}


def default_cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "baton" / "converted"


def _loader_digest() -> str:
    digest = hashlib.sha256(f"format {FORMAT_VERSION}".encode())
    here = pathlib.Path(__file__).parent
    for name in _LOADER_FILES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def chunk_digests(path: pathlib.Path) -> tuple[int, list[str]]:
    """A file's size and the SHA-256 of each of its _CHUNK-byte chunks,
    hashed on every core (hashlib lets go of the GIL)."""
    size = path.stat().st_size

    def one(offset: int) -> str:
        with open(path, "rb") as f:
            f.seek(offset)
            return hashlib.sha256(f.read(_CHUNK)).hexdigest()

    offsets = range(0, size, _CHUNK)
    if len(offsets) <= 1:
        return size, [one(0)] if size else []
    with ThreadPoolExecutor(max_workers=min(len(offsets), os.cpu_count() or 1)) as pool:
        return size, list(pool.map(one, offsets))


def source_digest(cache_dir: pathlib.Path, path: pathlib.Path) -> str:
    """The SHA-256 (of its chunk digests) of what ``path`` holds, read in
    full only when the path's size, modification time or inode changed
    since it was last hashed (``sources/`` remembers)."""
    resolved = path.resolve()
    stat = resolved.stat()
    stamp = [str(resolved), stat.st_size, stat.st_mtime_ns, stat.st_ino]
    record = pathlib.Path(cache_dir) / _SOURCES / (
        hashlib.sha256(str(resolved).encode()).hexdigest()[:16] + ".json")
    try:
        saved = json.loads(record.read_text())
        if saved["stamp"] == stamp:
            return saved["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    size, chunks = chunk_digests(resolved)
    digest = hashlib.sha256(f"{size}:{','.join(chunks)}".encode()).hexdigest()
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f"{record.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps({"stamp": stamp, "sha256": digest}))
        os.replace(tmp, record)
    except OSError:
        pass  # unwritable: hashed again next time, nothing worse
    return digest


def fingerprint(source: str, dtype: torch.dtype) -> dict[str, str]:
    """What an entry must match to stand for a GGUF of digest ``source``
    converted to ``dtype``."""
    return {"source_sha256": source, "dtype": str(dtype).removeprefix("torch."),
            "loader": _loader_digest()}


def _entry_for(cache_dir: pathlib.Path, path: pathlib.Path, source: str,
               dtype: torch.dtype) -> pathlib.Path:
    return pathlib.Path(cache_dir) / f"{path.stem}-{source[:16]}-{str(dtype).removeprefix('torch.')}"


def entry_dir(cache_dir: pathlib.Path, path: pathlib.Path, dtype: torch.dtype) -> pathlib.Path:
    """One entry per GGUF content and dtype."""
    return _entry_for(cache_dir, path, source_digest(cache_dir, path), dtype)


def _damaged_file(entry: pathlib.Path, digests: dict[str, tuple[int, list[str]]]) -> str | None:
    """Which of the entry's files fails its digests, and how; None if none."""
    for name in (_WEIGHTS, _TOKENIZER):
        if name not in digests:
            return f"{name} has no digest"
        size, chunks = digests[name]
        actual_size, actual = chunk_digests(entry / name)
        if actual_size != size:
            return f"{name} holds {actual_size} bytes, not the {size} it was written with"
        bad = next((i for i, (a, b) in enumerate(zip(actual, chunks)) if a != b), None)
        if bad is not None:
            return f"{name} differs from its digest in bytes {bad * _CHUNK}-" \
                   f"{min((bad + 1) * _CHUNK, size)}"
    return None


def load_cached(cache_dir: pathlib.Path, path: pathlib.Path,
                dtype: torch.dtype) -> LoadedModel | None:
    """The conversion of ``path`` to ``dtype`` from the cache, or None (a miss)."""
    from safetensors import safe_open
    from tokenizers import Tokenizer

    start = time.perf_counter()
    entry = None
    try:
        source = source_digest(cache_dir, path)
        entry = _entry_for(cache_dir, path, source, dtype)
        manifest = msgspec.json.decode((entry / _MANIFEST).read_bytes(), type=_Manifest)
        if manifest.fingerprint != fingerprint(source, dtype):
            log.info("conversion cache: %s was written by another version of the loader; "
                     "converting %s again", entry, path.name)
            return None
        damage = _damaged_file(entry, manifest.digests)
        if damage is not None:
            log.warning("conversion cache: %s fails its digest check (%s); converting %s "
                        "again", entry, damage, path.name)
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
    start = time.perf_counter()
    try:
        source = source_digest(cache_dir, path)
    except OSError as exc:
        log.warning("conversion cache: could not read %s to key its entry (%s)", path, exc)
        return None
    entry = _entry_for(cache_dir, path, source, dtype)
    spec = loaded.tokenizer
    weights_id = uuid.uuid4().hex
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir(parents=True)
        save_file({n: t.contiguous() for n, t in tensors.items()}, tmp / _WEIGHTS,
                  metadata={"weights_id": weights_id})
        spec.tokenizer.save(str(tmp / _TOKENIZER))
        os.chmod(tmp / _WEIGHTS, 0o644)  # readable by every user of a shared cache (an image's)
        manifest = _Manifest(
            fingerprint=fingerprint(source, dtype), weights_id=weights_id,
            config=loaded.config,
            tokenizer=_TokenizerFields(spec.bos_token, spec.eos_token, spec.bos_token_id,
                                       spec.eos_token_id, spec.add_bos_token,
                                       spec.chat_template, sorted(spec.special_token_ids)),
            generation=loaded.generation, source_formats=dict(loaded.source_formats),
            digests={name: chunk_digests(tmp / name) for name in (_WEIGHTS, _TOKENIZER)})
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
    _remove_orphans(pathlib.Path(cache_dir), entry)
    return entry


def _remove_orphans(cache_dir: pathlib.Path, kept: pathlib.Path) -> None:
    """Remove the entries of sources no remembered path holds any more (an
    older version of a file that was replaced), so a file that changes does
    not leave its every version behind."""
    held = set()
    for record in (cache_dir / _SOURCES).glob("*.json"):
        try:
            saved = json.loads(record.read_text())
            if pathlib.Path(saved["stamp"][0]).exists():
                held.add(saved["sha256"][:16])
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue
    for entry in cache_dir.iterdir():
        parts = entry.name.rsplit("-", 2)
        if (entry == kept or ".tmp-" in entry.name or len(parts) != 3 or parts[1] in held
                or len(parts[1]) != 16 or not (entry / _MANIFEST).is_file()):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        log.info("conversion cache: removed %s (no known file holds its source any more)",
                 entry)

