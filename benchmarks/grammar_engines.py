"""xgrammar against llguidance on one tokenizer: schema compile time and the
per-token cost of constrained decoding (mask computation, token acceptance).

Both engines see the same schemas and the same token sequences: each
schema's sample instance, serialised as ``json.dumps`` does (", " and ": "
separators, the layout both engines are configured to produce), tokenized by
the model's own tokenizer and fed one token at a time. Before each token the
engine computes the next-token bitmask (what a decode step waits for), then
accepts the token. Figures are medians over the tokens of all schemas.

    .venv/bin/python benchmarks/grammar_engines.py [--model PATH] [--repeat 3]

The embedded SmolLM2-135M-Instruct (49152-token byte-level BPE) is the
default model. llguidance is Baton's own dependency; xgrammar is not: install it
with `pip install --no-deps xgrammar apache-tvm-ffi` (its CPU path needs neither
its triton nor its transformers requirement).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

SCHEMAS: dict[str, tuple[dict, object]] = {
    "flat": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "ok": True}),
    "nested_enum_array": ({"type": "object", "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "forecast": {"type": "array", "items": {"type": "object", "properties": {
            "day": {"type": "string", "enum": ["mon", "tue", "wed", "thu", "fri"]},
            "high": {"type": "number"}, "low": {"type": "number"}},
            "required": ["day", "high", "low"], "additionalProperties": False}},
        "source": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["city", "unit", "forecast", "source"], "additionalProperties": False},
        {"city": "Paris", "unit": "celsius", "forecast": [
            {"day": "mon", "high": 21.5, "low": 12}, {"day": "tue", "high": 19, "low": 11.25},
            {"day": "wed", "high": 23, "low": 14}], "source": None}),
    "wide_with_refs": ({"$defs": {"address": {"type": "object", "properties": {
        "street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]}},
        "required": ["street", "zip", "country"], "additionalProperties": False}},
        "type": "object", "properties": {
            **{f"field_{i}": {"type": "integer", "minimum": 0} for i in range(8)},
            "home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": [*(f"field_{i}" for i in range(8)), "home", "work", "tags"],
        "additionalProperties": False},
        {**{f"field_{i}": i * 7 for i in range(8)},
         "home": {"street": "1 rue de Rivoli", "zip": "75001", "country": "FR"},
         "work": {"street": "5th Avenue", "zip": "10001", "country": "US"},
         "tags": ["alpha", "beta"]}),
}


def _load_tokenizer(model: str | None):
    from backends.loader import load_model
    loaded = load_model(model, dtype=torch.float32)
    return loaded.tokenizer, loaded.config.vocab_size, loaded.generation.eos_token_ids


def _xgrammar(spec, vocab_size, eos):
    import xgrammar as xgr
    t0 = time.perf_counter()
    backend_str = spec.tokenizer.to_str()
    vocab = spec.tokenizer.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, index in vocab.items():
        if index < vocab_size:
            encoded[index] = token
    # from_huggingface() wants a transformers tokenizer; this is its path for
    # a tokenizers JSON (vocab type and prefix space read from the JSON).
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend_str)
    info = xgr.TokenizerInfo(encoded, xgr.VocabType(meta["vocab_type"]), vocab_size=vocab_size,
                             stop_token_ids=list(eos), add_prefix_space=meta["add_prefix_space"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t0

    class Engine:
        name = "xgrammar"

        def compile(self, schema):
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

        def matcher(self, compiled):
            return xgr.GrammarMatcher(compiled)

        def new_bitmask(self):
            return xgr.allocate_token_bitmask(1, vocab_size)

        def fill(self, matcher, bitmask):
            matcher.fill_next_token_bitmask(bitmask, 0)

        def accept(self, matcher, token):
            return matcher.accept_token(token)

        def allowed(self, bitmask, token):
            return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)

    return Engine(), setup


def _llguidance(spec, vocab_size, eos):
    import llguidance
    import llguidance.torch as llt
    t0 = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(spec.tokenizer.to_str(), n_vocab=vocab_size,
                                       eos_token=list(eos))
    setup = time.perf_counter() - t0

    class Engine:
        name = "llguidance"

        def compile(self, schema):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, overrides={"whitespace_flexible": False, "item_separator": ", ",
                                   "key_separator": ": "})
            error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
            if error:
                raise ValueError(error)
            return grammar

        def matcher(self, compiled):
            m = llguidance.LLMatcher(tokenizer, compiled, log_level=0)
            if m.is_error():
                raise ValueError(m.get_error())
            return m

        def new_bitmask(self):
            return llt.allocate_token_bitmask(1, vocab_size)

        def fill(self, matcher, bitmask):
            llt.fill_next_token_bitmask(matcher, bitmask, 0)

        def accept(self, matcher, token):
            return matcher.consume_token(token)

        def allowed(self, bitmask, token):
            return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)

    return Engine(), setup


def measure(engine, spec, eos, repeat: int) -> dict:
    compile_ms: dict[str, float] = {}
    fill_us: list[float] = []
    accept_us: list[float] = []
    first_fill_us: list[float] = []
    for name, (schema, instance) in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = engine.compile(schema)
        engine.matcher(compiled)  # llguidance builds its parser lazily here
        compile_ms[name] = (time.perf_counter() - t0) * 1e3
        text = json.dumps(instance)
        tokens = spec.tokenizer.encode(text, add_special_tokens=False).ids + [eos[0]]
        for rep in range(repeat):
            matcher = engine.matcher(compiled)
            bitmask = engine.new_bitmask()
            for i, token in enumerate(tokens):
                t0 = time.perf_counter()
                engine.fill(matcher, bitmask)
                t1 = time.perf_counter()
                if not engine.allowed(bitmask, token):
                    raise AssertionError(f"{engine.name}: {name} token {i} ({token}) masked")
                ok = engine.accept(matcher, token)
                t2 = time.perf_counter()
                if not ok:
                    raise AssertionError(f"{engine.name}: {name} token {i} rejected")
                (first_fill_us if i == 0 else fill_us).append((t1 - t0) * 1e6)
                accept_us.append((t2 - t1) * 1e6)
    return {"compile_ms": compile_ms, "fill_us_p50": statistics.median(fill_us),
            "fill_us_p90": statistics.quantiles(fill_us, n=10)[-1],
            "fill_us_max": max(fill_us), "first_fill_us_p50": statistics.median(first_fill_us),
            "accept_us_p50": statistics.median(accept_us), "tokens": len(fill_us)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder or GGUF (default: embedded)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec, vocab_size, eos = _load_tokenizer(args.model)
    print(f"# {platform.processor() or platform.machine()}, vocab {vocab_size}, eos {eos}")
    for build in (_xgrammar, _llguidance):
        engine, setup = build(spec, vocab_size, eos)
        r = measure(engine, spec, eos, args.repeat)
        compiled = ", ".join(f"{k} {v:.1f}" for k, v in r["compile_ms"].items())
        print(f"{engine.name:11s} tokenizer setup {setup * 1e3:7.1f} ms | compile ms: {compiled}"
              f" | mask us p50 {r['fill_us_p50']:.1f} p90 {r['fill_us_p90']:.1f} "
              f"max {r['fill_us_max']:.0f} (first token p50 {r['first_fill_us_p50']:.0f})"
              f" | accept us p50 {r['accept_us_p50']:.1f} | {r['tokens']} tokens")


if __name__ == "__main__":
    main()
