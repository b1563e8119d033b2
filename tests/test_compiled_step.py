"""The compiled token-row step (backends/compiled_step.py): the model's own
forward under torch.compile for decode steps and other steps of short rows,
giving the eager forward's tokens and logprobs, agreeing with transformers,
planned only where it can run, and cached on disk."""

from __future__ import annotations

import pytest
import torch

from backends.execution import Availability, CpuFeatures, ExecutionOptions, make_plan
from backends.interface import SamplingParams
from tests.engine_helpers import make_engine, run_all
from tests.test_engine_agreement import _prompts, _reference, assert_matches_reference

# Slow (torch.compile: seconds to tens of seconds a graph): the full suite runs these,
# ./scripts/test.sh --quick does not.
pytestmark = pytest.mark.slow

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_NEW, ignore_eos=True,
                         seed=7, logprobs=2)


@pytest.fixture(autouse=True)
def compile_cache(tmp_path_factory, monkeypatch):
    """One compile cache for the module (later engines load what the first
    built), away from the user's."""
    path = tmp_path_factory.getbasetemp() / "inductor-cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
    return path


def _engine(path, compiled: bool, **kwargs):
    core = make_engine(path, compile=compiled, **kwargs)
    assert core.backend.plan.step == ("compiled" if compiled else "eager"), \
        core.backend.plan.describe()
    return core


def _same(a, b, atol: float) -> None:
    for rid in a:
        assert a[rid].token_ids == b[rid].token_ids, rid
        assert len(a[rid].logprobs) == len(b[rid].logprobs)
        for x, y in zip(a[rid].logprobs, b[rid].logprobs):
            assert x.token_id == y.token_id
            assert abs(x.logprob - y.logprob) <= atol, (rid, x, y)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_compiled_step_gives_the_eager_tokens_and_logprobs(request, arch, dtype):
    """Greedy and seeded sampling, prompts of 3 to 90 tokens (every step's
    tokens are token rows), batched and alone: the compiled graphs run and
    change nothing."""
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    eager = _engine(path, False, dtype=dtype)
    compiled = _engine(path, True, dtype=dtype)
    prompts = _prompts(eager.vocab_size, seed=3, lengths=(3, 17, 40, 90))
    params = {rid: (GREEDY if i % 2 else SAMPLED) for i, rid in enumerate(prompts)}
    one = {"solo": prompts[next(iter(prompts))]}
    atol = 1e-5
    _same(run_all(compiled, prompts, params), run_all(eager, prompts, params), atol)
    _same(run_all(compiled, one, GREEDY), run_all(eager, one, GREEDY), atol)
    assert compiled.backend._compiled.graphs_built == {"one", "many"}
    # The graphs the warm-up built are the ones the steps ran: nothing recompiled.
    assert compiled.backend._compiled.graphs_compiled() == 2


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_weights_compile_by_default(tiny_llama_dir, quantization):
    """Quantized linears run the compiled step unless told otherwise (it is
    the faster step there, docs/benchmarks.md), and it computes what the
    eager forward over the same quantized weights does, with the warm-up's
    graphs whatever the thread count."""
    default = make_engine(tiny_llama_dir, quantization=quantization, compile=None)
    assert default.backend.plan.step == "compiled", default.backend.plan.describe()
    eager = _engine(tiny_llama_dir, False, quantization=quantization)
    prompts = _prompts(eager.vocab_size, seed=11, lengths=(5, 33))
    params = {rid: (GREEDY if i % 2 else SAMPLED) for i, rid in enumerate(prompts)}
    expected = run_all(eager, prompts, params)
    threads = torch.get_num_threads()
    try:
        for n in (1, threads):  # as the thread governor moves it under load
            torch.set_num_threads(n)
            _same(run_all(default, prompts, params), expected, 1e-5)
    finally:
        torch.set_num_threads(threads)
    assert default.backend._compiled.graphs_built == {"one", "many"}
    assert default.backend._compiled.graphs_compiled() == 2  # the warm-up's, reused


@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption"])
def test_compiled_step_matches_transformers(tiny_llama_dir, scenario):
    """float32 greedy tokens equal transformers', logprobs within 1e-4,
    through chunked prefill (chunks of 7 tokens: token rows, compiled) and
    preemption."""
    kwargs = (dict(max_num_batched_tokens=7) if scenario == "chunked_prefill"
              else dict(num_kv_blocks=26, block_size=4, max_model_len=64))
    core = _engine(tiny_llama_dir, True, **kwargs)
    lengths = (3, 17, 40, 90) if scenario == "chunked_prefill" else (9, 17, 18, 20, 24)
    prompts = _prompts(core.vocab_size, seed=5, lengths=lengths)
    results = run_all(core, prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                    ignore_eos=True, logprobs=5))
    if scenario == "preemption":
        assert core.scheduler.num_preemptions_total > 0
    assert_matches_reference(results, _reference(tiny_llama_dir, prompts), scenario)


