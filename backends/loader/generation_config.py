"""generation_config.json: the sampling defaults a model's authors recommend,
and ``--generation-config`` as vLLM reads it:

- ``auto``: the model's own file (a Hugging Face folder's; a GGUF has none);
- ``vllm``: none of the file's sampling defaults, only the request's values
  and OpenAI's defaults. End-of-sequence ids stay: they say where the model's
  turn ends, not how to sample;
- a folder holding a generation_config.json (or the file itself): that
  file's defaults instead of the model's.

Fields used: temperature, top_p, top_k, min_p, repetition_penalty (defaults a
request's own values override), max_new_tokens (a cap on every request's
output, as in vLLM) and eos_token_id / bos_token_id.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from backends.config import GenerationDefaults
from backends.errors import ModelLoadError

FILE = "generation_config.json"
MODES = ("auto", "vllm")


def parse_generation_config(raw: dict[str, Any], file: str,
                            base: GenerationDefaults) -> GenerationDefaults:
    """``base`` with what ``raw`` (a generation_config.json's object) sets."""
    eos = _id_tuple(raw.get("eos_token_id"), file) or base.eos_token_ids
    bos = raw.get("bos_token_id")
    max_new = raw.get("max_new_tokens")
    return GenerationDefaults(
        eos_token_ids=eos,
        bos_token_id=bos if _is_int(bos) else base.bos_token_id,
        temperature=_float(raw, "temperature"),
        top_p=_float(raw, "top_p"),
        top_k=raw["top_k"] if _is_int(raw.get("top_k")) else None,
        min_p=_float(raw, "min_p"),
        repetition_penalty=_float(raw, "repetition_penalty"),
        max_new_tokens=max_new if _is_int(max_new) and max_new > 0 else None,
    )


def apply_generation_config(mode: str, model_defaults: GenerationDefaults) -> GenerationDefaults:
    """The defaults to serve with under ``--generation-config mode``."""
    if mode == "auto":
        return model_defaults
    if mode == "vllm":
        return GenerationDefaults(eos_token_ids=model_defaults.eos_token_ids,
                                  bos_token_id=model_defaults.bos_token_id)
    file = generation_config_file(mode)
    raw = read_json_object(file)
    return parse_generation_config(raw, str(file), dataclasses.replace(
        model_defaults, temperature=None, top_p=None, top_k=None, min_p=None,
        repetition_penalty=None, max_new_tokens=None))


def generation_config_file(mode: str) -> Path | None:
    """The file ``--generation-config mode`` names (None for auto and vllm);
    raises ModelLoadError if there is none, so a typo fails before loading."""
    if mode in MODES:
        return None
    path = Path(mode).expanduser()
    file = path / FILE if path.is_dir() else path
    if not file.is_file():
        raise ModelLoadError(
            f"--generation-config {mode!r}: no {FILE} there; give auto, vllm or a folder "
            f"holding a {FILE}")
    return file


def read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _float(raw: dict[str, Any], key: str) -> float | None:
    value = raw.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def _id_tuple(value: Any, file: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(_is_int(i) for i in ids):
        raise ModelLoadError(f"{file}: eos_token_id must be an integer or a list of integers, "
                             f"got {value!r}")
    return tuple(ids)
