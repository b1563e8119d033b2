"""benchmarks/prefill_attention.py on a tiny model: both routes timed for
every case, and the engine's rule restored afterwards."""

from __future__ import annotations

import pytest

from backends import torch_backend
from benchmarks import prefill_attention


def test_times_both_routes_for_every_case(tiny_llama_dir, capsys):
    rule = torch_backend.SEGMENT_MIN_TOKENS
    results = prefill_attention.main([
        "--model", str(tiny_llama_dir), "--dtype", "float32", "--lengths", "200",
        "--history", "150", "--turn", "80", "--rounds", "2"])
    assert torch_backend.SEGMENT_MIN_TOKENS == rule
    printed = capsys.readouterr().out
    if not results:
        assert "nothing to compare" in printed
        pytest.skip("no native decode attention here: every chunk takes segments")
    assert set(results) == {"200-token prompt", "80 tokens over 150 cached"}
    for by_route in results.values():
        assert set(by_route) == set(prefill_attention.ROUTES)
        assert all(len(times) == 2 and min(times) > 0 for times in by_route.values())
    assert "| 200-token prompt |" in printed
