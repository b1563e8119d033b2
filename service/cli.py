"""The `baton` command.

Every flag has a one-line help that ends with its default and the BATON_*
environment variable that sets it (`--max-num-seqs` <-> BATON_MAX_NUM_SEQS);
a flag on the command line wins over the variable.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import uuid

from backends.errors import BatonError
from service.config import parse_bytes, parse_count

MODEL_HELP = ("a Hugging Face model folder, a .gguf file, or a Hugging Face Hub id "
              "(org/name; org/name:TAG picks the GGUF file whose name holds TAG)")


def _env_name(dest: str) -> str:
    return f"BATON_{dest.upper()}"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends '(default: X; env BATON_Y)' to every option's help. A help
    text that already says its default (for defaults worth a sentence) keeps
    its own wording."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        parts = []
        if "default:" not in text:
            default = action.default
            if isinstance(default, (list, tuple)):
                default = " ".join(map(str, default)) or "none"
            parts.append(f"default: {'none' if default is None else default}")
        env = getattr(action, "env_var", None)
        if env:
            parts.append(f"env {env}")
        return f"{text} ({'; '.join(parts)})" if parts else text


def _flag(parser: argparse.ArgumentParser, name: str, default, help: str, *,
          convert=None, env: bool = True, env_name: str | None = None,
          **kwargs) -> argparse.Action:
    """Add ``--name`` whose default comes from BATON_<NAME> (or ``env_name``)
    when set; ``convert`` parses both the command-line value and the
    variable's."""
    dest = kwargs.get("dest") or name.lstrip("-").replace("-", "_")
    variable = env_name or _env_name(dest)
    if env:
        raw = os.environ.get(variable)
        if raw not in (None, ""):
            if kwargs.get("action") in ("store_true", "store_false",
                                        argparse.BooleanOptionalAction):
                default = raw.strip().lower() in ("1", "true", "yes", "on")
            elif kwargs.get("nargs") in ("+", "*"):
                default = _split_list(raw)
            else:
                try:
                    default = convert(raw) if convert else raw
                except (argparse.ArgumentTypeError, ValueError) as exc:
                    parser.error(f"{variable}={raw!r}: {exc}")
    if convert is not None:
        kwargs["type"] = convert
    action = parser.add_argument(*name.split(), default=default, help=help, **kwargs)
    action.env_var = variable if env else None
    return action


def _speculative(raw: str) -> str:
    """--speculative-config: checked here (a usage error naming what is
    wrong), kept as its JSON text."""
    from scheduler.speculative import SpeculativeConfig
    try:
        SpeculativeConfig.parse(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return raw


def _split_list(raw: str) -> list[str]:
    """A JSON list ('["a", "b"]', as vLLM takes), or words split on commas
    and spaces."""
    raw = raw.strip()
    if raw.startswith("["):
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {raw!r} ({exc})") from None
        return [str(v) for v in values]
    return [part for part in raw.replace(",", " ").split() if part]


def _count(text: str) -> int:
    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _group_size(text: str) -> int | None:
    return None if text == "auto" else int(text)


def _optional_int(text: str) -> int | None:
    return None if text in ("", "none") else int(text)


def _optional_path(text: str) -> str | None:
    return None if text.strip().lower() in ("", "none", "off") else os.path.expanduser(text)


def _default_conversion_cache() -> str:
    # backends/loader/conversion_cache.py; computed here so that --help needs no torch.
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "baton", "converted")


