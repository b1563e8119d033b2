"""How far prompt lookup could go on a workload: the most tokens a step could
yield if every proposal were verified for free.

Generates the greedy answers of the grounded and chat workloads
(benchmarks/workloads.py, the requests compare.py sends with the same seed)
without speculation, in process, then replays each answer through the n-gram
proposer (scheduler/speculative.py) step by step: propose up to k tokens from
the prompt and the answer so far, keep the ones that equal the answer, add
the step's own token. Tokens per step is the ceiling of the speed-up of
n-gram speculation with that k and shortest n-gram on that model and
workload, before a verification row's cost and the proposal policy.

    .venv/bin/python benchmarks/spec_bound.py [--model DIR|GGUF] \\
        [--workload grounded chat] [--requests 8] [--output-len 128] \\
        [--k 4 8 16] [--min-n 1 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.interface import SamplingParams  # noqa: E402
from backends.loader import resolve_model_path  # noqa: E402
from benchmarks import workloads  # noqa: E402
from scheduler.speculative import NgramProposer  # noqa: E402
from service.chat_template import tokenize_chat  # noqa: E402
from service.config import EngineArgs  # noqa: E402
from service.engine_factory import create_engine  # noqa: E402


def replay(prompt: list[int], answer: list[int], k: int, min_n: int,
           max_n: int = 5) -> int:
    """Steps that n-gram speculation with free verification takes to produce
    ``answer`` after ``prompt``."""
    proposer = NgramProposer(min_n, max_n)
    done = steps = 0
    while done < len(answer):
        guess = proposer.propose("r", prompt + answer[:done], k)
        kept = 0
        # The step's own token always comes from the model: at most
        # len(answer) - done - 1 proposals can be kept before it.
        while (kept < len(guess) and done + kept < len(answer) - 1
               and guess[kept] == answer[done + kept]):
            kept += 1
        done += kept + 1
        steps += 1
    return steps


def answers(core, asks: list[str], output_len: int) -> list[tuple[list[int], list[int]]]:
    pairs = []
    for i, ask in enumerate(asks):
        prompt = tokenize_chat(core.tokenizer, [{"role": "user", "content": ask}],
                               add_generation_prompt=True)
        core.add_request(f"a{i}", prompt, SamplingParams(temperature=0.0, max_tokens=output_len,
                                                         ignore_eos=True))
        out: list[int] = []
        while core.has_unfinished():
            for o in core.step().outputs:
                out += o.new_token_ids
        pairs.append((prompt, out))
    return pairs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--workload", nargs="+", default=["grounded", "chat"],
                    choices=["grounded", "chat"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--passage-words", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--min-n", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    core = create_engine(EngineArgs(model=str(resolve_model_path(args.model)), dtype=args.dtype))
    results: dict = {}
    for workload in args.workload:
        asks = (workloads.grounded_asks(args.seed, args.requests, args.passage_words)
                if workload == "grounded" else workloads.chat_asks(args.seed, args.requests))
        pairs = answers(core, asks, args.output_len)
        tokens = sum(len(a) for _, a in pairs)
        print(f"\n{workload}: {len(pairs)} answers, {tokens} tokens "
              f"(tokens per step with free verification; per answer in brackets)")
        for min_n in args.min_n:
            for k in args.k:
                steps = [replay(p, a, k, min_n) for p, a in pairs]
                per = " ".join(f"{len(a) / s:.2f}" for (_, a), s in zip(pairs, steps))
                results[(workload, k, min_n)] = tokens / sum(steps)
                print(f"  k={k:2d} shortest n-gram {min_n}: {tokens / sum(steps):.2f}  [{per}]")
    core.backend.shutdown()
    return results


if __name__ == "__main__":
    main()
