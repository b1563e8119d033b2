"""The model's forward for token-row steps, compiled with torch.compile.

Steps are structurally identical from one to the next: every token attends
to its own context through the KV blocks, as a decode does
(``backends.attention.TokenRowsMetadata``), whether it is a decode, one of a
speculative verification row's tokens or of a prefill chunk's. That step is
traced once
by Dynamo from the one model definition (backends/models/decoder.py) and
compiled by Inductor, with the implementation of each step the execution
plan chose: the native operators (``torch.ops.baton``: the paged decode
attention, the bf16 linears, and where the plan says native, the fused norm,
rotary + KV store and activation kernels) stay opaque calls from the
generated C++ wrapper, as do torch's own matmuls (int4 / int8 weights);
the rest of what the plan leaves to torch (the embedding, every elementwise
step where no native kernel is planned) becomes generated C++ loops.
(Tracing torch's norms, rotary and activation for Inductor to fuse instead
measured level and compiled 1.7x as long: docs/benchmarks.md.) Nothing in
the traced region is a Python int of the step: the
token count and the block tables' width are dynamic dimensions, so two
graphs serve every step (one token, which Dynamo specialises, and more).

A step's first call of each graph goes through Dynamo, which compiles it
(or loads it) and keeps the graph's code: the code that fetches the
model's tensors and calls the compiled graph. Later steps call that code as
a function of its own, without Dynamo's frame evaluation and guard check
(~0.3 ms of a 135M model's ~10 ms one-row step on the AVX2 EPYC;
docs/benchmarks.md). The guards Dynamo would check (dtypes, which
dimensions are dynamic, at least two table columns) hold by construction
(backends/input_batch.py); the tests check them at every step
(``CompiledStep.check_guards``).

Compiling costs tens of seconds per graph on two cores; Inductor keeps what
it built under ``compile_cache_dir()`` (``$BATON_COMPILE_CACHE``, default
``~/.cache/baton/inductor``), keyed by the graph, the torch version and the
CPU, so a later start traces again (seconds) but compiles nothing.
``warm_up`` builds both graphs before the server reports ready, with a
progress line.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import types
from pathlib import Path

import torch

from backends.attention import TokenRowsMetadata
from backends.progress import heartbeat

log = logging.getLogger("baton.backend")

def compile_cache_dir() -> Path:
    env = os.environ.get("BATON_COMPILE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "baton" / "inductor"


def use_compile_cache(path: Path | None = None) -> Path:
    """Point Inductor's on-disk caches at ``path`` (default
    ``compile_cache_dir()``), unless TORCHINDUCTOR_CACHE_DIR names one. Torch
    sets that variable itself, to its default /tmp folder, when Dynamo is
    imported: that value is not a choice, and Baton's folder replaces it."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named and os.path.abspath(named) == os.path.abspath(default_cache_dir()):
        named = None
    path = Path(named or path or compile_cache_dir())
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def _token_rows_forward(model: torch.nn.Module,
                        kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
    def forward(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor,
                logits_index: torch.Tensor, block_size: int) -> torch.Tensor:
        meta = TokenRowsMetadata(slot_mapping, block_tables, seq_lens, block_size)
        hidden = model(input_ids, positions, kv_caches, meta, logits_index)
        return model.compute_logits(hidden, float32=False)
    return forward


_compiled_steps = itertools.count()


def _step_guards(entries) -> list[bool]:
    """Which of Dynamo's guards the step keeps. The model's modules never
    change after loading: their tensors' guards would cost ~1 ms a step for
    nothing. The global-state guard (grad mode, default dtype, ..., and
    torch's thread count) goes too: the step runs only from the backend's
    inference-mode step, where none of them changes but the thread count,
    which the governor moves with the machine's load, and each new count
    would otherwise recompile (seconds, mid-serving) a graph whose loops
    ``cpp.dynamic_threads`` leaves to the count of the moment anyway."""
    keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    return [k and entry.guard_type != "GLOBAL_STATE" for k, entry in zip(keep, entries)]


def _own_code(fn):
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs
    per code object, guarded on what the frame reads; the graphs of one
    model's step then never meet another model's (a draft model beside its
    target, several engines in one process), so the guards on the model's
    modules can be skipped (they cost ~1 ms a step) without one model's graph
    running another's weights."""
    code = fn.__code__.replace(co_name=f"baton_step_{next(_compiled_steps)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)


class CompiledStep:
    """``logits = step(input_ids, positions, token_rows, logits_index)``: the
    model's forward over every token of the step (each attending as
    ``token_rows`` says) and the output projection of the rows
    ``logits_index`` names, in the activation dtype, [len(logits_index),
    vocab]."""

    def __init__(self, model: torch.nn.Module,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.cache_dir = use_compile_cache()
        forward = _own_code(_token_rows_forward(model, kv_caches))
        self._code = forward.__code__
        options = {
            "guard_filter_fn": _step_guards,
            # Generated loops take the thread count torch has when they run
            # (the governor's, backends/cpu_threads.py), not the compile's.
            "cpp.dynamic_threads": True,
            "size_asserts": False, "alignment_asserts": False,
            # The graph's wrapper in C++: no Python frame per operator. Each
            # such frame can cost an mmap, a munmap and a TLB shootdown
            # (CPython 3.11 unmaps a 16 KiB frame chunk as soon as its first
            # frame returns), and does where a step's frames end near a
            # chunk's end: 24 ms for a 135M step of 14. Alternating pairs,
            # AMX Xeon: 0.91-0.99x the Python wrapper's step, a first
            # compile about twice as long (docs/benchmarks.md).
            "cpp_wrapper": True,
            # The wrapper (a few thousand lines of operator calls) built at
            # -O1 apart from the generated loops (-O3): a first start of the
            # embedded model ready in 82 s instead of 128 on the AVX2 EPYC;
            # steps level (one row 1.02x, 16 alternating pairs, 0.92-1.17;
            # 32 rows 1.00x, 8 pairs; docs/benchmarks.md).
            "cpp_wrapper_build_separate": True,
        }
        self._fn = torch.compile(forward, fullgraph=True, dynamic=False, options=options)
        self._globals, self._closure = forward.__globals__, forward.__closure__
        # The one-token and the many-token graph's code as functions (or,
        # where that code could not be found, self._fn: Dynamo's call).
        self._graphs: dict[bool, object] = {}
        self.through_dynamo: str | None = None

    # Whether each step checks the guards Dynamo would have (the tests set it:
    # a step whose inputs break them raises instead of running the graph).
    check_guards = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: TokenRowsMetadata, logits_index: torch.Tensor) -> torch.Tensor:
        many = input_ids.shape[0] > 1
        picked = logits_index.shape[0]
        if many:
            # One graph for every token count above one: the rows read are
            # at least two as well (a copy of the last one where fewer are;
            # Dynamo would otherwise give 0 and 1 graphs of their own).
            if picked < 2:
                last = input_ids.shape[0] - 1
                logits_index = torch.cat([logits_index, logits_index.new_full(
                    (2 - picked,), last)])
        args = (input_ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                logits_index, meta.block_size)
        graph = self._graphs.get(many)
        if graph is None or graph is self._fn:  # a call through Dynamo, which reads the marks
            if many:
                for t in args[:6]:
                    torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(meta.block_tables, 1)
        logits = graph(*args) if graph is not None else self._first_call(many, args)
        return logits[:picked] if picked < logits.shape[0] else logits

    @property
    def graphs_built(self) -> set[str]:
        """Which graphs steps have run: "one" (token), "many"."""
        return {"many" if many else "one" for many in self._graphs}

    def _first_call(self, many: bool, args: tuple) -> torch.Tensor:
        """The step through Dynamo, which compiles (or loads) the graph for
        steps shaped as ``args``; that graph's code is kept as a function for
        the steps after."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        seen = {entry.code for entry in _debug_get_cache_entry_list(self._code)}
        logits = self._fn(*args)
        new = [entry for entry in _debug_get_cache_entry_list(self._code)
               if entry.code not in seen]
        if len(new) == 1:
            self._graphs[many] = self._direct(new[0])
        else:  # not what this torch does: say so, and keep Dynamo's call
            self.through_dynamo = f"{len(new)} new graphs for one call"
            log.warning("the step's %s graph runs through Dynamo's call: %s",
                        "many-token" if many else "one-token", self.through_dynamo)
            self._graphs[many] = self._fn
        return logits

    def _direct(self, entry):
        """Dynamo's code for one graph (its tensors fetched from the model,
        the compiled graph called) as a function of the step's arguments."""
        code = entry.code
        fn = types.FunctionType(code, self._globals, code.co_name, None, self._closure)
        if not self.check_guards:
            return fn
        names = code.co_varnames[:code.co_argcount]
        free = {name: cell.cell_contents
                for name, cell in zip(code.co_freevars, self._closure or ())}
        guards = entry.guard_manager

        def checked(*args):
            f_locals = {**free, **dict(zip(names, args))}
            if not guards.check(f_locals):
                raise RuntimeError("a step's inputs break its graph's guards: "
                                   f"{guards.check_verbose(f_locals)}")
            return fn(*args)
        return checked

    def graphs_compiled(self) -> int:
        """How many graphs Dynamo holds for this step (2 once warm: one
        token, more; a third is a recompile)."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        return len(_debug_get_cache_entry_list(self._code))

    def warm_up(self, block_size: int, device: torch.device, progress: bool = True) -> float:
        """Build (or load from the cache) the one-token and the many-token
        graphs, by running each once on a dummy step that writes block 0's
        first slots (the pool is idle: nothing reads them before a request
        writes its own). Returns the seconds it took."""
        start = time.perf_counter()
        with heartbeat(f"compiling the model's step (cache {self.cache_dir})",
                       enabled=progress, done_line=False):
            for t in (1, 2):
                # As a step passes them: the batch's tensors were made
                # outside inference mode, the rows to project inside it.
                # Dynamo guards on the difference (a dispatch key), so a
                # dummy made otherwise builds graphs no step reuses.
                ids = torch.zeros(t, dtype=torch.long, device=device)
                positions = torch.arange(t, device=device)
                meta = TokenRowsMetadata(
                    torch.arange(t, device=device), torch.zeros(t, 2, dtype=torch.long,
                                                                 device=device),
                    torch.arange(1, t + 1, device=device), block_size)
                with torch.inference_mode():
                    self(ids, positions, meta, torch.arange(t, device=device))
        seconds = time.perf_counter() - start
        log.info("compiled the model's step in %.1f s", seconds)
        return seconds
