"""Every per-request table of the engine empties on every exit path, even
when a request ends while its step is running."""

from __future__ import annotations

from backends.interface import SamplingParams
from tests.engine_helpers import assert_all_free, make_engine, run_all

PROMPT = [5, 17, 99, 230, 41, 8, 77]


def test_abort_during_step_with_prompt_logprobs_leaves_nothing(tiny_llama_dir):
    """Issue 15, defect 10: the abort popped the prompt-logprobs entry, then
    the step's postprocess created it again, forever."""
    core = make_engine(tiny_llama_dir)
    backend = core.backend
    real = backend.execute

    def abort_midway(output):
        result = real(output)
        core.abort("echo")  # the client leaves while the forward pass runs
        return result

    backend.execute = abort_midway
    try:
        core.add_request("echo", PROMPT, SamplingParams(max_tokens=4, prompt_logprobs=2))
        outcome = core.step()
    finally:
        del backend.execute
    assert outcome.outputs == []  # its token is dropped, its final output went out already
    assert core.state_sizes()["prompt_logprobs"] == 0
    assert_all_free(core)


def test_every_table_empty_after_mixed_requests(tiny_llama_dir):
    core = make_engine(tiny_llama_dir)
    params = {"plain": SamplingParams(max_tokens=5),
              "penalised": SamplingParams(max_tokens=5, repetition_penalty=1.3, seed=1),
              "scored": SamplingParams(max_tokens=3, prompt_logprobs=1, logprobs=2),
              "stopped": SamplingParams(max_tokens=20, stop=("a",), ignore_eos=True)}
    run_all(core, {rid: PROMPT for rid in params}, params)  # asserts every table empty
