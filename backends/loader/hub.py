"""Hugging Face Hub ids as models: ``org/name`` (a safetensors repository) or
``org/name:TAG`` (the one GGUF file of a repository whose name holds TAG,
e.g. ``Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M``), fetched with
``huggingface_hub`` into its standard cache (``HF_HOME`` / ``HF_HUB_CACHE``,
or ``download_dir``) and loaded from there.

Only what Baton reads is fetched: the top-level config, tokenizer and
generation files and the safetensors shards (never ``*.bin``, ``original/``
or other formats), or the one GGUF file. ``HF_TOKEN`` (or a saved login)
opens gated and private repositories; with ``HF_HUB_OFFLINE=1`` nothing is
asked of the network and the id must already be in the cache.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path

from backends.errors import ModelLoadError
from backends.progress import heartbeat, on_terminal

log = logging.getLogger("baton")

# org/name, each part what the Hub allows; an optional :TAG picks a GGUF file.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<tag>[\w.-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Files of a Hugging Face model folder that Baton reads (hf.py).
_FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "model.safetensors.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def is_hub_id(model: str) -> bool:
    """True for ``org/name`` or ``org/name:TAG`` that names no local path."""
    if Path(model).expanduser().exists() or model.startswith((".", "/", "~")):
        return False
    return _HUB_ID.match(model) is not None and not model.endswith(".gguf")


def hub_repo_name(model: str) -> str:
    """``org/name:TAG`` -> ``org/name``."""
    match = _HUB_ID.match(model)
    return match.group("repo") if match else model


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it,
    checked now rather than when huggingface_hub was imported."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"} or bool(constants.HF_HUB_OFFLINE)


def download_model(model: str, revision: str | None = None, download_dir: str | None = None,
                   progress: bool = False) -> Path:
    """The local path of Hub id ``model``: a snapshot folder, or a .gguf file
    inside one. Raises ModelLoadError with what to do for an unknown or gated
    repository, a revision that does not exist, a repository with nothing
    Baton can load, or (offline) an id missing from the cache."""
    match = _HUB_ID.match(model)
    if match is None:
        raise ModelLoadError(f"{model!r} is not a Hugging Face Hub id (org/name or org/name:TAG)")
    repo, tag = match.group("repo"), match.group("tag")
    cache = Path(download_dir).expanduser() if download_dir else None
    files = _list_files(repo, revision, cache)
    wanted = choose_files(repo, files, tag)
    total = sum(files[name] or 0 for name in wanted)
    log.info("model %s%s: %d file(s), %.0f MiB%s", repo,
             f"@{revision}" if revision else "", len(wanted), total / 2**20,
             " (offline: from the cache)" if offline() else "")
    folder = _fetch(repo, revision, cache, wanted, total, progress)
    missing = [name for name in wanted if not (folder / name).is_file()]
    if missing:
        raise ModelLoadError(
            f"{repo}: {', '.join(missing[:3])} missing from the cached snapshot {folder}"
            + ("; HF_HUB_OFFLINE is set, so nothing was downloaded" if offline() else ""))
    ggufs = [name for name in wanted if name.endswith(".gguf")]
    return folder / ggufs[0] if ggufs else folder


def download_tokenizer(source: str, revision: str | None = None,
                       download_dir: str | None = None, progress: bool = False) -> Path:
    """``--tokenizer org/name``: the snapshot folder holding only its
    tokenizer files (``org/name:TAG``: the GGUF file, whose tokenizer is inside)."""
    match = _HUB_ID.match(source)
    if match is None or match.group("tag") is not None:
        return download_model(source, revision, download_dir, progress)
    repo = match.group("repo")
    cache = Path(download_dir).expanduser() if download_dir else None
    files = _list_files(repo, revision, cache)
    wanted = [name for name in _TOKENIZER_FILES if name in files]
    if "tokenizer.json" not in wanted:
        raise ModelLoadError(f"{repo} has no tokenizer.json; Baton needs the fast "
                             f"(tokenizers) format for --tokenizer")
    return _fetch(repo, revision, cache, wanted, sum(files[n] or 0 for n in wanted), progress)


def choose_files(repo: str, files: Mapping[str, int | None], tag: str | None) -> list[str]:
    """What to fetch of a repository whose files (path -> size) are ``files``:
    with a tag, the one GGUF whose name holds it; else the safetensors folder
    if there is one, else the repository's only GGUF file."""
    ggufs = sorted(name for name in files if name.endswith(".gguf"))
    if tag is not None:
        picked = [g for g in ggufs if tag.lower() in Path(g).name.lower()]
        whole = [g for g in picked if not _SPLIT_GGUF.search(g)]
        if len(whole) == 1:
            return whole
        if picked and not whole:
            raise ModelLoadError(
                f"{repo}: {picked[0]} is split into several files; Baton loads single-file "
                f"GGUFs (merge it with llama.cpp's gguf-split --merge)")
        if not picked:
            raise ModelLoadError(
                f"{repo}: no GGUF file matches {tag!r}; it has "
                f"{_listing(ggufs) or 'no GGUF files'}")
        raise ModelLoadError(f"{repo}: {tag!r} matches several GGUF files: {_listing(whole)}; "
                             f"give a longer tag")
    top = {name for name in files if "/" not in name}
    shards = sorted(name for name in top if name.endswith(".safetensors"))
    if "config.json" in top and shards:
        return [name for name in _FOLDER_FILES if name in top] + shards
    if len(ggufs) == 1:
        return ggufs
    if ggufs:
        tags = sorted({_quant_tag(g) for g in ggufs} - {""})
        raise ModelLoadError(
            f"{repo} holds several GGUF files; name one as {repo}:TAG, "
            f"TAG one of {', '.join(tags) or _listing(ggufs)}")
    raise ModelLoadError(
        f"{repo} has neither a config.json with safetensors weights nor a GGUF file; "
        f"Baton loads those two formats")