def test_compiled_step_calls_no_operator_through_python(tiny_llama_dir):
    """The compiled step's wrapper is C++ (Inductor's ``cpp_wrapper``): its
    operators (Baton's linears, attention, norms) are called without a Python
    frame each. CPython 3.11 puts frames on 16 KiB chunks and unmaps a chunk
    as soon as its first frame returns; where a step's frames sit at a chunk's
    end, a Python frame per operator is an mmap, a munmap and a TLB shootdown
    per operator (a 135M model's step of one token: 24 ms instead of 14)."""
    import sys
    core = _engine(tiny_llama_dir, True)
    compiled = core.backend._compiled
    run_all(core, _prompts(core.vocab_size, seed=2, lengths=(9,)), GREEDY)  # warm
    frames: list[str] = []
    steps = []

    def counted(real):
        def call(*args):
            steps.append(args[0].shape[0])
            sys.setprofile(lambda frame, event, _arg: frames.append(frame.f_code.co_filename)
                           if event == "call" else None)
            try:
                return real(*args)
            finally:
                sys.setprofile(None)
        return call
    assert set(compiled._graphs) == {False, True}  # the warm-up's, called directly
    assert all(graph is not compiled._fn for graph in compiled._graphs.values())
    compiled._graphs = {many: counted(graph) for many, graph in compiled._graphs.items()}
    prompts = _prompts(core.vocab_size, seed=3, lengths=(20,))  # a prefill, then one-token steps
    _same(run_all(core, prompts, GREEDY), run_all(_engine(tiny_llama_dir, False), prompts,
                                                  GREEDY), 1e-5)
    assert len(steps) >= MAX_NEW and 1 in steps and max(steps) > 1  # both graphs ran
    operators = [f for f in frames if f.endswith(("torch/_ops.py", "backends/ops.py",
                                                  "backends/linear.py"))]
    assert not operators, f"{len(operators)} Python frames of operators in {len(steps)} steps"


