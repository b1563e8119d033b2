"""Embedding throughput: inputs per second at batch 32, Baton's
`POST /v1/embeddings` beside sentence-transformers on the same model, in the
same run, on the same number of threads.

    .venv/bin/python benchmarks/embeddings.py [--model PATH] [--threads N] \\
        [--batch 32] [--inputs 64] [--rounds 2] [--json OUT.json]

The model (default: the embedded SmolLM2-135M-Instruct GGUF) is written as a
Hugging Face folder by `baton export --dtype float32`; sentence-transformers
loads that folder with a last-token Pooling module and Normalize (what Baton
does for a generative model without a pooling config), float32, on
`torch.set_num_threads(N)`; Baton serves the original model with
`--dtype float32 --threads N --no-prefix-caching` (the inputs repeat across
rounds, and a cache hit would measure the cache). The two run one after the
other, never at once. The inputs are a fixed list: windows of 100-300 tokens
of the texts in benchmarks/data, the same for both. Each round embeds every
input in batches of `--batch` (one request per batch for Baton, one
`encode` call per batch for sentence-transformers) after one untimed warm-up
batch; the figure is inputs / seconds, the median over rounds. The cosine
between the two systems' vectors of each input is printed as a check that
they compute the same thing.

Install sentence-transformers for this script only (it is no test
dependency): `.venv/bin/python -m pip install sentence-transformers`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def make_inputs(tokenizer_file: Path, count: int) -> list[str]:
    """``count`` windows of 100-300 tokens over the texts in benchmarks/data,
    decoded back to text (deterministic)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_file))
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(DATA.glob("*.txt")))
    ids = tok.encode(text, add_special_tokens=False).ids
    inputs = []
    for k in range(count):
        length = 100 + (k * 61) % 201
        start = (k * 389) % (len(ids) - length)
        inputs.append(tok.decode(ids[start:start + length]))
    return inputs


def export(model: str | None, out: Path) -> None:
    argv = [sys.executable, "-m", "service.cli", "export"]
    argv += [model] if model else []
    argv += [str(out), "--dtype", "float32"]
    subprocess.run(argv, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def run_baton(model: str | None, threads: int, batches: list[list[str]], rounds: int,
              log: Path, flags: list[str]) -> tuple[list[float], list[list[float]], int]:
    """(seconds per round, vectors of the inputs, prompt tokens per round)."""
    port = _free_port()
    argv = [sys.executable, "-m", "service.cli", "serve"] + ([model] if model else []) + [
        "--dtype", "float32", "--threads", str(threads), "--no-prefix-caching",
        "--port", str(port), *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"baton serve did not start; see {log}")
            time.sleep(0.5)
        url = base + "/v1/embeddings"
        _post(url, {"input": batches[0]})  # warm-up
        times, vectors, tokens = [], [], 0
        for r in range(rounds):
            t0 = time.perf_counter()
            answers = [_post(url, {"input": batch}) for batch in batches]
            times.append(time.perf_counter() - t0)
            if r == 0:
                vectors = [d["embedding"] for a in answers for d in a["data"]]
                tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
        return times, vectors, tokens
    finally:
        proc.terminate()
        proc.wait(30)


def run_sentence_transformers(folder: Path, threads: int, batches: list[list[str]],
                              rounds: int) -> tuple[list[float], list[list[float]], str]:
    import torch
    from sentence_transformers import SentenceTransformer, __version__
    from sentence_transformers.sentence_transformer.modules import (Normalize, Pooling,
                                                                    Transformer)

    torch.set_num_threads(threads)
    body = Transformer(
        str(folder), model_kwargs={"dtype": torch.float32},
        # Text as text: sentence-transformers 6 would otherwise wrap each
        # input in the tokenizer's chat template (Baton embeds what it is sent).
        modality_config={"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
        module_output_name="token_embeddings")
    tokenizer = body.tokenizer
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    pooling = Pooling(body.get_embedding_dimension(), pooling_mode="lasttoken")
    model = SentenceTransformer(modules=[body, pooling, Normalize()], device="cpu")
    model.encode(batches[0], batch_size=len(batches[0]))  # warm-up
    times, vectors = [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        out = [model.encode(batch, batch_size=len(batch)) for batch in batches]
        times.append(time.perf_counter() - t0)
        if r == 0:
            vectors = [v.tolist() for o in out for v in o]
    return times, vectors, __version__


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the "
                                                  "embedded model)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--inputs", type=int, default=64, help="inputs per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baton-flags", nargs="*", default=["", "--max-num-batched-tokens 2048"],
                    help="one Baton row per entry, each extra `baton serve` flags (the "
                         "default step budget, 512 tokens, favours decode latency; an "
                         "embedding-only load gains from bigger steps)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ns = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="baton-embed-bench-") as tmp:
        folder = Path(tmp) / "hf"
        export(ns.model, folder)
        inputs = make_inputs(folder / "tokenizer.json", ns.inputs)
        batches = [inputs[i:i + ns.batch] for i in range(0, len(inputs), ns.batch)]
        rows = []  # (name, seconds per round, vectors)
        b_tokens = 0
        for i, flags in enumerate(ns.baton_flags):
            times, vectors, b_tokens = run_baton(ns.model, ns.threads, batches, ns.rounds,
                                                 Path(tmp) / f"baton-{i}.log", flags.split())
            rows.append((f"Baton /v1/embeddings {flags or '(defaults)'}", times, vectors))
        s_times, s_vecs, st_version = run_sentence_transformers(folder, ns.threads, batches,
                                                                ns.rounds)
        rows.append((f"sentence-transformers {st_version}", s_times, s_vecs))
    st_rate = len(inputs) / statistics.median(s_times)
    cos = min(float(np.dot(a, b)) for _, _, vectors in rows[:-1]
              for a, b in zip(vectors, s_vecs))
    figures = {
        "cpu": cpu_model(), "threads": ns.threads, "batch": ns.batch, "inputs": len(inputs),
        "rounds": ns.rounds, "prompt_tokens_per_round": b_tokens, "min_cosine": cos,
        "systems": [{"name": name, "inputs_per_s": len(inputs) / statistics.median(times),
                     "round_s": times} for name, times, _ in rows],
    }
    print(f"CPU: {figures['cpu']}, {ns.threads} threads; {len(inputs)} inputs of 100-300 "
          f"tokens ({b_tokens} tokens in all) in batches of {ns.batch}, float32, median of "
          f"{ns.rounds} rounds\n")
    print("| system | inputs/s | tokens/s | vs sentence-transformers | round seconds |")
    print("|---|---|---|---|---|")
    for name, times, _ in rows:
        rate = len(inputs) / statistics.median(times)
        print(f"| {name} | {rate:.2f} | {rate * b_tokens / len(inputs):.0f} | "
              f"{rate / st_rate:.2f}x | {', '.join(f'{t:.2f}' for t in times)} |")
    print(f"\nmin cosine between Baton's and sentence-transformers' vectors: {cos:.6f}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
