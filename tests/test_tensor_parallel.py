"""Tensor parallelism over torch.distributed (gloo on CPU): the sharded
engine gives the unsharded one's greedy tokens, token for token, and its
logprobs within 1e-4, on the tiny Llama / Qwen2 / Qwen3 (GQA, biases, q/k
norms), Gemma 2, Phi-3 and Qwen3-MoE (see NEW below), batched, in chunks and through preemption; the death of a rank is in
test_tensor_parallel_faults.py.

Each architecture's TP=2 engine (rank 0 here, rank 1 a spawned worker) is
built once and driven through every scenario by EngineCores that share its
backend: the scenarios differ only in scheduling, which is rank 0's alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.config import ModelConfig, MoEConfig
from backends.interface import SamplingParams
from backends.parallel.config import ParallelConfig, ParallelConfigError
from backends.models.weight_spec import GATE_UP_PACKED, QKV_PACKED
from backends.parallel.sharding import CheckpointShard, Partition, ShardingError
from scheduler.engine import EngineCore
from scheduler.speculative import SpeculativeConfig, Speculator
from tests.engine_helpers import OracleProposer, assert_all_free, make_engine, run_all

# Slow (tensor-parallel ranks in processes): the full suite runs these, ./scripts/test.sh --quick
# does not.
pytestmark = pytest.mark.slow

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
LENGTHS = {"batched": (3, 17, 40, 90), "chunked": (3, 17, 40, 90),
           "preemption": (9, 17, 18, 20, 24)}
# Scheduling per scenario; the preemption pool (26 blocks of 4) forces the
# latest admitted requests out and back in.
SCHEDULING = {"batched": dict(max_num_batched_tokens=512),
              "chunked": dict(max_num_batched_tokens=16),
              "preemption": dict(max_num_batched_tokens=512, num_kv_blocks=26)}
BLOCK_SIZE = 4


def _config(heads: int, kv_heads: int, **kw) -> ModelConfig:
    return ModelConfig("llama", vocab_size=kw.pop("vocab", 100), hidden_size=64,
                       intermediate_size=kw.pop("inter", 96), num_layers=1,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=8, **kw)


# ------------------------------------------------------------------ layout
def test_partition_splits_whole_gqa_groups():
    # SmolLM2-135M's shape: 9 heads in 3 KV groups on 2 ranks -> 2 groups and 1.
    config = _config(9, 3, inter=1536, vocab=49152)
    p0, p1 = (Partition.of(config, 2, r) for r in (0, 1))
    assert (p0.heads, p0.kv_heads, p1.heads, p1.kv_heads) == ((0, 6), (0, 2), (6, 9), (2, 3))
    assert p0.intermediate == (0, 768) and p1.intermediate == (768, 1536)
    assert p0.vocab == (0, 24576) and p1.vocab == (24576, 49152)
    local = p1.local_config(config)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size,
            local.vocab_size) == (3, 1, 768, 24576)


def test_partition_replicates_kv_heads_when_fewer_than_ranks_and_pads_vocab():
    config = _config(4, 2, vocab=101)
    parts = [Partition.of(config, 4, r) for r in range(4)]
    assert [p.heads for p in parts] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [p.kv_heads for p in parts] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [p.vocab for p in parts] == [(0, 26), (26, 52), (52, 78), (78, 104)]
    assert parts[0].padded_vocab_size == 104


@pytest.mark.parametrize("heads, kv_heads, size", [(4, 2, 3), (6, 2, 4)])
def test_partition_refuses_a_split_that_breaks_a_group(heads, kv_heads, size):
    with pytest.raises(ShardingError, match="cannot be split"):
        Partition.of(_config(heads, kv_heads), size, 0)


def test_partition_splits_packed_tensors_and_experts_part_by_part():
    """Phi-3's packed q|k|v and gate|up tensors: each rank keeps its rows of
    every part; a mixture of experts: every expert's rows, like a dense MLP."""
    moe = MoEConfig(num_experts=4, experts_per_token=2, intermediate_size=30)
    config = _config(4, 2, inter=96, packed_projections=True)
    p1 = Partition.of(config, 2, 1)
    # q rows 32, k and v rows 16 each; rank 1 has heads 2-3 and KV head 1
    assert p1.ranges(QKV_PACKED) == [(16, 32), (40, 48), (56, 64)]
    assert p1.ranges(GATE_UP_PACKED) == [(48, 96), (144, 192)]
    packed = torch.arange(64.0)[:, None].expand(64, 64)  # row i holds i
    shard = CheckpointShard(config, 2, 1)
    taken = shard.take("model.layers.0.self_attn.qkv_proj.weight", packed)
    assert taken[:, 0].tolist() == [*range(16, 32), *range(40, 48), *range(56, 64)]
    expert = Partition.of(_config(4, 2, moe=moe), 2, 1)
    assert expert.expert_intermediate == (15, 30)
    assert expert.local_config(_config(4, 2, moe=moe)).moe.intermediate_size == 15
    with pytest.raises(ShardingError, match="packed gate/up tensors of experts"):
        Partition.of(_config(4, 2, moe=moe, packed_projections=True), 2, 0)


