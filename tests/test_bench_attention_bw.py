"""benchmarks/attention_bw.py: each --shape times the kernel on that model's
attention shape (query heads, kv heads, head_dim)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("shape, heads", [("360m", "15 heads, 5 kv heads, head_dim 64"),
                                           ("1.7b", "32 heads, 32 kv heads, head_dim 64")])
def test_times_the_shape_it_is_given(shape, heads):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "attention_bw.py"), "--shape", shape,
         "--cases", "2x40", "--kv", "float32", "--kinds", "portable,sdpa", "--threads", "1",
         "--seconds", "0.01", "--footprint-mb", "1"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    assert f"shape {shape} ({heads})" in out
    line = next(x for x in out.splitlines() if x.startswith("kv float32"))
    # both the portable kernel's and SDPA's figures, not a failure mark
    assert line.count(" ms ") == 2 and ": -" not in line, line
