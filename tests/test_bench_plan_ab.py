"""benchmarks/plan_ab.py: one process, two backends of one model (the plan as
chosen, and with the named parts replaced), alternating single steps."""

from __future__ import annotations

import re
import sys

import pytest

from benchmarks import plan_ab


def test_side_b_runs_the_replaced_plan_and_both_are_timed(tiny_llama_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [
        "plan_ab.py", "--model", str(tiny_llama_dir), "--dtype", "float32", "--context", "20",
        "--pairs", "4", "--enforce-eager", "--replace", "norm=torch,activation=torch",
        "--build-b-first"])
    plan_ab.main()
    out = capsys.readouterr().out.splitlines()
    assert [line[:2] for line in out if line[:3] in ("A: ", "B: ")] == ["B:", "A:"]
    a = next(line for line in out if line.startswith("A: "))
    b = next(line for line in out if line.startswith("B: "))
    assert "norm torch" in b and "silu torch" in b and "decode steps eager" in b
    # Everything but the replaced parts is A's plan.
    assert re.sub(r"(norm|silu) \w+", "", a[3:]) == re.sub(r"(norm|silu) \w+", "", b[3:])
    assert re.fullmatch(r"4 pairs of single steps, batch 1, context 20\+: A [\d.]+ ms, "
                        r"B [\d.]+ ms \(p50\); B/A [\d.]+ of the medians, [\d.]+ median of "
                        r"the pairs, B faster in [0-4] of 4", out[-1]), out[-1]


@pytest.mark.slow  # compiles a step (seconds)
def test_side_b_can_call_its_graphs_through_dynamo(tiny_llama_dir, monkeypatch, capsys,
                                                   tmp_path_factory):
    """--b-through-dynamo: the same plan on both sides, B's compiled step
    calling its graphs through Dynamo at every step, A's their code directly."""
    # The compile cache the compiled-step tests share (away from the
    # user's): side B loads what side A built.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR",
                       str(tmp_path_factory.getbasetemp() / "inductor-cache"))
    calls = []
    monkeypatch.setattr(sys, "argv", [
        "plan_ab.py", "--model", str(tiny_llama_dir), "--dtype", "float32", "--context", "20",
        "--pairs", "3", "--b-through-dynamo"])
    from backends import compiled_step
    real = compiled_step.CompiledStep.__call__

    def spy(self, *args, **kwargs):
        calls.append(self._graphs.get(False) is self._fn)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(compiled_step.CompiledStep, "__call__", spy)
    plan_ab.main()
    out = capsys.readouterr().out.splitlines()
    a = next(line for line in out if line.startswith("A: "))
    b = next(line for line in out if line.startswith("B: "))
    assert "decode steps compiled" in a and b[3:] == a[3:] + ", graphs through Dynamo"
    assert out[-1].startswith("3 pairs of single steps")
    assert set(calls) == {True, False}  # B's steps through Dynamo, A's not
