"""Model loading: a Hugging Face folder or a GGUF file to a LoadedModel."""

from __future__ import annotations

import os
import pathlib

import torch

from backends.config import LoadedModel
from backends.errors import ModelLoadError


def resolve_model_path(model: str | os.PathLike | None) -> pathlib.Path:
    """``None`` (or "default") means the embedded SmolLM2-135M-Instruct GGUF."""
    if model is None or str(model) == "default":
        from backends.loader.embedded import embedded_model_path
        return embedded_model_path()
    return pathlib.Path(model).expanduser()


def load_model(model: str | os.PathLike | None, dtype: torch.dtype = torch.float32,
               progress: bool = False) -> LoadedModel:
    path = resolve_model_path(model)
    if path.is_dir():
        from backends.loader.hf import load_hf_folder
        return load_hf_folder(path, dtype=dtype, progress=progress)
    if path.is_file() and path.suffix == ".gguf":
        from backends.loader.gguf import load_gguf
        return load_gguf(path, dtype=dtype, progress=progress)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    raise ModelLoadError(
        f"model path {str(path)!r} is neither a Hugging Face model folder nor a .gguf file")
