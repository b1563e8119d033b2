"""Quality, memory and speed of the quantization modes, beside bfloat16.

For each mode on the embedded model (or --model): perplexity over the fixed
public-domain text in benchmarks/data/, the mean KL divergence of its
next-token distributions from the bfloat16 model's (KL(bf16 || mode)), how
often its top-1 token equals bfloat16's (with --reference FILE, the bfloat16
forward of that file instead: e.g. the unquantized weights a GGUF was made
from), the bytes its weights hold, and
decode tokens/s at batch 1 and 32 through the engine. "none" on a GGUF file
means its blocks dequantized (to bfloat16 for the reference row). The file is
read once; every mode is built from the same tensors. Prints a markdown table.

    .venv/bin/python benchmarks/quality.py [--model FILE] [--reference FILE]
        [--modes none int8 int4 gguf] [--group-sizes 32 64] [--dtype auto]
        [--window 1024] [--batches 1 32] [--threads N] [--no-speed]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.config import LoadedModel  # noqa: E402
from backends.device import resolve_dtype  # noqa: E402
from backends.execution import ExecutionOptions  # noqa: E402
from backends.interface import SamplingParams, ScheduledRequest  # noqa: E402
from backends.loader import load_model, resolve_model_path  # noqa: E402
from backends.quantization import (GROUP_SIZES, QuantizationError,  # noqa: E402
                                   QuantizationSpec, check_spec, gguf_block_types,
                                   resident_weight_bytes)
from backends.quantization.ggml import GGUFBlocks  # noqa: E402
from backends.tokenizer import Tokenizer  # noqa: E402
from backends.factory import BackendConfig, create_backend  # noqa: E402
from backends.torch_backend import TorchBackend  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.engine import EngineCore  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
TEXT_FILES = ("declaration_of_independence.txt", "gettysburg_address.txt",
              "pride_and_prejudice_ch1.txt")
REFERENCE = "none (bfloat16)"


@dataclass(frozen=True, slots=True)
class Variant:
    label: str
    spec: QuantizationSpec
    dtype: str  # serving dtype name


@dataclass(slots=True)
class Sources:
    """One read of the model file: dense float32 tensors for every mode, and
    for a GGUF the raw blocks the gguf mode keeps."""

    loaded: LoadedModel
    dense: dict[str, torch.Tensor]
    raw: dict[str, Any] | None

    def loaded_for(self, spec: QuantizationSpec) -> LoadedModel:
        weights = self.raw if spec.mode == "gguf" else self.dense
        if weights is None:
            raise QuantizationError("the gguf mode needs a .gguf model")
        return LoadedModel(self.loaded.config, dict(weights), self.loaded.tokenizer,
                           self.loaded.generation, self.loaded.source)


@dataclass(slots=True)
class Quality:
    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    count: int = 0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def mean_kl(self) -> float:
        return self.kl / self.count

    @property
    def top1(self) -> float:
        return self.agree / self.count


# ------------------------------------------------------------------ inputs
def load_sources(model: str | None) -> Sources:
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        from backends.loader.gguf import load_gguf
        loaded = load_gguf(path, torch.float32, keep_quantized=gguf_block_types())
        dense = {name: t.dequantize() if isinstance(t, GGUFBlocks) else t
                 for name, t in loaded.weights.items()}
        return Sources(loaded, dense, loaded.weights)
    loaded = load_model(path, torch.float32)
    return Sources(loaded, loaded.weights, None)


def text_token_ids(tokenizer: Tokenizer, limit: int | None = None) -> list[int]:
    text = "\n\n".join((DATA / name).read_text(encoding="utf-8").strip() for name in TEXT_FILES)
    ids = tokenizer.encode(text)
    return ids[:limit] if limit else ids


def variants(modes: list[str], group_sizes: list[int] | None, dtype: str,
             sources: Sources) -> list[Variant]:
    """The bfloat16 reference first, then each mode in ``dtype``; int4 once
    per group size that fits the model."""
    out = [Variant(REFERENCE, QuantizationSpec(), "bfloat16")]
    for mode in modes:
        if mode == "none":
            if dtype != "bfloat16":
                out.append(Variant(f"none ({dtype})", QuantizationSpec(), dtype))
        elif mode == "int4":
            for g in group_sizes or GROUP_SIZES:
                spec = QuantizationSpec("int4", g)
                try:
                    check_spec(spec, sources.loaded.config)
                except QuantizationError:
                    continue
                out.append(Variant(f"int4 g{g} ({dtype})", spec, dtype))
        elif mode == "gguf" and sources.raw is None:
            continue
        else:
            out.append(Variant(f"{mode} ({dtype})", QuantizationSpec(mode), dtype))
    return out


def build_backend(sources: Sources, variant: Variant, num_kv_blocks: int) -> TorchBackend:
    # The model's forward is called directly (next_token_logprobs): no
    # compiled step to build, quantized or not.
    return create_backend(sources.loaded_for(variant.spec), BackendConfig(
        dtype=variant.dtype, num_kv_blocks=num_kv_blocks, seed=0, quantization=variant.spec,
        execution=ExecutionOptions(compile=False)))


# ----------------------------------------------------------------- quality
@torch.inference_mode()
def next_token_logprobs(backend: TorchBackend, token_ids: list[int]) -> torch.Tensor:
    """float32 log-probabilities [len - 1, vocab] of each next token, from
    one prefill of ``token_ids`` at positions 0.. (the pool must hold them)."""
    blocks = -(-len(token_ids) // backend.block_size)
    row = ScheduledRequest("quality", token_ids, 0, list(range(blocks)), False,
                           SamplingParams(max_tokens=1), 0)
    # The backend's own step preparation, so attention metadata stays its business.
    input_ids, positions, meta, _, _ = backend._prepare([row], backend._batch.fill([row]))
    hidden = backend.model(input_ids, positions, backend.kv_caches, meta)
    return torch.log_softmax(backend.model.compute_logits(hidden[:-1]), dim=-1)


def measure_quality(backends: dict[str, TorchBackend], token_ids: list[int],
                    window: int) -> dict[str, Quality]:
    """Perplexity, KL from the first backend (the reference) and top-1
    agreement with it, over non-overlapping windows of ``token_ids``."""
    figures = {label: Quality() for label in backends}
    reference = next(iter(backends))
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start:start + window]
        if len(chunk) < 2:
            break
        targets = torch.tensor(chunk[1:])[:, None]
        ref = next_token_logprobs(backends[reference], chunk)
        ref_top1 = ref.argmax(-1)
        for label, backend in backends.items():
            lp = ref if label == reference else next_token_logprobs(backend, chunk)
            f = figures[label]
            f.nll -= lp.gather(1, targets).sum().item()
            f.kl += (ref.exp() * (ref - lp)).sum().item()
            f.agree += int((lp.argmax(-1) == ref_top1).sum())
            f.count += len(chunk) - 1
    return figures


# ------------------------------------------------------------------- speed
def engine_for(backend: TorchBackend, sources: Sources, max_num_seqs: int,
               max_num_batched_tokens: int) -> EngineCore:
    loaded = sources.loaded
    return EngineCore(backend, Tokenizer(loaded.tokenizer),
                      SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=backend.kv_capacity_tokens),
                      vocab_size=loaded.config.vocab_size,
                      eos_token_ids=tuple(loaded.generation.eos_token_ids),
                      generation=loaded.generation)


def decode_tokens_per_s(backend: TorchBackend, sources: Sources, batch: int,
                        prompt_len: int, output_len: int) -> float:
    """Greedy decode rate with ``batch`` requests running together: tokens
    from steps after every prompt has been prefilled, over those steps' time."""
    core = engine_for(backend, sources, batch, max(512, batch * prompt_len))
    gen = torch.Generator().manual_seed(0)
    vocab = sources.loaded.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    core.add_request("warmup", torch.randint(100, vocab, (16,), generator=gen).tolist(),
                     SamplingParams(max_tokens=4, ignore_eos=True))
    while core.has_unfinished():
        core.step()
    for i in range(batch):
        core.add_request(f"r{i}", torch.randint(100, vocab, (prompt_len,), generator=gen)
                         .tolist(), params)
    started: set[str] = set()
    while len(started) < batch:  # prefill (and the first token of each request)
        started.update(out.request_id for out in core.step().outputs)
    produced, t0 = 0, time.perf_counter()
    while core.has_unfinished():
        produced += sum(len(out.new_token_ids) for out in core.step().outputs)
    elapsed = time.perf_counter() - t0
    core.check_integrity()
    return produced / elapsed