def _seconds_or_none(text: str) -> float | None:
    return None if text in ("", "0", "none") else float(text)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "--model", None, f"{MODEL_HELP}; the same as the MODEL argument "
          f"(default: the embedded SmolLM2-135M-Instruct GGUF)")
    _flag(parser, "--revision", None, "Hub ids: the branch, tag or commit to fetch "
          "(default: main)")
    _flag(parser, "--download-dir", None, "Hub ids: the cache folder to download into and "
          "load from (default: huggingface_hub's, HF_HOME/hub)")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    _flag(parser, "--dtype", "auto", "float32, bfloat16, float16, or auto: on CPUs bfloat16 "
          "weights (with float32 arithmetic where the CPU has no native bf16; float32 for "
          "quantized linears there), on CUDA bfloat16 (float16 without bf16 support)",
          choices=["auto", "float32", "bfloat16", "float16"])
    _flag(parser, "--device", "cpu", "cpu, cuda or cuda:N")
    _flag(parser, "--block-size", 16, "tokens per KV cache block", convert=int)
    _flag(parser, "--kv-cache-memory", None, "KV cache budget, e.g. 2GiB or 512MiB "
          "(default: 2GiB on CPU, the memory left after the weights on CUDA)",
          convert=_bytes)
    _flag(parser, "--max-model-len", None, "prompt + output limit in tokens; 32k = 32000, "
          "32K = 32768 (default: the model's context, lowered to what the KV cache holds)",
          convert=_count)
    _flag(parser, "--max-num-seqs", 32, "requests decoded together in one step",
          convert=_count)
    _flag(parser, "--max-num-batched-tokens", 512, "per-step token budget (decode tokens "
          "plus prefill chunks)", convert=_count)
    _flag(parser, "--enable-prefix-caching --prefix-caching", True, "reuse the KV cache of "
          "prompt prefixes already computed (--no-prefix-caching turns it off)",
          dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
          env_name="BATON_PREFIX_CACHING")
    _flag(parser, "--scheduling-policy", "fcfs", "fcfs: first come, first served; priority: "
          "by the request's priority field, lower first, ties by arrival",
          choices=["fcfs", "priority"])
    _flag(parser, "--long-prefill-token-threshold", None, "prompts with more tokens than "
          "this left to compute are long: one at a time, and at most this many tokens per "
          "step until other requests have had theirs (default: a quarter of "
          "--max-num-batched-tokens)", convert=_count)
    _flag(parser, "--prefill-only-step-tokens", 2048, "a step that holds no decodes (a "
          "burst reaching an idle server) may admit short prompts up to this many tokens; "
          "long prompts keep --max-num-batched-tokens (at or below it: off)", convert=_count)
    _flag(parser, "--threads", None, "CPU threads for the model's math (default: adaptive, "
          "one per core that other processes leave free)", convert=_optional_int)
    _flag(parser, "--quantization", "none", "weight-only quantization of the linear "
          "layers: int8 per channel, int4 in groups, or gguf (keep a GGUF file's Q8_0 / "
          "Q4_0 / Q4_1 blocks); see docs/quantization.md",
          choices=["none", "int8", "int4", "gguf"])
    _flag(parser, "--quantization-group-size", "auto", "int4 group size along the input "
          "dimension: 32, 64, 128, or auto (the largest that divides every projection's "
          "input width; 32 for a GGUF already 4-bit in groups of 32; the load log says "
          "which)", convert=_group_size, choices=[None, 32, 64, 128], metavar="{auto,32,64,128}")
    _flag(parser, "--cpu-kind", "auto", "run the path of this CPU kind (default: the CPU's "
          "own); a lower kind than the CPU offers can be forced, e.g. to check it",
          choices=["auto", "portable", "avx2", "avx512", "avx512_bf16"])
    _flag(parser, "--no-fast-paths", True, "portable torch ops only: no native kernels, no "
          "oneDNN prepacking (the reference path; BATON_FAST_PATHS=0; default: fast paths "
          "on)", dest="fast_paths", action="store_false", env_name="BATON_FAST_PATHS")
    _flag(parser, "--speculative-config", None, "speculative decoding, as vLLM spells it: "
          "JSON such as '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
          "\"prompt_lookup_max\": 5}' or '{\"method\": \"draft_model\", \"model\": "
          "PATH, \"num_speculative_tokens\": 4}' (docs/serving.md)", convert=_speculative)
    _flag(parser, "--compile", None, "run token-row steps (decodes, verification rows, "
          "short prefill chunks) through the model's forward compiled by torch.compile: "
          "the default wherever "
          "the plan can (native kernels and a C++ compiler); the flag overrides "
          "BATON_COMPILE=0. The first start of a model compiles (about a minute on two "
          "cores), later ones reuse the cache", action="store_true", env_name="BATON_COMPILE")
    _flag(parser, "--enforce-eager", False, "never compile, even with --compile or "
          "BATON_COMPILE=1: a start in seconds, slower steps (docs/serving.md; vLLM's flag; "
          "BATON_ENFORCE_EAGER=1)",
          action="store_true", env_name="BATON_ENFORCE_EAGER")
    _flag(parser, "--generation-config", "auto", "sampling defaults: auto (the model's "
          "generation_config.json), vllm (none: the request's values, else OpenAI's), or "
          "a folder holding a generation_config.json")
    _flag(parser, "--chat-template", None, "a Jinja chat template (a file, or the template "
          "itself) to use instead of the model's own")
    _flag(parser, "--conversion-cache", _default_conversion_cache(), "a folder where a GGUF "
          "model's conversion to the serving dtype is kept, so later starts read it instead "
          "of converting again (one entry per file and dtype, files up to 4 GiB converted); "
          "none: convert at every start", convert=_optional_path)
    from service.vllm_flags import add_vllm_engine_flags
    add_vllm_engine_flags(parser)
    from service.scale_flags import add_parallel_flags
    add_parallel_flags(parser)


