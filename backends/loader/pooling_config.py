"""How a Hugging Face folder says its model pools hidden states into one
embedding: sentence-transformers' ``modules.json`` and its Pooling module's
``config.json`` (``1_Pooling/config.json`` in the usual layout), and the
Matryoshka fields of ``config.json`` (``matryoshka_dimensions`` /
``is_matryoshka``, read as vLLM reads them).

A folder without ``modules.json`` is a generative model: it embeds with
last-token pooling, as vLLM's pooling runner does for a causal LM. A
pipeline Baton cannot reproduce (a Dense projection after pooling, a CLS or
max pooling mode) is not an error here: the model still generates, and
``PoolingConfig.unsupported`` tells /v1/embeddings why it refuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backends.config import PoolingConfig
from backends.errors import ModelLoadError

_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
# Pooling config.json's mode flags (and the mode name newer versions write),
# as Baton's pooling types.
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
_MODE_NAMES = {"lasttoken": "last", "mean": "mean"}


def read_pooling_config(folder: Path, raw_config: dict[str, Any]) -> PoolingConfig:
    """The pooling of the model in ``folder`` (``raw_config``: its config.json).
    Raises ModelLoadError for files that exist but cannot be read."""
    matryoshka, dims = _matryoshka(raw_config)
    modules = _read_json(folder / "modules.json")
    if modules is None:
        return PoolingConfig(matryoshka=matryoshka, matryoshka_dimensions=dims)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelLoadError(f"{folder / 'modules.json'} must hold a list of module objects")
    kinds = [str(m.get("type", "")) for m in modules]
    odd = [k for k in kinds if k not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    pooling = [m for m in modules if m.get("type") == _POOLING]
    if odd or len(pooling) != 1:
        why = (f"its sentence-transformers pipeline (modules.json) holds {', '.join(odd)}"
               if odd else "its modules.json has no single Pooling module")
        return PoolingConfig(matryoshka=matryoshka, matryoshka_dimensions=dims,
                             source="modules.json",
                             unsupported=f"this model cannot serve embeddings: {why}; Baton "
                                         f"pools a decoder's hidden states by last token or "
                                         f"mean, then L2-normalises")
    path = folder / str(pooling[0].get("path") or "1_Pooling") / "config.json"
    settings = _read_json(path)
    if not isinstance(settings, dict):
        raise ModelLoadError(f"{path} is missing or not a JSON object (modules.json names "
                             f"a Pooling module there)")
    source = str(path.relative_to(folder))
    chosen = _mode(settings)
    if chosen is None or chosen[0] is None:
        what = chosen[1] if chosen else "no pooling mode"
        return PoolingConfig(matryoshka=matryoshka, matryoshka_dimensions=dims, source=source,
                             unsupported=f"this model cannot serve embeddings: {source} asks "
                                         f"for {what}; Baton pools by last token or mean")
    return PoolingConfig(pooling_type=chosen[0], source=source, matryoshka=matryoshka,
                         matryoshka_dimensions=dims)


def _mode(settings: dict[str, Any]) -> tuple[str | None, str] | None:
    """(Baton's pooling type or None, the mode in words), or None when the
    file names no mode."""
    name = settings.get("pooling_mode")
    if isinstance(name, str):
        return _MODE_NAMES.get(name), f"pooling mode {name!r}"
    on = [key for key, value in settings.items()
          if key.startswith("pooling_mode_") and value is True]
    if not on:
        return None
    if len(on) > 1:
        return None, f"several pooling modes at once ({', '.join(sorted(on))})"
    return _MODES.get(on[0]), on[0]


def _matryoshka(raw: dict[str, Any]) -> tuple[bool, tuple[int, ...]]:
    dims = raw.get("matryoshka_dimensions")
    if dims is not None:
        if (not isinstance(dims, list) or not dims
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                           for d in dims)):
            raise ModelLoadError(f"config.json: 'matryoshka_dimensions' must be a list of "
                                 f"positive integers, got {dims!r}")
        return True, tuple(sorted(set(dims)))
    return bool(raw.get("is_matryoshka", False)), ()


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} cannot be read: {exc}") from None