def _quant_tag(name: str) -> str:
    match = re.search(r"[.-]((?:I?Q\d[\w]*)|F16|BF16|F32)\.gguf$", Path(name).name,
                      re.IGNORECASE)
    return match.group(1) if match else ""


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:8])
    return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _storage(repo: str, cache: Path | None) -> Path:
    from huggingface_hub import constants

    root = cache or Path(constants.HF_HUB_CACHE)
    return root / ("models--" + repo.replace("/", "--"))


def _cached_snapshot(repo: str, revision: str | None, cache: Path | None) -> Path | None:
    storage = _storage(repo, cache)
    ref = revision or "main"
    commit = ref if _COMMIT.match(ref) else None
    ref_file = storage / "refs" / ref
    if commit is None and ref_file.is_file():
        commit = ref_file.read_text().strip()
    folder = storage / "snapshots" / commit if commit else None
    return folder if folder is not None and folder.is_dir() else None


def _list_files(repo: str, revision: str | None, cache: Path | None) -> dict[str, int | None]:
    """path -> size of every file of the repository at ``revision``: from the
    Hub, or offline (or when the Hub cannot be reached) from the cache."""
    error: Exception | None = None
    if not offline():
        from huggingface_hub import HfApi
        from huggingface_hub.errors import (GatedRepoError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
        try:
            return {f.path: getattr(f, "size", None)
                    for f in HfApi().list_repo_tree(repo, recursive=True, revision=revision)
                    if not hasattr(f, "tree_id")}
        except GatedRepoError:
            raise ModelLoadError(
                f"{repo} is gated: accept its terms on huggingface.co and set HF_TOKEN "
                f"(or run `hf auth login`)") from None
        except RepositoryNotFoundError:
            raise ModelLoadError(
                f"{repo} was not found on the Hugging Face Hub (or is private: set HF_TOKEN)"
            ) from None
        except RevisionNotFoundError:
            raise ModelLoadError(f"{repo} has no revision {revision!r}") from None
        except Exception as exc:  # noqa: BLE001 - no network: fall back on the cache below
            error = exc
    snapshot = _cached_snapshot(repo, revision, cache)
    if snapshot is None:
        where = _storage(repo, cache).parent
        why = ("HF_HUB_OFFLINE is set" if error is None
               else f"the Hub could not be reached ({type(error).__name__}: {error})")
        raise ModelLoadError(
            f"{repo}{'@' + revision if revision else ''} is not in the Hugging Face cache "
            f"({where}) and {why}")
    if error is not None:
        log.warning("the Hub could not be reached (%s); using the cached %s", error, snapshot)
    return {str(p.relative_to(snapshot)): p.stat().st_size
            for p in snapshot.rglob("*") if p.is_file()}


def _fetch(repo: str, revision: str | None, cache: Path | None, wanted: list[str],
           total: int, progress: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    local_only = offline()
    storage = _storage(repo, cache)

    def downloaded() -> str:
        done = sum(p.stat().st_size for p in (storage / "blobs").glob("*") if p.is_file()) \
            if (storage / "blobs").is_dir() else 0
        return f"{done / 2**20:,.0f} of {total / 2**20:,.0f} MiB on disk"

    terminal = progress and on_terminal()
    if not terminal:
        disable_progress_bars()  # lines from heartbeat() instead of bars in a log
    try:
        with heartbeat(f"downloading {repo}", downloaded, enabled=progress and not terminal
                       and not local_only):
            folder = snapshot_download(repo, revision=revision, cache_dir=cache,
                                       allow_patterns=wanted, local_files_only=local_only)
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's errors, made actionable
        raise ModelLoadError(f"{repo}: download failed ({type(exc).__name__}: {exc})") from exc
    finally:
        if not terminal:
            enable_progress_bars()
    return Path(folder)
