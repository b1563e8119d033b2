"""Each native op of a decode step timed in place: benchmarks/profile_step.py
with every ``torch.ops.baton`` call wrapped in a ``perf_counter`` pair, so the
time a step spends in each op (dispatch included) is read without
torch.profiler's per-op overhead. Counts start at the first AMX tile linear of
BATCH rows (the first decode step; prefill calls are left out); per step
figures average the timed decode steps, the two warm-up steps included.

    .venv/bin/python benchmarks/step_ops.py --batch 32 --context 200 --dtype bfloat16 --threads 2

Takes profile_step.py's arguments. Only the ops the plan calls through
``torch.ops.baton`` are seen.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from backends import kernels as native  # noqa: E402

OPS = ("rms_norm", "silu_mul", "qkv_rope_store", "paged_decode_attention",
       "paged_decode_attention_lse", "linear_amx", "gemv_bf16", "row_max")


def main() -> None:
    argv = sys.argv[1:]
    batch = int(argv[argv.index("--batch") + 1]) if "--batch" in argv else 32
    path, why = native.load()
    if path is None:
        raise SystemExit(f"no native kernels: {why}")
    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    started = [False]

    def wrap(name, op):
        def timed(*args):
            if name == "linear_amx" and not started[0] and args[0].shape[0] == batch:
                started[0] = True
            t = time.perf_counter()
            out = op(*args)
            if started[0]:
                key = (f"linear_amx N={args[2]} K={args[0].shape[-1]} rows={args[0].shape[0]}"
                       if name == "linear_amx" else name)
                spent[key] += time.perf_counter() - t
                calls[key] += 1
            return out
        return timed

    for name in OPS:
        setattr(torch.ops.baton, name, wrap(name, getattr(torch.ops.baton, name)))
    import profile_step
    sys.argv = ["profile_step.py", *argv]
    profile_step.main()
    heads = [k for k in calls if k.startswith("linear_amx N=") and k.endswith(f"rows={batch}")]
    lm = max(heads, key=lambda k: int(k.split("N=")[1].split()[0]), default=None)
    steps = calls[lm] if lm else 1  # the output projection: one call a step
    print(f"| op | calls / step | ms / step | us / call |  ({steps} decode steps)")
    print("|---|---:|---:|---:|")
    for key in sorted(spent):
        print(f"| {key} | {calls[key] / steps:.0f} | {spent[key] / steps * 1e3:.2f} | "
              f"{spent[key] / calls[key] * 1e6:.1f} |")
    linear = sum(v for k, v in spent.items() if k.startswith("linear_amx"))
    print(f"all linear_amx {linear / steps * 1e3:.2f} ms / step; all native ops "
          f"{sum(spent.values()) / steps * 1e3:.2f} ms / step")


if __name__ == "__main__":
    main()