# -------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--reference", default=None, help="a model file whose bfloat16 forward "
                    "is the reference for KL and top-1 (default: --model's own)")
    ap.add_argument("--modes", nargs="+", default=["none", "int8", "int4", "gguf"])
    ap.add_argument("--group-sizes", type=int, nargs="+", default=None,
                    help="int4 group sizes (default: each of 32/64/128 that fits)")
    ap.add_argument("--dtype", default="auto", help="serving dtype of the modes "
                    "(auto: bfloat16 where native, else float32)")
    ap.add_argument("--window", type=int, default=1024, help="tokens per forward pass")
    ap.add_argument("--max-text-tokens", type=int, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1,
                    help="decode runs per figure; the best is kept (shared machines are noisy)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--no-quality", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dtype = resolve_dtype(args.dtype, "cpu")
    sources = load_sources(args.model)
    tokens = text_token_ids(Tokenizer(sources.loaded.tokenizer), args.max_text_tokens)
    chosen = variants(args.modes, args.group_sizes, dtype, sources)
    speed_blocks = max(args.batches) * -(-(args.prompt + args.output + 1) // 16) + 8
    num_blocks = max(-(-args.window // 16), speed_blocks)
    backends = {v.label: build_backend(sources, v, num_blocks) for v in chosen}
    reference_name = REFERENCE
    if args.reference:
        ref_sources = load_sources(args.reference)
        if ref_sources.loaded.config.vocab_size != sources.loaded.config.vocab_size:
            raise SystemExit("--reference has another vocabulary")
        reference_name = f"reference: {Path(args.reference).name} (bfloat16)"
        backends = {reference_name: build_backend(
            ref_sources, Variant(reference_name, QuantizationSpec(), "bfloat16"), num_blocks),
            **backends}

    print(f"# {time.strftime('%Y-%m-%d')} {platform.node()} {platform.machine()} "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"# model {Path(sources.loaded.source).name or sources.loaded.config.name}; "
          f"text {len(tokens)} tokens in windows of {args.window}; KL and top-1 against "
          f"{reference_name}; decode {args.prompt} prompt + {args.output} output tokens")
    quality = None if args.no_quality else measure_quality(backends, tokens, args.window)
    batches = [] if args.no_speed else args.batches
    header = ["mode", "weights MiB", "perplexity", "mean KL", "top-1 agree"]
    print(_row(header + [f"decode tok/s b{b}" for b in batches]))
    print(_row(["---"] * (len(header) + len(batches))))
    # Rounds over every mode, not repeats of one mode, so load that drifts
    # during the run lands on all modes alike; the best of the rounds is kept.
    speed = {(label, b): 0.0 for label in backends for b in batches}
    for _ in range(args.repeats if batches else 0):
        for (label, b), best in speed.items():
            rate = decode_tokens_per_s(backends[label], sources, b, args.prompt, args.output)
            speed[label, b] = max(best, rate)
    for label, backend in backends.items():
        q = quality[label] if quality else None
        cells = [label, f"{resident_weight_bytes(backend.model) / 2**20:.0f}"]
        cells += ([f"{q.perplexity:.3f}", f"{q.mean_kl:.5f}", f"{100 * q.top1:.1f}%"] if q
                  else ["—"] * 3)
        cells += [f"{speed[label, b]:.1f}" for b in batches]
        print(_row(cells))


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
