"""vLLM's command-line flags that deployment scripts pass to ``vllm serve``,
as ``baton serve`` takes them (docs/serving.md, "vLLM's flags").

Each flag is honoured where Baton has its meaning (``--tool-call-parser``
picks the tool format, ``--gpu-memory-utilization`` sizes the KV cache on
CUDA, ``--tokenizer`` loads another tokenizer, ``--max-logprobs`` bounds
logprobs), accepted where Baton already does what it asks
(``--enable-auto-tool-choice``, ``--trust-remote-code``), and refused with
Baton's equivalent where it has no meaning here: never silently dropped.
"""

from __future__ import annotations

import argparse

from service.tool_calls import GENERIC, HERMES, LLAMA3_JSON

# vLLM's parser names (and Baton's own) -> the format Baton writes and parses.
TOOL_PARSERS = {HERMES: HERMES, LLAMA3_JSON: LLAMA3_JSON, "llama4_json": LLAMA3_JSON,
                GENERIC: GENERIC}

# vLLM flags Baton has no meaning for, and what to use instead.
_WITHOUT_MEANING = {
    "--swap-space": "Baton recomputes a preempted request instead of swapping its KV "
                    "cache to host memory; size the cache with --kv-cache-memory",
    "--kv-cache-dtype": "the KV cache is kept in the model's dtype; choose it with --dtype",
    "--pipeline-parallel-size -pp": "pipeline parallelism is not supported; shard the model "
                                    "with --tensor-parallel-size",
    "--uvicorn-log-level": "Baton does not run on uvicorn; --log-format sets its log format "
                           "and --disable-log-requests drops the line per request",
    "--enable-lora --lora-modules": "LoRA adapters are not supported; merge the adapter "
                                    "into the weights and serve that folder",
}


def tool_call_parser(name: str) -> str:
    """``--tool-call-parser``: vLLM's parser name (or Baton's) -> Baton's format."""
    fmt = TOOL_PARSERS.get(name)
    if fmt is None:
        raise argparse.ArgumentTypeError(
            f"{name!r} is not a tool-call format Baton parses: it parses hermes "
            f"(<tool_call> blocks: Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.1-3.3; "
            f"vLLM's llama4_json is the same format) and generic (any template: one JSON "
            f"reply enforced by the grammar engine)")
    return fmt


def gpu_memory_utilization(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text}")
    return value


def max_logprobs(text: str) -> int:
    value = int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (the vocabulary size) or >= 0, got {text}")
    return value


class _Refused(argparse.Action):
    """A vLLM flag without a meaning in Baton: an error that says what to use."""

    def __init__(self, option_strings, dest, why: str = "", **kwargs) -> None:
        self.why = why
        super().__init__(option_strings, dest, nargs="?", default=None,
                         help=f"vLLM's flag, not taken: {why}", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string}: {self.why}")


def add_vllm_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Engine flags with vLLM's names (``baton serve`` and ``baton generate``)."""
    from service.cli import _flag
    _flag(parser, "--tokenizer", None, "a tokenizer from elsewhere: a Hugging Face folder "
          "holding tokenizer.json, a .gguf file, or a Hub id (default: the model's own)")
    _flag(parser, "--gpu-memory-utilization", None, "CUDA: the fraction of the device's "
          "memory Baton may fill, weights and KV cache together (as vLLM's flag); the KV "
          "cache gets what is left of it after the weights (default: 0.9 of the memory "
          "free after the weights; --kv-cache-memory sets a size instead)",
          convert=gpu_memory_utilization)
    _flag(parser, "--max-logprobs", 20, "the most logprobs (top alternatives per token) a "
          "request may ask for, completions' logprobs and chat's top_logprobs alike; -1: "
          "the vocabulary size", convert=max_logprobs)


def add_vllm_serve_flags(parser: argparse.ArgumentParser) -> None:
    """``baton serve`` flags with vLLM's names and no work of their own."""
    from service.cli import _flag
    group = parser.add_argument_group("vLLM's flags (docs/serving.md)")
    _flag(group, "--enable-auto-tool-choice", False, "accepted as in vLLM; no effect: Baton "
          "always lets the model call tools under tool_choice auto", action="store_true")
    _flag(group, "--trust-remote-code", False, "accepted as in vLLM; no effect: Baton never "
          "runs code from a model repository (it reads config.json, tokenizer files and "
          "weights only), so there is no remote code to trust", action="store_true")
    for names, why in _WITHOUT_MEANING.items():
        group.add_argument(*names.split(), action=_Refused, why=why)