def test_compile_cache_is_baton_s_own_once_dynamo_is_imported(tmp_path, monkeypatch):
    """Importing Dynamo sets TORCHINDUCTOR_CACHE_DIR to torch's default (a
    /tmp folder); Baton's cache (BATON_COMPILE_CACHE, else
    ~/.cache/baton/inductor) still wins over that, and a folder the user named
    in TORCHINDUCTOR_CACHE_DIR wins over Baton's."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir
    from backends.compiled_step import use_compile_cache
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("BATON_COMPILE_CACHE", str(tmp_path / "baton"))
    assert cache_dir() == default_cache_dir()  # what importing Dynamo does
    assert use_compile_cache() == tmp_path / "baton"
    assert cache_dir() == str(tmp_path / "baton")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache() == tmp_path / "mine"


def test_steps_call_the_graphs_code_and_the_tests_check_their_guards(tiny_llama_dir):
    """After the warm-up's calls through Dynamo, steps call each graph's code
    directly (no Dynamo frame evaluation a step); with the tests'
    ``check_guards``, inputs that break the guards Dynamo would check (a block
    table one column wide, which Dynamo specialises) raise instead of running
    a graph traced for others."""
    from backends.attention import TokenRowsMetadata
    core = _engine(tiny_llama_dir, True)
    compiled = core.backend._compiled
    assert compiled.through_dynamo is None
    assert set(compiled._graphs) == {False, True}
    assert all(graph is not compiled._fn for graph in compiled._graphs.values())
    ids = torch.zeros(1, dtype=torch.long)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="guards"):
        compiled(ids, ids.clone(), TokenRowsMetadata(
            ids.clone(), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long),
            core.backend.block_size), torch.zeros(1, dtype=torch.long))


def test_a_graph_whose_code_is_not_found_runs_through_dynamo(tiny_llama_dir, monkeypatch,
                                                             caplog):
    """Where Dynamo's cache does not show the graph a call compiled (another
    torch than this one), the step says so in the log and keeps calling
    through Dynamo, with the same results."""
    import logging

    import torch._dynamo.eval_frame as eval_frame
    monkeypatch.setattr(eval_frame, "_debug_get_cache_entry_list", lambda code: [])
    with caplog.at_level(logging.WARNING, logger="baton.backend"):
        core = _engine(tiny_llama_dir, True)
    compiled = core.backend._compiled
    assert compiled.through_dynamo == "0 new graphs for one call"
    assert "runs through Dynamo's call" in caplog.text
    assert all(graph is compiled._fn for graph in compiled._graphs.values())
    prompts = _prompts(core.vocab_size, seed=4, lengths=(6, 30))
    _same(run_all(core, prompts, GREEDY),
          run_all(_engine(tiny_llama_dir, False), prompts, GREEDY), 1e-5)
    monkeypatch.undo()
    assert compiled.graphs_compiled() == 2


def test_compile_cache_is_written_and_reused(tiny_llama_dir, compile_cache):
    """The first engine fills the on-disk cache; a second engine of the same
    model finds its graphs there."""
    _engine(tiny_llama_dir, True)
    files = {p for p in compile_cache.rglob("*") if p.is_file()}
    assert files, "nothing was written to the compile cache"
    _engine(tiny_llama_dir, True, dtype="float32")
    assert {p for p in compile_cache.rglob("*") if p.is_file()} >= files


AMX = CpuFeatures(avx2=True, avx512=True, avx512_bf16=True, amx_bf16=True)
ALL = Availability(native_kernels=frozenset({"avx512_bf16"}),
                   onednn_dtypes=frozenset({"float32", "bfloat16"}), amx_tiles=True,
                   cpp_compiler=True)


def test_plan_compiles_only_where_it_can(new_arch_dirs):
    """Compiled where asked, with native kernels and a C++ compiler; eager
    with the reason otherwise (no compiler, --enforce-eager, tensor
    parallelism, architectures whose layers the token-row step lacks)."""
    import json
    from backends.loader.hf import parse_hf_config
    on = ExecutionOptions(compile=True)
    assert make_plan("cpu", "bfloat16", "none", AMX, ALL, on).step == "compiled"
    assert "decode steps compiled" in make_plan("cpu", "bfloat16", "none", AMX, ALL,
                                                on).describe()
    # By default: compiled wherever the plan can, unless told not to.
    assert make_plan("cpu", "bfloat16", "none", AMX, ALL).step == "compiled"
    assert make_plan("cpu", "float32", "none", AMX, ALL).step == "compiled"
    assert make_plan("cpu", "bfloat16", "none", AMX, ALL,
                     ExecutionOptions(compile=False)).step == "eager"
    for quantization in ("int8", "int4", "gguf"):
        assert make_plan("cpu", "bfloat16", quantization, AMX, ALL).step == "compiled"
        assert make_plan("cpu", "float32", quantization, AMX, ALL,
                         ExecutionOptions(cpu_kind="avx2")).step == "eager"  # no avx2 kernels in ALL
        assert make_plan("cpu", "bfloat16", quantization, AMX, ALL,
                         ExecutionOptions(compile=False)).step == "eager"
    no_cxx = make_plan("cpu", "bfloat16", "none", AMX,
                       Availability(native_kernels=ALL.native_kernels,
                                    onednn_dtypes=ALL.onednn_dtypes), on)
    assert no_cxx.step == "eager" and "no C++ compiler" in no_cxx.describe()
    tp = make_plan("cpu", "bfloat16", "none", AMX, ALL,
                   ExecutionOptions(compile=True, tensor_parallel_size=2))
    assert tp.step == "eager"
    for arch, what in (("gemma2", "soft-capped"), ("mistral", "sliding")):
        raw = json.loads((new_arch_dirs(arch) / "config.json").read_text())
        plan = make_plan("cpu", "float32", "none", AMX, ALL, on, parse_hf_config(raw))
        assert plan.step == "eager" and what in plan.describe(), plan.describe()


def test_compile_and_enforce_eager_flags_and_variables(monkeypatch, tiny_llama_dir):
    """--compile (BATON_COMPILE=1) asks for the compiled step, BATON_COMPILE=0
    refuses it; --enforce-eager (BATON_ENFORCE_EAGER) overrides both; the
    default (None) leaves it to the plan: compiled for this model."""
    from service.cli import build_parser, engine_args_from
    monkeypatch.delenv("BATON_ENFORCE_EAGER", raising=False)
    monkeypatch.delenv("BATON_COMPILE", raising=False)

    def args(*argv):
        return engine_args_from(build_parser().parse_args(["serve", *argv]))
    assert (args().compile, args().enforce_eager) == (None, False)
    assert args("--compile").compile and args("--enforce-eager").enforce_eager
    monkeypatch.setenv("BATON_COMPILE", "1")
    assert args().compile
    monkeypatch.setenv("BATON_COMPILE", "0")
    assert args().compile is False and args("--compile").compile
    monkeypatch.setenv("BATON_COMPILE", "1")
    monkeypatch.setenv("BATON_ENFORCE_EAGER", "1")
    assert args().enforce_eager
    assert make_engine(tiny_llama_dir, compile=True, enforce_eager=True).backend.plan.step \
        == "eager"
    assert make_engine(tiny_llama_dir, compile=None,
                       enforce_eager=False).backend.plan.step == "compiled"
    assert make_engine(tiny_llama_dir, quantization="int8", compile=None,
                       enforce_eager=True).backend.plan.step == "eager"
