"""Time to first token of long prompts by the attention route of their chunks.

A step's prefill chunks attend either token by token through the native
decode kernel (token rows) or one chunk at a time through SDPA (segments);
``backends.torch_backend.segment_attention_pays`` picks. This times, in one
process and alternating the two routes round by round: a fresh prompt of each
``--lengths`` (no prefix-cache hits), and a ``--turn``-token turn over a cached
``--history``-token conversation. Each request is alone (max_tokens 1).

    .venv/bin/python benchmarks/prefill_attention.py [--model DIR|GGUF] \\
        [--lengths 1000 4000] [--history 3000 --turn 300] [--rounds 3] \\
        [--cpu-kind avx2]

"as served": the engine's rule; "token rows only": the kernel for every chunk. Needs the
plan's native decode attention (the load line says ``decode attention
native``); without it every step takes segments and there is nothing to compare.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends import torch_backend  # noqa: E402
from backends.interface import SamplingParams  # noqa: E402
from backends.loader import resolve_model_path  # noqa: E402
from service.config import EngineArgs  # noqa: E402
from service.engine_factory import create_engine  # noqa: E402

ROUTES = ("as served", "token rows only")


def _first_token_s(core, ids: list[int]) -> float:
    core.add_request(f"r{time.perf_counter_ns()}", ids,
                     SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    while core.has_unfinished():
        core.step()
    return time.perf_counter() - t0


def measure(core, lengths: list[int], history: int, turn: int, rounds: int,
            seed: int = 0) -> dict[str, dict[str, list[float]]]:
    """Seconds by case and route, one entry a round."""
    gen = torch.Generator().manual_seed(seed)
    vocab = core.vocab_size

    def ids(n: int) -> list[int]:  # fresh random ids: nothing cached
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    engine_rule = torch_backend.SEGMENT_MIN_TOKENS
    out: dict[str, dict[str, list[float]]] = {}
    try:
        for _ in range(rounds):
            for route in ROUTES:
                torch_backend.SEGMENT_MIN_TOKENS = (engine_rule if route == "as served"
                                                    else 10**9)
                for n in lengths:
                    out.setdefault(f"{n}-token prompt", {}).setdefault(route, []).append(
                        _first_token_s(core, ids(n)))
                if history and turn:
                    past = ids(history)
                    _first_token_s(core, past)  # now cached
                    out.setdefault(f"{turn} tokens over {history} cached", {}).setdefault(
                        route, []).append(_first_token_s(core, past + ids(turn)))
    finally:
        torch_backend.SEGMENT_MIN_TOKENS = engine_rule
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000])
    ap.add_argument("--history", type=int, default=3000)
    ap.add_argument("--turn", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-kind", default="auto")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    core = create_engine(EngineArgs(model=str(resolve_model_path(args.model)),
                                    cpu_kind=args.cpu_kind, dtype=args.dtype))
    print(f"plan: {core.backend.plan.describe()}")
    if not core.backend._token_rows:
        print("no native decode attention: every chunk takes segments; nothing to compare")
        return {}
    # One short request first: one-time costs stay out of the figures.
    _first_token_s(core, [5] * 16)
    results = measure(core, args.lengths, args.history, args.turn, args.rounds)
    print(f"\n| case | {' | '.join(f'{r} (ms, each round)' for r in ROUTES)} | median ratio |")
    print("|---|---|---|---:|")
    for case, by_route in results.items():
        cells = [" ".join(f"{s * 1000:.0f}" for s in by_route[r]) for r in ROUTES]
        ratio = statistics.median(by_route["token rows only"]) / statistics.median(by_route["as served"])
        print(f"| {case} | {' | '.join(cells)} | {ratio:.2f} |")
    core.backend.shutdown()
    return results


if __name__ == "__main__":
    main()
