"""vLLM's command-line flags as `baton serve` takes them, and the command line
itself: options between `baton generate`'s two positionals, and errors that
print the subcommand's usage (docs/serving.md, "vLLM's flags")."""

from __future__ import annotations

import io
import shutil
from contextlib import redirect_stdout

import openai
import pytest
from openai import OpenAI

from backends.device import CUDA_KV_FRACTION, cuda_kv_budget
from backends.errors import ModelLoadError
from service.cli import engine_args_from, main, parse_argv, server_config_from
from service.config import ServerConfig
from service.engine_factory import create_engine
from tests.engine_helpers import make_engine
from tests.server_helpers import running_server

GiB = 2**30


def test_generate_takes_options_between_model_and_prompt(tiny_llama_dir):
    # The README's own form: `baton generate path/to/hf-folder --dtype float32 "Hello"`.
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["generate", str(tiny_llama_dir), "--dtype", "float32", "Hello",
                   "--max-tokens", "3"])
    assert rc == 0 and out.getvalue().strip()
    with redirect_stdout(io.StringIO()) as again:
        assert main(["generate", str(tiny_llama_dir), "Hello", "--dtype", "float32",
                     "--max-tokens", "3"]) == 0
    assert again.getvalue() == out.getvalue()  # greedy: the same text wherever the options go
    ns = parse_argv(["generate", "--max-tokens", "2", "the prompt"])
    assert ns.model_arg is None and ns.prompt == "the prompt" and ns.max_tokens == 2


def test_serve_errors_print_the_serve_usage(capsys):
    with pytest.raises(SystemExit):
        parse_argv(["serve", "--no-such-flag"])
    err = capsys.readouterr().err
    assert err.startswith("usage: baton serve") and "--no-such-flag" in err
    with pytest.raises(SystemExit):
        parse_argv(["generate", "m", "p", "extra"])
    assert capsys.readouterr().err.startswith("usage: baton generate")


def test_vllm_flags_are_taken_with_their_meaning():
    ns = parse_argv(["serve", "some/model", "--enable-auto-tool-choice", "--trust-remote-code",
                     "--tool-call-parser", "llama4_json", "--max-logprobs", "50",
                     "--tokenizer", "other/tokenizer", "--gpu-memory-utilization", "0.8"])
    assert ns.enable_auto_tool_choice and ns.trust_remote_code
    assert server_config_from(ns).tool_call_parser == "llama3_json"
    args = engine_args_from(ns)
    assert args.max_logprobs == 50 and args.tokenizer == "other/tokenizer"
    assert args.gpu_memory_utilization == 0.8
    assert server_config_from(parse_argv(["serve", "--tool-call-parser", "hermes"])
                              ).tool_call_parser == "hermes"


@pytest.mark.parametrize("argv,needle", [
    (["--tool-call-parser", "mistral"], "not a tool-call format Baton parses"),
    (["--gpu-memory-utilization", "1.5"], "fraction in (0, 1]"),
    (["--max-logprobs", "-3"], "-1 (the vocabulary size)"),
    (["--swap-space", "4"], "--kv-cache-memory"),
    (["--kv-cache-dtype", "fp8"], "--dtype"),
    (["-pp", "2"], "--tensor-parallel-size"),
])
def test_vllm_flags_without_a_meaning_here_say_what_to_use(argv, needle, capsys):
    with pytest.raises(SystemExit):
        parse_argv(["serve", *argv])
    err = capsys.readouterr().err
    assert err.startswith("usage: baton serve") and needle in err


def test_cuda_kv_budget_fills_the_device_to_the_fraction():
    # 80 GiB device, 10 GiB in use (weights): 0.9 of it leaves 62 GiB for the cache.
    assert cuda_kv_budget(70 * GiB, 80 * GiB, 0.9) == 62 * GiB
    assert cuda_kv_budget(70 * GiB, 80 * GiB, None) == int(70 * GiB * CUDA_KV_FRACTION)
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.1"):
        cuda_kv_budget(70 * GiB, 80 * GiB, 0.1)


def test_gpu_memory_utilization_is_refused_where_it_means_nothing(tiny_llama_dir):
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        create_engine(engine_args_from(parse_argv(
            ["serve", str(tiny_llama_dir), "--gpu-memory-utilization", "0.5"])))


def test_tokenizer_from_another_folder(tiny_llama_dir, tiny_tokenizer_dir, tmp_path):
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_llama_dir, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        make_engine(bare)
    core = make_engine(bare, tokenizer=str(tiny_tokenizer_dir))
    reference = make_engine(tiny_llama_dir)
    assert core.tokenizer.encode("Hello there") == reference.tokenizer.encode("Hello there")
    assert core.tokenizer.chat_template == reference.tokenizer.chat_template


def test_a_tokenizer_that_does_not_fit_the_model_is_refused(tiny_llama_dir):
    from backends.loader.embedded import embedded_model_path
    with pytest.raises(ModelLoadError, match="not this model's tokenizer"):
        make_engine(tiny_llama_dir, tokenizer=str(embedded_model_path()))
    with pytest.raises(ModelLoadError, match="does not exist"):
        make_engine(tiny_llama_dir, tokenizer="./nowhere/at-all")


def test_max_logprobs_bounds_what_requests_ask_for(tiny_llama_dir):
    with running_server(make_engine(tiny_llama_dir, max_logprobs=30), ServerConfig()) as srv:
        client = OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        resp = client.completions.create(model=srv.state.model_name, prompt="Hello",
                                         max_tokens=2, logprobs=25)
        # A dict by token text: byte tokens that print alike share one key.
        assert 20 < len(resp.choices[0].logprobs.top_logprobs[0]) <= 25  # above OpenAI's 20
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=srv.state.model_name, prompt="Hello",
                                      max_tokens=2, logprobs=31)
        assert info.value.body["param"] == "logprobs" and "--max-logprobs" in str(info.value)
        chat = client.chat.completions.create(
            model=srv.state.model_name, messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2, logprobs=True, top_logprobs=30)
        assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 30
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=srv.state.model_name, messages=[{"role": "user", "content": "Hi"}],
                max_tokens=2, logprobs=True, top_logprobs=31)
        assert info.value.body["param"] == "top_logprobs"
        srv.wait_idle()


def test_tokenizer_from_a_hub_id_fetches_only_tokenizer_files(tiny_tokenizer_dir, tmp_path,
                                                              monkeypatch):
    from backends.loader import resolve_tokenizer
    from tests.test_hub import add_snapshot
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = {p.name: p for p in tiny_tokenizer_dir.iterdir()}
    add_snapshot(tmp_path, "baton-test/tokenizer-only", files)
    folder = resolve_tokenizer("baton-test/tokenizer-only", download_dir=str(tmp_path))
    assert (folder / "tokenizer.json").is_file()
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache"):
        resolve_tokenizer("baton-test/missing", download_dir=str(tmp_path))