def _model_from(ns: argparse.Namespace) -> None:
    """MODEL as an argument or --model; both may be given only if they agree."""
    positional = getattr(ns, "model_arg", None)
    if positional is not None:
        if ns.model is not None and ns.model != positional and \
                ns.model != os.environ.get("BATON_MODEL"):
            raise BatonError(f"two models given: {positional!r} and --model {ns.model!r}")
        ns.model = positional


def engine_args_from(ns: argparse.Namespace, **overrides):
    from service.config import EngineArgs
    return EngineArgs(
        model=ns.model, dtype=ns.dtype, device=ns.device, block_size=ns.block_size,
        kv_cache_memory=ns.kv_cache_memory,
        max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        quantization=ns.quantization, quantization_group_size=ns.quantization_group_size,
        threads=ns.threads, enable_prefix_caching=ns.enable_prefix_caching,
        scheduling_policy=ns.scheduling_policy,
        long_prefill_token_threshold=ns.long_prefill_token_threshold,
        prefill_only_step_tokens=ns.prefill_only_step_tokens,
        fast_paths=ns.fast_paths, cpu_kind=ns.cpu_kind, compile=ns.compile,
        enforce_eager=ns.enforce_eager,
        speculative_config=ns.speculative_config,
        revision=ns.revision, download_dir=ns.download_dir,
        generation_config=ns.generation_config, parallel=_parallel_config(ns),
        chat_template=ns.chat_template, conversion_cache=ns.conversion_cache, progress=True,
        tokenizer=ns.tokenizer, gpu_memory_utilization=ns.gpu_memory_utilization,
        max_logprobs=ns.max_logprobs, **overrides)


def _parallel_config(ns: argparse.Namespace):
    from service.scale_flags import parallel_config_from
    return parallel_config_from(ns)


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
    loaded = load_model(ns.model, dtype=dtype, progress=True, revision=ns.revision,
                        download_dir=ns.download_dir)
    out = export_hf_folder(loaded, ns.output, dtype)
    logging.getLogger("baton").info("wrote %s", out)
    return 0