def test_parallel_config_checks_the_layout():
    assert list(ParallelConfig(tensor_parallel_size=4, nnodes=2, node_rank=1).node_ranks) == [2, 3]
    with pytest.raises(ParallelConfigError, match="must divide"):
        ParallelConfig(tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ParallelConfigError, match="node-rank"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=2)


def test_a_rank_reads_only_its_shard_of_a_safetensors_checkpoint(tiny_qwen2_dir):
    from backends.loader import load_model
    from backends.parallel.sharding import CheckpointShard
    full = load_model(tiny_qwen2_dir).weights
    shard = load_model(tiny_qwen2_dir, shard=lambda c: CheckpointShard(c, 2, 1)).weights
    attn = "model.layers.1.self_attn."
    # 4 heads / 2 KV heads of 16 dims, MLP 128, vocabulary 512: rank 1 holds the
    # second half of each, and all of every norm.
    assert torch.equal(shard[attn + "q_proj.weight"], full[attn + "q_proj.weight"][32:])
    assert torch.equal(shard[attn + "k_proj.bias"], full[attn + "k_proj.bias"][16:])
    assert torch.equal(shard[attn + "o_proj.weight"], full[attn + "o_proj.weight"][:, 32:])
    assert torch.equal(shard["model.layers.0.mlp.down_proj.weight"],
                       full["model.layers.0.mlp.down_proj.weight"][:, 64:])
    assert torch.equal(shard["lm_head.weight"], full["lm_head.weight"][256:])
    assert torch.equal(shard["model.norm.weight"], full["model.norm.weight"])


def test_cli_flags_reach_the_parallel_config():
    import argparse

    from service.cli import add_engine_flags, engine_args_from
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    ns = parser.parse_args(["--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
                            "--master-addr", "10.0.0.1", "--master-port", "29400",
                            "--distributed-timeout", "30"])
    assert engine_args_from(ns).parallel == ParallelConfig(
        tensor_parallel_size=4, nnodes=2, node_rank=1, master_addr="10.0.0.1",
        master_port=29400, timeout=30.0)


def test_serve_refuses_a_step_timeout_with_tensor_parallelism(capsys):
    from service.cli import main
    assert main(["serve", "--tensor-parallel-size", "2", "--step-timeout", "5"]) == 2
    assert "--distributed-timeout" in capsys.readouterr().err


