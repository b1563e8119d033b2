"""The last decoder layer carries only the rows whose hidden state is read
(backends/models/decoder.py, ``out_rows``): a prefill chunk samples its last
row alone, so the other rows' output projection, MLP and final norm are
skipped there, while every row's K/V is still stored. The tokens and
logprobs are those of the full forward."""

from __future__ import annotations

import pytest
import torch

import backends.torch_backend as torch_backend
from backends.interface import SamplingParams, ScheduledRequest, SchedulerOutput
from tests.test_cpu_kernels import _backend, _run


def _rows_seen(backend, index: int) -> list[int]:
    """Rows of each call to layer ``index``'s down projection, recorded."""
    seen: list[int] = []
    backend.model.layers[index].down_proj.register_forward_hook(
        lambda _m, args, _out: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("fast_paths", [True, False])
def test_the_last_layer_skips_the_rows_nobody_samples(request, arch, fast_paths,
                                                      monkeypatch):
    """float32, prompts of 13, 6, 1 and 9 tokens prefilled in one step, then
    decoded together: the last layer's MLP saw 4 rows in the prefill step
    (the first layer all 29), and every token and logprob equals the full
    forward's (the selection switched off)."""
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (13, 6, 1, 9)]
    backend = _backend(path, "float32", fast_paths=fast_paths)
    first, last = _rows_seen(backend, 0), _rows_seen(backend, -1)
    ids, lps = _run(backend, prompts, 4)
    assert first[0] == 29 and last[0] == 4
    assert first[1:] == last[1:] == [4] * 4  # decode steps: every row is sampled

    monkeypatch.setattr(torch_backend, "_out_rows", lambda *_args: None)
    full = _backend(path, "float32", fast_paths=fast_paths)
    full_last = _rows_seen(full, -1)
    ids_full, lps_full = _run(full, prompts, 4)
    assert full_last[0] == 29
    assert ids == ids_full
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(lps_full), atol=2e-5, rtol=0)


def test_prompt_logprobs_and_chunks_that_sample_nothing_keep_every_row(tiny_llama_dir):
    """A chunk in the middle of a prompt samples nothing and a request with
    prompt logprobs reads every row: neither step selects rows, and the
    chunked prompt then samples what the whole prompt samples."""
    backend = _backend(tiny_llama_dir, "float32")
    last = _rows_seen(backend, -1)
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(3, 500, (12,), generator=gen).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    table = list(range(1, 9))
    res = backend.execute(SchedulerOutput([ScheduledRequest(
        "a", prompt[:7], 0, table, False, greedy, 0, prompt)]))
    assert res.token_ids == [] and last == [7]
    chunked = backend.execute(SchedulerOutput([ScheduledRequest(
        "a", prompt[7:], 7, table, True, greedy, 0)]))
    assert last == [7, 1]
    with_lp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    res = backend.execute(SchedulerOutput([ScheduledRequest(
        "b", prompt, 0, list(range(9, 17)), True, with_lp, 0, prompt)]))
    assert last[-1] == 12
    assert len(res.prompt_logprobs["b"]) == 11
    assert res.token_ids == chunked.token_ids
