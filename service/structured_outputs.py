"""A request's output constraint: OpenAI's ``response_format`` or vLLM's
``structured_outputs`` turned into one StructuredOutputSpec.

vLLM 0.32 accepts ``structured_outputs`` ({json | regex | choice | grammar |
json_object} plus whitespace options); its older top-level ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar`` were removed in
vLLM 0.12, and Baton answers them with a 400 pointing at the replacement.
"""

from __future__ import annotations

import json
from typing import Any

from backends.errors import InvalidRequestError
from backends.grammar import exactness_problem
from backends.interface import MAX_CHOICES, StructuredOutputSpec
from service.admission import check_nesting
from service.protocol import ResponseFormat, StructuredOutputs

ANY_JSON_OBJECT = {"type": "object"}
# vLLM's guided-decoding fields before 0.12, and what replaced them.
REMOVED_GUIDED_FIELDS = {
    "guided_json": "structured_outputs.json", "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice", "guided_grammar": "structured_outputs.grammar",
    "guided_whitespace_pattern": "structured_outputs.whitespace_pattern",
    "guided_decoding_backend": "nothing (Baton has one grammar engine)",
}


def response_format_spec(fmt: ResponseFormat | None) -> StructuredOutputSpec | None:
    """None for no constraint (absent, or type "text")."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputSpec("json", json.dumps(ANY_JSON_OBJECT))
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequestError(
                "response_format of type json_schema needs json_schema.schema",
                "response_format")
        schema = fmt.json_schema.schema_
        if fmt.json_schema.strict is True:
            _check_exact(schema, "response_format", "response_format.json_schema is strict")
        # Not strict: what the grammar engine cannot enforce is left to the
        # model, as OpenAI does (docs/serving.md, "Lenient schemas").
        return StructuredOutputSpec("json", _dumps(schema),
                                    lenient=fmt.json_schema.strict is not True)
    if fmt.type == "structural_tag":
        raise InvalidRequestError("response_format type structural_tag is not supported; use "
                                  "tools, json_schema or structured_outputs.grammar",
                                  "response_format")
    raise InvalidRequestError(
        f"response_format type must be text, json_object or json_schema, got {fmt.type!r}",
        "response_format")


def structured_outputs_spec(so: StructuredOutputs | None) -> StructuredOutputSpec | None:
    if so is None:
        return None
    if so.structural_tag is not None:
        raise InvalidRequestError("structured_outputs.structural_tag is not supported; use "
                                  "tools or structured_outputs.grammar", "structured_outputs")
    given = [name for name in ("json", "regex", "choice", "grammar") if getattr(so, name) is not None]
    if so.json_object:
        given.append("json_object")
    if len(given) != 1:
        raise InvalidRequestError(
            "structured_outputs needs exactly one of json, regex, choice, grammar or "
            f"json_object, got {', '.join(given) or 'none'}", "structured_outputs")
    any_ws = so.disable_any_whitespace is False
    kind = given[0]
    if kind in ("json", "json_object"):
        schema = ANY_JSON_OBJECT if kind == "json_object" else so.json
        if isinstance(schema, str):
            check_nesting(schema, "structured_outputs")
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"structured_outputs.json is not JSON: {exc}",
                                          "structured_outputs") from exc
        if so.disable_additional_properties:
            schema = _closed_objects(schema)
        return StructuredOutputSpec("json", _dumps(schema), any_ws, so.whitespace_pattern,
                                    param="structured_outputs")
    if kind == "choice":
        if len(so.choice) > MAX_CHOICES:
            raise InvalidRequestError(f"structured_outputs.choice may hold at most "
                                      f"{MAX_CHOICES} strings, got {len(so.choice)}",
                                      "structured_outputs")
        return StructuredOutputSpec("choice", json.dumps(so.choice), param="structured_outputs")
    source = so.regex if kind == "regex" else so.grammar
    return StructuredOutputSpec(kind, source, param="structured_outputs")


def request_spec(response_format: ResponseFormat | None,
                 structured_outputs: StructuredOutputs | None) -> StructuredOutputSpec | None:
    a = response_format_spec(response_format)
    b = structured_outputs_spec(structured_outputs)
    if a is not None and b is not None:
        raise InvalidRequestError("give either response_format or structured_outputs, not both",
                                  "structured_outputs")
    return a or b


def _check_exact(schema: Any, param: str, what: str) -> None:
    """A strict schema is enforced exactly or refused, naming what cannot be."""
    problem = exactness_problem(schema)
    if problem is not None:
        raise InvalidRequestError(
            f"{what}, and the grammar engine cannot enforce all of it exactly: {problem}. "
            f"Without strict: true, keywords and formats it does not implement are left "
            f"unenforced (docs/serving.md, \"Lenient schemas\")", param)


def _dumps(schema: Any) -> str:
    # Not sorted: property order is the order the output writes them in.
    return json.dumps(schema, separators=(",", ":"))


def _closed_objects(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema that says
    nothing about additionalProperties gets ``false``."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out
