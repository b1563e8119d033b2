"""Model loading: a Hugging Face folder, a GGUF file or a Hub id to a LoadedModel."""

from __future__ import annotations

import os
import pathlib

import torch

from backends.config import LoadedModel, TokenizerSpec
from backends.errors import ModelLoadError


def resolve_model_path(model: str | os.PathLike | None) -> pathlib.Path:
    """``None`` (or "default") means the embedded SmolLM2-135M-Instruct GGUF."""
    if model is None or str(model) == "default":
        from backends.loader.embedded import embedded_model_path
        return embedded_model_path()
    return pathlib.Path(model).expanduser()


def resolve_model(model: str | os.PathLike | None, revision: str | None = None,
                  download_dir: str | None = None, progress: bool = False) -> pathlib.Path:
    """A local path for ``model``: the embedded default for None, a local
    folder or file as it is, a Hugging Face Hub id (``org/name``,
    ``org/name:TAG``) fetched into the Hub cache (backends/loader/hub.py)."""
    if model is not None and str(model) != "default":
        from backends.loader.hub import download_model, is_hub_id
        if is_hub_id(str(model)):
            return download_model(str(model), revision, download_dir, progress)
    path = resolve_model_path(model)
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist (nor is it a Hugging Face Hub id, "
            f"org/name)")
    return path


def resolve_tokenizer(source: str, download_dir: str | None = None,
                      progress: bool = False) -> pathlib.Path:
    """``--tokenizer``: a local folder or .gguf file as it is, a Hub id
    fetched (its tokenizer files only) into the Hub cache."""
    from backends.loader.hub import download_tokenizer, is_hub_id
    if is_hub_id(source):
        return download_tokenizer(source, None, download_dir, progress)
    path = pathlib.Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"tokenizer {source!r} does not exist (nor is it a Hugging Face "
                             f"Hub id, org/name)")
    return path


def load_tokenizer(path: pathlib.Path) -> TokenizerSpec:
    """The tokenizer of a Hugging Face folder (tokenizer.json and
    tokenizer_config.json) or of a .gguf file."""
    if path.is_dir():
        from backends.loader.hf import load_tokenizer_folder
        return load_tokenizer_folder(path)
    if path.is_file() and path.suffix == ".gguf":
        from backends.loader.gguf import read_gguf_tokenizer
        return read_gguf_tokenizer(path)
    raise ModelLoadError(f"tokenizer {str(path)!r} is neither a folder holding tokenizer.json "
                         f"nor a .gguf file")


def load_model(model: str | os.PathLike | None, dtype: torch.dtype = torch.float32,
               progress: bool = False, revision: str | None = None,
               download_dir: str | None = None, shard=None,
               conversion_cache: str | os.PathLike | None = None,
               tokenizer: TokenizerSpec | None = None) -> LoadedModel:
    """``shard``: for one tensor-parallel rank, a function of the model's
    config returning its CheckpointShard (backends/parallel/sharding.py);
    the weights are then only that rank's part: read as slices from
    safetensors files; a GGUF file is dequantized whole, then each tensor is
    cut to its part and the rest dropped before the model is built.

    ``conversion_cache``: a folder where a GGUF's conversion is kept and
    found again (backends/loader/conversion_cache.py); None: convert every time.

    ``tokenizer``: one loaded from elsewhere (``--tokenizer``), used instead
    of the model's own (a model folder then needs no tokenizer files)."""
    path = resolve_model(model, revision, download_dir, progress)
    if path.is_dir():
        from backends.loader.hf import load_hf_folder
        return with_tokenizer(load_hf_folder(path, dtype=dtype, progress=progress,
                                              shard=shard, tokenizer=tokenizer), tokenizer)
    if path.is_file() and path.suffix == ".gguf":
        loaded = _load_gguf(path, dtype, progress, conversion_cache)
        if shard is not None:
            shard(loaded.config).take_all(loaded.weights)
        return with_tokenizer(loaded, tokenizer)
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist (nor is it a Hugging Face Hub id, "
            f"org/name)")
    raise ModelLoadError(
        f"model path {str(path)!r} is neither a Hugging Face model folder nor a .gguf file")


def with_tokenizer(loaded: LoadedModel, tokenizer: TokenizerSpec | None) -> LoadedModel:
    """``loaded`` with ``tokenizer`` in place of its own, once it is known to
    fit the model: every id it writes must have a row in the embeddings. A
    tokenizer without a chat template keeps the model's."""
    if tokenizer is None:
        return loaded
    size = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    if size > loaded.config.vocab_size:
        raise ModelLoadError(
            f"the tokenizer has {size} tokens but the model's vocabulary only "
            f"{loaded.config.vocab_size}: it is not this model's tokenizer")
    if tokenizer.chat_template is None and loaded.tokenizer.chat_template is not None:
        import dataclasses
        tokenizer = dataclasses.replace(tokenizer, chat_template=loaded.tokenizer.chat_template)
    loaded.tokenizer = tokenizer
    return loaded


def _load_gguf(path: pathlib.Path, dtype: torch.dtype, progress: bool,
               conversion_cache: str | os.PathLike | None) -> LoadedModel:
    if conversion_cache is None:
        from backends.loader.gguf import load_gguf
        return load_gguf(path, dtype=dtype, progress=progress)
    from backends.loader import conversion_cache as cache
    loaded = cache.load_cached(pathlib.Path(conversion_cache), path, dtype)
    if loaded is None:  # gguf-py is imported only when there is something to convert
        from backends.loader.gguf import load_gguf
        loaded = load_gguf(path, dtype=dtype, progress=progress)
        cache.store(pathlib.Path(conversion_cache), path, dtype, loaded)
    return loaded