def _api_key(ns: argparse.Namespace) -> str | None:
    """--api-key / BATON_API_KEY, else the first line of --api-key-file (a
    Docker or Kubernetes secret)."""
    if ns.api_key:
        return ns.api_key
    if ns.api_key_file:
        try:
            with open(ns.api_key_file, encoding="utf-8") as handle:
                key = handle.readline().strip()
        except OSError as exc:
            raise BatonError(f"--api-key-file {ns.api_key_file}: {exc}") from None
        if not key:
            raise BatonError(f"--api-key-file {ns.api_key_file} is empty")
        return key
    return None


def cmd_build_kernels(ns: argparse.Namespace) -> int:
    from backends import kernels
    from backends.execution import CpuFeatures

    path, reason = kernels.load()
    if path is None:
        print(f"baton: error: the native CPU kernels cannot be built: {reason}", file=sys.stderr)
        return 2
    print(f"{path} (this CPU runs the {CpuFeatures.detect().describe()} kernels)")
    return 0


def server_config_from(ns: argparse.Namespace):
    from service.config import ServerConfig
    return ServerConfig(
        host=ns.host, port=ns.port, served_model_names=tuple(ns.served_model_name or ()),
        api_key=_api_key(ns), max_waiting_requests=ns.max_waiting_requests,
        max_waiting_tokens=ns.max_waiting_tokens,
        request_timeout=ns.request_timeout, drain_timeout=ns.drain_timeout,
        max_body_bytes=ns.max_body_size,
        default_max_tokens=ns.default_max_tokens,
        unhealthy_after_failed_steps=ns.unhealthy_after_failed_steps,
        step_timeout=ns.step_timeout,
        body_read_timeout=ns.body_read_timeout, max_connections=ns.max_connections,
        idle_timeout=ns.idle_timeout,
        metrics_public=ns.metrics_public,
        trust_message_control_tokens=ns.trust_message_control_tokens,
        otlp_traces_endpoint=ns.otlp_traces_endpoint, trace_detail=ns.trace_detail,
        log_prompts=ns.log_prompts, log_requests=not ns.disable_log_requests,
        allowed_origins=tuple(ns.allowed_origins or ()),
        tool_call_parser=ns.tool_call_parser,
        trust_request_chat_template=ns.trust_request_chat_template,
        responses_store_bytes=ns.responses_store_size,
        responses_store_ttl=ns.responses_store_ttl)


def parse_serve_argv(argv: list[str]):
    """``baton serve`` arguments -> (EngineArgs, ServerConfig), e.g. for each
    Ray Serve replica."""
    ns = parse_argv(["serve", *argv])
    _model_from(ns)
    return engine_args_from(ns, seed=ns.seed), server_config_from(ns)


def cmd_serve(ns: argparse.Namespace) -> int:
    from service.scale_flags import check_compatible, replica_set_from, wants_replicas
    from service.serve import run_server

    config = server_config_from(ns)
    engine_args = engine_args_from(ns, seed=ns.seed)
    check_compatible(engine_args, config)
    if engine_args.parallel.node_rank > 0:
        # Another node of a multi-node tensor-parallel engine: only its ranks.
        from service.tensor_parallel import run_node
        return run_node(engine_args)
    if wants_replicas(ns):
        from service.ray_launch import run_replicas
        return run_replicas(engine_args, config, replica_set_from(ns, engine_args))
    return run_server(engine_args, config)