def test_each_rank_of_a_node_gets_its_own_cores(monkeypatch):
    """--threads T per rank, pinned: rank i of a node on cores i*T..i*T+T-1
    of the process's CPU set (default T: an equal share); too few cores for
    that, nothing is pinned; a second node numbers its ranks on from the first."""
    from service import tensor_parallel as tp
    from service.config import EngineArgs
    monkeypatch.setattr(tp.os, "sched_getaffinity", lambda pid: {2, 3, 4, 5, 6, 7, 8, 9})
    assert tp.core_layout(2, None) == [(2, 3, 4, 5), (6, 7, 8, 9)]
    assert tp.core_layout(4, 2) == [(2, 3), (4, 5), (6, 7), (8, 9)]
    assert tp.core_layout(2, 1) == [(2,), (3,)]
    assert tp.core_layout(4, 3) is None
    specs = tp._specs(EngineArgs(threads=2, parallel=ParallelConfig(
        tensor_parallel_size=4, nnodes=2, node_rank=1)), port=29500)
    assert [(s.rank, s.cores, s.threads) for s in specs] == [(2, (2, 3), 2), (3, (4, 5), 2)]
    unpinned = tp._specs(EngineArgs(threads=3, parallel=ParallelConfig(
        tensor_parallel_size=4)), port=29500)
    assert [(s.cores, s.threads) for s in unpinned] == [(None, 3)] * 4


# ------------------------------------------------------------- agreement
def _prompts(lengths, seed: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {f"p{i}-{n}": torch.randint(3, 512, (n,), generator=gen).tolist()
            for i, n in enumerate(lengths)}


class _SmallerPool:
    """The backend as an engine with fewer KV blocks sees it (the scheduler
    hands out only the first ``num_kv_blocks``)."""

    def __init__(self, backend, num_kv_blocks: int) -> None:
        self._backend = backend
        self.num_kv_blocks = num_kv_blocks

    def __getattr__(self, name):
        return getattr(self._backend, name)


def _core_over(core: EngineCore, scenario: str) -> EngineCore:
    settings = dict(SCHEDULING[scenario])
    backend = core.backend
    if "num_kv_blocks" in settings:
        backend = _SmallerPool(backend, settings.pop("num_kv_blocks"))
    config = dataclasses.replace(core.config, max_model_len=64 if scenario == "preemption"
                                 else core.config.max_model_len, **settings)
    return EngineCore(backend, core.tokenizer, config, vocab_size=core.vocab_size,
                      eos_token_ids=tuple(core.eos_token_ids), model_name=core.model_name,
                      generation=core.generation)


# Gemma 2: sliding-window and soft-capped attention, sandwich norms, the
# scaled embedding (after the vocabulary-parallel all-reduce) and the final
# logit soft-cap (on the gathered logits); Phi-3: packed tensors split part
# by part, partial rotary; Qwen3-MoE: experts split by rows, one all-reduce
# per MoE layer; Mixtral: the same, in every layer, under Mistral's window.
NEW = ("gemma2", "phi3", "qwen3_moe", "mixtral")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", *NEW])
def engines(request):
    """(arch, TP=1 core, TP=2 core) over the same tiny model."""
    arch = request.param
    path = (request.getfixturevalue("new_arch_dirs")(arch) if arch in NEW
            else request.getfixturevalue(f"tiny_{arch}_dir"))
    common = dict(block_size=BLOCK_SIZE, num_kv_blocks=256)
    threads = torch.get_num_threads()  # rank 0 takes its share of the cores
    single = make_engine(path, **common)
    sharded = make_engine(path, parallel=ParallelConfig(tensor_parallel_size=2,
                                                        pin_cpus=False), **common)
    yield arch, single, sharded
    sharded.backend.shutdown()
    torch.set_num_threads(threads)


@pytest.mark.parametrize("scenario", list(SCHEDULING))
def test_tp2_greedy_tokens_equal_tp1(engines, scenario):
    arch, single, sharded = engines
    assert sharded.backend.parallel.size == 2
    local = sharded.backend.model_config  # rank 0's half of every split
    assert local.num_heads * 2 == single.backend.config.num_heads
    if local.moe is not None:
        assert local.moe.intermediate_size * 2 == single.backend.config.moe.intermediate_size
    prompts = _prompts(LENGTHS[scenario], seed=len(arch))
    one, two = _core_over(single, scenario), _core_over(sharded, scenario)
    expected = run_all(one, prompts, GREEDY)
    got = run_all(two, prompts, GREEDY)
    if scenario == "preemption":
        assert two.scheduler.num_preemptions_total > 0, "the small pool forced no preemption"
    for rid in prompts:
        assert got[rid].token_ids == expected[rid].token_ids, f"{arch}/{scenario}/{rid}"
        for a, b in zip(got[rid].logprobs, expected[rid].logprobs):
            assert a.token_id == b.token_id
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("engines", ["llama"], indirect=True)
def test_tp2_prompt_logprobs_and_seeded_sampling_equal_tp1(engines):
    """Prompt logprobs take extra logits gathers, in step with the other rank;
    seeded sampling happens on rank 0 alone and so reproduces."""
    arch, single, sharded = engines
    prompts = _prompts((5, 33), seed=7)
    params = {"p0-5": SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                     prompt_logprobs=2),
              "p1-33": SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=8,
                                      ignore_eos=True)}
    results = []
    for core in (_core_over(single, "chunked"), _core_over(sharded, "chunked")):
        got = {}
        for rid, ids in prompts.items():
            core.add_request(rid, ids, params[rid])
        while core.has_unfinished():
            for out in core.step().outputs:
                entry = got.setdefault(out.request_id, {"ids": [], "prompt": []})
                entry["ids"] += out.new_token_ids
                entry["prompt"] += out.prompt_logprobs or []
        assert_all_free(core)  # (the backend is shared with the next test's cores)
        results.append(got)
    one, two = results
    assert two["p1-33"]["ids"] == one["p1-33"]["ids"]
    assert [e.token_id for e in two["p0-5"]["prompt"]] == prompts["p0-5"][1:]
    for a, b in zip(two["p0-5"]["prompt"], one["p0-5"]["prompt"]):
        assert abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.parametrize("engines", ["llama"], indirect=True)
