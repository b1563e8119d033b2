"""The `baton` command line: every flag documents its default, counts and
sizes take suffixes as vLLM's do, MODEL is an argument as in `vllm serve`,
BATON_* variables set defaults, and bad values are refused with the flag's
name instead of a traceback."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from service.cli import build_parser, main
from service.config import parse_bytes, parse_count

ROOT = Path(__file__).resolve().parents[1]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["serve", "generate", "export"])
def test_help_gives_every_flag_a_line_and_its_default(command):
    sub = _subparsers(build_parser())[command]
    help_text = sub.format_help()
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.dest} has no help"
        if action.option_strings:
            rendered = sub._get_formatter()._get_help_string(action)
            assert "default:" in rendered, f"{command} {action.option_strings[0]}: {rendered}"
            assert action.option_strings[0] in help_text
    if command == "serve":
        assert "(default: 32; env BATON_MAX_NUM_SEQS)" in " ".join(help_text.split())


def test_the_console_script_prints_help():
    done = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "--max-model-len" in done.stdout and "MODEL" in done.stdout


@pytest.mark.parametrize("text,value", [
    ("4096", 4096), ("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1m", 10**6),
    ("1M", 2**20), ("2G", 2**31), (" 8k ", 8000)])
def test_counts_take_vllm_suffixes(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["", "k", "32kb", "-5", "1.0001k", "1e3", "2 k x"])
def test_bad_counts_are_refused(text):
    with pytest.raises(ValueError):
        parse_count(text)


def test_sizes_take_binary_and_decimal_suffixes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1.5KiB") == 1536


def _serve_ns(*argv: str, env: dict[str, str] | None = None, monkeypatch=None):
    if env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
    return build_parser().parse_args(["serve", *argv])


def test_serve_flags_parse_suffixes_lists_and_the_model_argument(monkeypatch):
    ns = _serve_ns("Qwen/Qwen2.5-0.5B-Instruct", "--max-model-len", "32k",
                   "--kv-cache-memory", "2GiB", "--max-num-batched-tokens", "2K",
                   "--served-model-name", "qwen", "gpt-4o-mini",
                   "--allowed-origins", "https://a.example", "--max-body-size", "1MiB")
    assert ns.model_arg == "Qwen/Qwen2.5-0.5B-Instruct"
    assert ns.max_model_len == 32000 and ns.max_num_batched_tokens == 2048
    assert ns.kv_cache_memory == 2 * 2**30 and ns.max_body_size == 2**20
    assert ns.served_model_name == ["qwen", "gpt-4o-mini"]
    assert ns.allowed_origins == ["https://a.example"]
    assert ns.disable_log_requests is False and ns.generation_config == "auto"
    defaults = _serve_ns()
    assert defaults.model_arg is None and defaults.model is None
    assert defaults.max_body_size == 8 * 2**20 and defaults.allowed_origins is None


def test_environment_variables_set_defaults(monkeypatch):
    ns = _serve_ns(monkeypatch=monkeypatch, env={
        "BATON_MAX_MODEL_LEN": "4k", "BATON_SERVED_MODEL_NAME": "a, b",
        "BATON_ALLOWED_ORIGINS": '["http://x:1", "http://y:2"]',
        "BATON_DISABLE_LOG_REQUESTS": "1", "BATON_MODEL": "org/name"})
    assert ns.max_model_len == 4000
    assert ns.served_model_name == ["a", "b"]
    assert ns.allowed_origins == ["http://x:1", "http://y:2"]
    assert ns.disable_log_requests is True and ns.model == "org/name"
    assert _serve_ns("--max-model-len", "100").max_model_len == 100  # the flag wins


def test_bad_values_name_the_flag_or_variable(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model-len", "lots"])
    assert "--max-model-len" in capsys.readouterr().err
    monkeypatch.setenv("BATON_MAX_NUM_SEQS", "many")
    with pytest.raises(SystemExit):
        build_parser()
    assert "BATON_MAX_NUM_SEQS='many'" in capsys.readouterr().err


def test_two_different_models_are_refused(capsys, tiny_llama_dir):
    rc = main(["generate", str(tiny_llama_dir), "hi", "--model", "/elsewhere"])
    assert rc == 2
    assert "two models given" in capsys.readouterr().err


def test_generate_takes_the_model_as_an_argument(tiny_llama_dir, capsys):
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["generate", str(tiny_llama_dir), "hello world", "--max-tokens", "3",
                   "--dtype", "float32"])
    assert rc == 0 and out.getvalue().strip()
    with redirect_stdout(io.StringIO()) as again:
        assert main(["generate", "--model", str(tiny_llama_dir), "hello world",
                     "--max-tokens", "3", "--dtype", "float32"]) == 0
    assert again.getvalue() == out.getvalue()  # greedy: the same text either way