def _add_serve_flags(srv: argparse.ArgumentParser) -> None:
    _flag(srv, "--host", "127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    _flag(srv, "--port", 8000, "port to listen on", convert=int)
    _flag(srv, "--served-model-name", None, "the model id(s) clients send as `model`; the "
          "first is the one responses and metrics carry (default: the Hub id, folder name "
          "or GGUF file name without its quantization tag)", nargs="+", metavar="NAME")
    _flag(srv, "--api-key", None, "require Authorization: Bearer KEY on every route but "
          "/health (and /metrics with --metrics-public)")
    _flag(srv, "--api-key-file", None, "read the API key from this file's first line "
          "(a Docker or Kubernetes secret); --api-key wins")
    _flag(srv, "--allowed-origins", None, "CORS: browser origins allowed to call the API "
          "(e.g. https://app.example.com, or * for any); several, comma-separated or a "
          "JSON list (default: none, no CORS headers)", nargs="+", metavar="ORIGIN")
    _flag(srv, "--max-waiting-requests", 256, "requests beyond this many waiting get 429",
          convert=int)
    _flag(srv, "--max-waiting-tokens", 262144, "prompt tokens beyond this many waiting get "
          "429", convert=_count)
    _flag(srv, "--request-timeout", "600", "seconds; a request past it ends with what it "
          "has (default: 600, as long as OpenAI's SDK waits; 0: no limit)",
          convert=_seconds_or_none)
    _flag(srv, "--default-max-tokens", None, "max_tokens for requests that send none "
          "(default: OpenAI's, 16 for completions and the rest of the context for chat)",
          convert=_optional_int)
    _flag(srv, "--drain-timeout", 30.0, "seconds to let in-flight requests finish on "
          "SIGTERM", convert=float)
    _flag(srv, "--max-body-size", "8MiB", "larger request bodies get 413", convert=_bytes)
    _flag(srv, "--body-read-timeout", 60.0, "seconds for a request body to arrive; a slower "
          "one gets 408", convert=float)
    _flag(srv, "--max-connections", 1000, "open client connections; at the limit a new "
          "one displaces the longest idle one; when every connection has a request in "
          "progress, a new one is answered only on /health (anything else: 503)",
          convert=int)
    _flag(srv, "--idle-timeout", 15.0, "seconds a connection may stay open without a "
          "request in progress (before its first request's headers are complete, and "
          "between requests)", convert=float)
    _flag(srv, "--metrics-public", False, "serve /metrics without the API key (for "
          "scrapers)", action="store_true")
    _flag(srv, "--trust-message-control-tokens", False, "let control-token text in chat "
          "messages (<|im_end|> ...) act as control tokens; only for trusted clients",
          action="store_true")
    _flag(srv, "--unhealthy-after-failed-steps", 3, "/health answers 503 after this many "
          "engine steps in a row failed for every request in them", convert=int)
    _flag(srv, "--step-timeout", None, "seconds after which a backend step counts as hung: "
          "it is abandoned and its requests run again without the one that hangs "
          "(default: never)", convert=_seconds_or_none)
    _flag(srv, "--seed", None, "seed of the sampler's generator for requests without a "
          "seed (default: random)", convert=_optional_int)
    _flag(srv, "--otlp-traces-endpoint", None, "OTLP endpoint for traces (OTEL_EXPORTER_"
          "OTLP_* work too; default: none, tracing off unless those are set)")
    _flag(srv, "--trace-detail", "request", "request: a span tree per request; step: also a "
          "span per engine step, linked to the requests it served; none: no spans",
          choices=["none", "request", "step"])
    _flag(srv, "--log-prompts", False, "include prompts and outputs in request log lines",
          action="store_true")
    _flag(srv, "--disable-log-requests", False, "no log line per finished request",
          action="store_true")
    _flag(srv, "--log-format", "auto", "auto (JSON unless stderr is a terminal), json or "
          "console", choices=["auto", "json", "console"])
    from service.vllm_flags import tool_call_parser
    _flag(srv, "--tool-call-parser", None, "how the model writes tool calls: hermes, "
          "llama3_json (vLLM's llama4_json too) or generic (default: read from the chat "
          "template; generic when it has no tool support)", convert=tool_call_parser,
          metavar="{hermes,llama3_json,llama4_json,generic}")
    _flag(srv, "--trust-request-chat-template", False, "accept a chat_template field in "
          "requests", action="store_true")
    _flag(srv, "--responses-store-size", "128MiB", "memory for stored responses (the "
          "Responses API's store and previous_response_id); the oldest go first beyond it; "
          "0: keep none", convert=_bytes)
    _flag(srv, "--responses-store-ttl", 3600.0, "seconds a stored response is kept",
          convert=float)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Baton LLM inference server",
                                     formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                         formatter_class=_HelpFormatter,
                         description="Serve MODEL with the OpenAI-compatible HTTP API.")
    srv.add_argument("model_arg", nargs="?", metavar="MODEL",
                     help=f"{MODEL_HELP} (default: --model, else the embedded model)")
    add_engine_flags(srv)
    _add_serve_flags(srv)
    from service.scale_flags import add_replica_flags
    add_replica_flags(srv)
    from service.vllm_flags import add_vllm_serve_flags
    add_vllm_serve_flags(srv)
    srv.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout",
                         formatter_class=_HelpFormatter,
                         description="Generate text from PROMPT with MODEL, without a server.")
    gen.add_argument("model_arg", nargs="?", metavar="MODEL",
                     help=f"{MODEL_HELP} (default: --model, else the embedded model)")
    gen.add_argument("prompt", help="the prompt text")
    add_engine_flags(gen)
    _flag(gen, "--max-tokens", 128, "tokens to generate at most", convert=int, env=False)
    _flag(gen, "--temperature", 0.0, "sampling temperature; 0 is greedy", convert=float,
          env=False)
    _flag(gen, "--top-p", 1.0, "nucleus sampling mass", convert=float, env=False)
    _flag(gen, "--top-k", -1, "sample among the k likeliest tokens; -1: all", convert=int,
          env=False)
    _flag(gen, "--seed", None, "sampling seed (default: random)", convert=_optional_int,
          env=False)
    _flag(gen, "--chat", False, "apply the model's chat template to the prompt",
          action="store_true", env=False)
    gen.set_defaults(func=cmd_generate)

    exp = sub.add_parser("export", help="write a model (e.g. a GGUF file) as a Hugging Face "
                                        "folder, dequantized, for peers that need one",
                         formatter_class=_HelpFormatter,
                         description="Write MODEL as a Hugging Face folder OUTPUT.")
    exp.add_argument("model_arg", nargs="?", metavar="MODEL",
                     help=f"{MODEL_HELP} (default: --model, else the embedded model)")
    exp.add_argument("output", help="folder to write")
    add_model_flags(exp)
    _flag(exp, "--dtype", "bfloat16", "dtype of the written weights",
          choices=["float32", "bfloat16", "float16"], env=False)
    exp.set_defaults(func=cmd_export)

    bk = sub.add_parser("build-kernels", formatter_class=_HelpFormatter,
                        help="build the native CPU kernels now (every CPU kind; they are "
                             "otherwise built on first start) into $BATON_KERNEL_CACHE")
    bk.set_defaults(func=cmd_build_kernels)
    return parser


def parse_argv(argv: list[str]) -> argparse.Namespace:
    """The command's own parser reads its arguments, options anywhere among
    the positionals (``baton generate MODEL --dtype float32 PROMPT``), and its
    errors print that command's usage, not the top-level one."""
    parser = build_parser()
    commands = _subcommands(parser)
    at = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), None)
    if at is None or argv[at] not in commands:
        return parser.parse_args(argv)  # no command, or an unknown one: argparse says so
    return commands[argv[at]].parse_intermixed_args(
        argv[:at] + argv[at + 1:], namespace=argparse.Namespace(command=argv[at]))


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def main(argv: list[str] | None = None) -> int:
    ns = parse_argv(sys.argv[1:] if argv is None else list(argv))
    from telemetry.logs import configure_logging
    log_format = getattr(ns, "log_format", "auto")
    configure_logging(json=None if log_format == "auto" else log_format == "json")
    # Before torch starts its threads (backends/host_malloc.py).
    from backends.host_malloc import tune_malloc
    tune_malloc()
    try:
        _model_from(ns)
        return ns.func(ns)
    except BatonError as exc:
        print(f"baton: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"baton: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