def test_tp2_speculative_decoding_equals_tp1_without(engines):
    """Verification rows (k + 1 sampled positions) reach the other rank, which
    gathers as many rows of logits: the tokens of the plain TP=1 run, with
    proposals right at every other position."""
    arch, single, sharded = engines
    prompts = _prompts((5, 17, 30), seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    reference = run_all(_core_over(single, "batched"), prompts, params)
    spec = SpeculativeConfig("ngram", 3)
    proposer = OracleProposer({r: v.token_ids for r, v in reference.items()}, "half",
                              single.vocab_size)
    core = _core_over(sharded, "batched")
    core = EngineCore(core.backend, core.tokenizer, core.config, vocab_size=core.vocab_size,
                      eos_token_ids=tuple(core.eos_token_ids), model_name=core.model_name,
                      generation=core.generation,
                      speculator=Speculator(spec, sharded.backend.speculative_budget, proposer))
    got = run_all(core, prompts, params)
    assert sum(r.spec_accepted for r in got.values()) > 0
    for rid in prompts:
        assert got[rid].token_ids == reference[rid].token_ids, rid
        for a, b in zip(got[rid].logprobs, reference[rid].logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


# ------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_over_nccl_matches_tp1_on_cuda(tiny_qwen2_dir):
    """The same code on CUDA: NCCL all-reduces, a device per rank."""
    prompts = _prompts(LENGTHS["batched"], seed=3)
    common = dict(device="cuda", block_size=BLOCK_SIZE)
    expected = run_all(make_engine(tiny_qwen2_dir, **common), prompts, GREEDY)
    sharded = make_engine(tiny_qwen2_dir, parallel=ParallelConfig(tensor_parallel_size=2),
                          **common)
    try:
        got = run_all(sharded, prompts, GREEDY)
    finally:
        sharded.backend.shutdown()
    for rid in prompts:
        assert got[rid].token_ids == expected[rid].token_ids, rid

