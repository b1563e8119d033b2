"""Offline throughput: Baton's engine against transformers' static-batch generate.

Requests of PROMPT random token ids and OUTPUT generated tokens (ignore_eos)
at several batch sizes, on the embedded model (or --model), per dtype. Prints
output tokens/s and Baton's step time split; transformers runs on the same
weights in the same process, one batch size after another.

    .venv/bin/python benchmarks/offline_throughput.py [--batches 1 8 32] \
        [--dtypes bfloat16 float32] [--prompt 128] [--output 128] [--no-transformers]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.interface import SamplingParams, StepTimings  # noqa: E402
from backends.loader import resolve_model_path  # noqa: E402
from service.config import EngineArgs  # noqa: E402
from service.engine_factory import create_engine  # noqa: E402


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Skip the first ids: they are special tokens in most vocabularies.
    return [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def bench_baton(model, dtype: str, batch: int, prompt_len: int, output_len: int,
                seed: int) -> dict:
    core = create_engine(EngineArgs(
        model=model, dtype=dtype, max_num_seqs=batch,
        max_num_batched_tokens=max(512, prompt_len), kv_cache_memory=2 * 1024**3))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # Warm-up: one short request, so one-time costs stay out of the figure.
    core.add_request("warmup", random_prompts(1, 16, core.vocab_size, 0)[0],
                     SamplingParams(max_tokens=4, ignore_eos=True))
    while core.has_unfinished():
        core.step()
    for i, ids in enumerate(random_prompts(batch, prompt_len, core.vocab_size, seed)):
        core.add_request(f"r{i}", ids, params)
    total = StepTimings()
    steps = 0
    produced = 0
    t0 = time.perf_counter()
    while core.has_unfinished():
        outcome = core.step()
        produced += sum(len(o.new_token_ids) for o in outcome.outputs)
        t = outcome.stats.timings
        total.schedule += t.schedule
        total.prepare += t.prepare
        total.forward += t.forward
        total.sample += t.sample
        total.emit += t.emit
        steps += 1
    elapsed = time.perf_counter() - t0
    core.backend.shutdown()
    return {"tok_s": produced / elapsed, "elapsed": elapsed, "steps": steps, "timings": total}


def hf_folder_for(model_path: Path, workdir: Path) -> Path:
    """transformers runs the same dense weights Baton runs: a GGUF is exported
    as a Hugging Face folder first (transformers' own GGUF path keeps the
    blocks quantized and computes differently)."""
    if model_path.is_dir():
        return model_path
    from backends.loader import load_model
    from backends.loader.export import export_hf_folder
    out = workdir / model_path.stem
    if not (out / "model.safetensors").exists():
        export_hf_folder(load_model(model_path, dtype=torch.float32), out, torch.float32)
    return out


def bench_transformers(folder: Path, dtype: str, batch: int, prompt_len: int,
                       output_len: int, seed: int) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    vocab = model.config.vocab_size
    warm = torch.tensor(random_prompts(1, 16, vocab, 0))
    with torch.inference_mode():
        model.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=0)
        ids = torch.tensor(random_prompts(batch, prompt_len, vocab, seed))
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - t0
    produced = (out.shape[1] - prompt_len) * batch
    return {"tok_s": produced / elapsed, "elapsed": elapsed}


def split(t: StepTimings) -> str:
    total = t.total or 1.0
    return " / ".join(f"{name} {100 * getattr(t, name) / total:.1f}%"
                      for name in ("schedule", "prepare", "forward", "sample", "emit"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()

    model_path = resolve_model_path(args.model)
    workdir = Path(tempfile.mkdtemp(prefix="baton-bench-"))
    hf_folder = None if args.no_transformers else hf_folder_for(model_path, workdir)
    print(f"# {time.strftime('%Y-%m-%d')} {platform.node()} {platform.processor() or ''} "
          f"torch {torch.__version__} threads {torch.get_num_threads()}")
    print(f"# model {model_path.name}, {args.prompt} prompt + {args.output} output tokens")
    print("| dtype | batch | Baton tok/s | transformers tok/s | ratio | Baton step split "
          "(schedule / prepare / forward / sample / emit) |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        for batch in args.batches:
            b = bench_baton(args.model, dtype, batch, args.prompt, args.output, args.seed)
            hf = None
            if not args.no_transformers:
                hf = bench_transformers(hf_folder, dtype, batch, args.prompt, args.output,
                                        args.seed)
            hf_cell = f"{hf['tok_s']:.1f}" if hf else "—"
            ratio = f"{b['tok_s'] / hf['tok_s']:.2f}x" if hf else "—"
            print(f"| {dtype} | {batch} | {b['tok_s']:.1f} | {hf_cell} | {ratio} | "
                  f"{split(b['timings'])} |", flush=True)


if __name__ == "__main__":
    main()
