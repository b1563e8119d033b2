"""The `baton` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid

from backends.errors import BatonError


def _env(name: str, default):
    return os.environ.get(f"BATON_{name.upper()}", default)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=_env("model", None),
                        help="Hugging Face model folder or .gguf file "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=_env("dtype", "auto"),
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: bfloat16 where the hardware has native bf16 "
                             "(CUDA, AVX-512 BF16 / AMX CPUs), else float32")
    parser.add_argument("--device", default=_env("device", "cpu"),
                        help="cpu, cuda or cuda:N")
    parser.add_argument("--block-size", type=int, default=int(_env("block_size", 16)))
    parser.add_argument("--kv-cache-memory", default=_env("kv_cache_memory", None),
                        help="KV cache budget, e.g. 2GiB (default: 2GiB on CPU, "
                             "the memory left after the weights on CUDA)")
    parser.add_argument("--max-model-len", type=int,
                        default=_int_or_none(_env("max_model_len", None)))
    parser.add_argument("--max-num-seqs", type=int, default=int(_env("max_num_seqs", 32)))
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=int(_env("max_num_batched_tokens", 512)))
    parser.add_argument("--enable-prefix-caching", "--prefix-caching",
                        dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                        default=_env("prefix_caching", "1").lower() not in ("0", "false", "no"),
                        help="reuse the KV cache of prompt prefixes already computed (on by "
                             "default; --no-prefix-caching turns it off)")
    parser.add_argument("--scheduling-policy", default=_env("scheduling_policy", "fcfs"),
                        choices=["fcfs", "priority"],
                        help="fcfs: first come, first served; priority: by the request's "
                             "priority field, lower first, ties by arrival")
    parser.add_argument("--long-prefill-token-threshold", type=int,
                        default=_int_or_none(_env("long_prefill_token_threshold", None)),
                        help="prompts with more tokens than this left to compute are long: "
                             "one at a time, and at most this many tokens per step until "
                             "other requests have had theirs (default: a quarter of "
                             "--max-num-batched-tokens)")
    parser.add_argument("--threads", type=int, default=_int_or_none(_env("threads", None)),
                        help="CPU threads for the model's math (default: torch's, one "
                             "per core)")
    parser.add_argument("--quantization", default=_env("quantization", "none"),
                        choices=["none", "int8", "int4", "gguf"],
                        help="weight-only quantization of the linear layers: int8 per "
                             "channel, int4 in groups, or gguf (keep a GGUF file's Q8_0 / "
                             "Q4_0 / Q4_1 blocks); see docs/quantization.md")
    parser.add_argument("--quantization-group-size", type=int, choices=[32, 64, 128],
                        default=int(_env("quantization_group_size", 128)),
                        help="int4 group size along the input dimension (default 128)")
    parser.add_argument("--cpu-kind", default=_env("cpu_kind", "auto"),
                        choices=["auto", "portable", "avx2", "avx512", "avx512_bf16"],
                        help="run the path of this CPU kind (default: the CPU's own); a "
                             "lower kind than the CPU offers can be forced, e.g. to check it")
    parser.add_argument("--no-fast-paths", dest="fast_paths", action="store_false",
                        default=_env("fast_paths", "1") not in ("0", "false", "no"),
                        help="portable torch ops only: no native kernels, no oneDNN "
                             "prepacking (the reference path; BATON_FAST_PATHS=0)")


def _int_or_none(value):
    return None if value in (None, "") else int(value)


def engine_args_from(ns: argparse.Namespace, **overrides):
    from service.config import EngineArgs, parse_bytes
    return EngineArgs(
        model=ns.model, dtype=ns.dtype, device=ns.device, block_size=ns.block_size,
        kv_cache_memory=parse_bytes(ns.kv_cache_memory) if ns.kv_cache_memory else None,
        max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        quantization=ns.quantization, quantization_group_size=ns.quantization_group_size,
        threads=ns.threads, enable_prefix_caching=ns.enable_prefix_caching,
        scheduling_policy=ns.scheduling_policy,
        long_prefill_token_threshold=ns.long_prefill_token_threshold,
        fast_paths=ns.fast_paths, cpu_kind=ns.cpu_kind,
        progress=sys.stderr.isatty(), **overrides)


def cmd_generate(ns: argparse.Namespace) -> int:
    from backends.interface import SamplingParams
    from service.chat_template import render_chat
    from service.engine_factory import create_engine

    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                            top_p=ns.top_p, top_k=ns.top_k, seed=ns.seed)
    core = create_engine(engine_args_from(ns, seed=ns.seed))
    tok = core.tokenizer
    if ns.chat:
        text = render_chat(tok.chat_template, [{"role": "user", "content": ns.prompt}],
                           bos_token=tok.spec.bos_token, eos_token=tok.spec.eos_token)
        prompt_ids = tok.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tok.encode(ns.prompt)
    core.add_request(uuid.uuid4().hex, prompt_ids, params)
    reason = None
    while core.has_unfinished():
        for out in core.step().outputs:
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.finished:
                reason = out.finish_reason
    sys.stdout.write("\n")
    logging.getLogger("baton").info("finished: %s", reason)
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from backends.loader import load_model
    from backends.loader.export import export_hf_folder
    from backends.device import DTYPES

    dtype = DTYPES[ns.dtype]
    loaded = load_model(ns.model, dtype=dtype, progress=sys.stderr.isatty())
    out = export_hf_folder(loaded, ns.output, dtype)
    logging.getLogger("baton").info("wrote %s", out)
    return 0


def _float_or_none(value):
    return None if value in (None, "", "0", 0) else float(value)


def cmd_serve(ns: argparse.Namespace) -> int:
    from service.config import ServerConfig, parse_bytes
    from service.serve import run_server

    config = ServerConfig(
        host=ns.host, port=ns.port, served_model_name=ns.served_model_name,
        api_key=ns.api_key, max_waiting_requests=ns.max_waiting_requests,
        max_waiting_tokens=ns.max_waiting_tokens,
        request_timeout=_float_or_none(ns.request_timeout), drain_timeout=ns.drain_timeout,
        max_body_bytes=parse_bytes(ns.max_body_size),
        default_max_tokens=ns.default_max_tokens,
        unhealthy_after_failed_steps=ns.unhealthy_after_failed_steps,
        step_timeout=_float_or_none(ns.step_timeout),
        body_read_timeout=ns.body_read_timeout, max_connections=ns.max_connections,
        metrics_public=ns.metrics_public,
        trust_message_control_tokens=ns.trust_message_control_tokens,
        otlp_traces_endpoint=ns.otlp_traces_endpoint, trace_detail=ns.trace_detail,
        log_prompts=ns.log_prompts)
    return run_server(engine_args_from(ns, seed=ns.seed), config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton", description="Baton LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    add_engine_flags(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_flags(srv)
    srv.add_argument("--host", default=_env("host", "127.0.0.1"))
    srv.add_argument("--port", type=int, default=int(_env("port", 8000)))
    srv.add_argument("--served-model-name", default=_env("served_model_name", None),
                     help="model id clients use (default: the model's own name)")
    srv.add_argument("--api-key", default=_env("api_key", None),
                     help="require Authorization: Bearer KEY on every route but /health "
                          "(and /metrics with --metrics-public)")
    srv.add_argument("--max-waiting-requests", type=int,
                     default=int(_env("max_waiting_requests", 256)),
                     help="requests beyond this many waiting get 429")
    srv.add_argument("--max-waiting-tokens", type=int,
                     default=int(_env("max_waiting_tokens", 262144)),
                     help="prompt tokens beyond this many waiting get 429")
    srv.add_argument("--request-timeout", default=_env("request_timeout", "600"),
                     help="seconds; a request past it ends with what it has (default 600, "
                          "as long as OpenAI's SDK waits; 0: no limit)")
    srv.add_argument("--default-max-tokens", type=int,
                     default=_int_or_none(_env("default_max_tokens", None)),
                     help="max_tokens for requests that send none (default: OpenAI's, 16 "
                          "for completions and the rest of the context for chat)")
    srv.add_argument("--drain-timeout", type=float, default=float(_env("drain_timeout", 30)),
                     help="seconds to let in-flight requests finish on SIGTERM")
    srv.add_argument("--max-body-size", default=_env("max_body_size", "8MiB"))
    srv.add_argument("--body-read-timeout", type=float,
                     default=float(_env("body_read_timeout", 60)),
                     help="seconds for a request body to arrive; a slower one gets 408")
    srv.add_argument("--max-connections", type=int,
                     default=int(_env("max_connections", 1000)),
                     help="open client connections; one more is refused with 503")
    srv.add_argument("--metrics-public", action="store_true",
                     default=_env("metrics_public", "") in ("1", "true", "yes"),
                     help="serve /metrics without the API key (for scrapers)")
    srv.add_argument("--trust-message-control-tokens", action="store_true",
                     default=_env("trust_message_control_tokens", "") in ("1", "true", "yes"),
                     help="let control-token text in chat messages (<|im_end|> ...) act "
                          "as control tokens; only for trusted clients")
    srv.add_argument("--unhealthy-after-failed-steps", type=int,
                     default=int(_env("unhealthy_after_failed_steps", 3)),
                     help="/health answers 503 after this many engine steps in a row "
                          "failed for every request in them")
    srv.add_argument("--step-timeout", default=_env("step_timeout", None),
                     help="seconds after which a backend step counts as hung: it is "
                          "abandoned and its requests run again without the one that "
                          "hangs (default: never)")
    srv.add_argument("--seed", type=int, default=_int_or_none(_env("seed", None)))
    srv.add_argument("--otlp-traces-endpoint", default=_env("otlp_traces_endpoint", None),
                     help="OTLP endpoint for traces (OTEL_EXPORTER_OTLP_* work too); "
                          "with none configured, tracing is off")
    srv.add_argument("--trace-detail", default=_env("trace_detail", "request"),
                     choices=["none", "request", "step"],
                     help="request: a span tree per request; step: also a span per "
                          "engine step, linked to the requests it served")
    srv.add_argument("--log-prompts", action="store_true",
                     default=_env("log_prompts", "") in ("1", "true", "yes"),
                     help="include prompts and outputs in request log lines")
    srv.add_argument("--log-format", default=_env("log_format", "auto"),
                     choices=["auto", "json", "console"])
    srv.set_defaults(func=cmd_serve)

    exp = sub.add_parser("export", help="write a model (e.g. a GGUF file) as a Hugging Face "
                                        "folder, dequantized, for peers that need one")
    exp.add_argument("--model", default=_env("model", None),
                     help="Hugging Face folder or .gguf file (default: the embedded model)")
    exp.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    exp.add_argument("output", help="folder to write")
    exp.set_defaults(func=cmd_export)

    ns = parser.parse_args(argv)
    from telemetry.logs import configure_logging
    log_format = getattr(ns, "log_format", "auto")
    configure_logging(json=None if log_format == "auto" else log_format == "json")
    try:
        return ns.func(ns)
    except BatonError as exc:
        print(f"baton: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"baton: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
