"""benchmarks/plot.py's figures (the medians it draws) and serve_load's
reading of llama-server's per-request draft counts, which the speculative
decoding table reports as acceptance."""

from __future__ import annotations

import json

import pytest

from benchmarks.plot import _runs, figures, workload_series
from benchmarks.serve_load import RequestRecord, _StreamTally, summarize


def _row(tok_s, itl):
    return {"output_tok_per_s": tok_s, "itl_p50_ms": itl}


def test_figures_are_medians_over_rounds_at_the_top_concurrency(tmp_path):
    run = {"servers": {
        "baton": [{"1": _row(40, 20.0), "32": _row(300, 60)},
                  {"1": _row(44, 22.0), "32": _row(320, 61)},
                  {"1": _row(42, 30.0), "32": _row(310, 62)}],
        "llama": [{"1": _row(50, 18.0), "32": _row(150, 90)}],
    }}
    path = tmp_path / "amx-135m.json"
    path.write_text(json.dumps(run))
    groups, throughput, latency, top = figures(_runs([f"135M={path}", str(path)]))
    assert groups == ["135M", "amx-135m"]
    assert top == "c=32"
    assert throughput == {"baton": [310, 310], "llama": [150, 150]}
    assert latency == {"baton": [22.0, 22.0], "llama": [18.0, 18.0]}


def test_workload_series_groups_by_concurrency():
    runs = [("u1", {"servers": {"baton": [{"grounded": {"concurrency": 1,
                                                        "output_tok_per_s": 80.0}}]}}),
            ("u4", {"servers": {"baton": [{"grounded": {"concurrency": 4,
                                                        "output_tok_per_s": 150.0}},
                                          {"grounded": {"concurrency": 4,
                                                        "output_tok_per_s": 170.0}}]}})]
    levels, series = workload_series(runs, "grounded")
    assert levels == [1, 4]
    assert series == {"baton": {1: 80.0, 4: 160.0}}


def test_llama_server_draft_counts_become_acceptance():
    records = []
    for i, (proposed, accepted) in enumerate([(10, 7), (6, 3)]):
        tally = _StreamTally(0.0)
        tally.on_event(json.dumps({"choices": [{"index": 0, "text": "a"}]}), 0.1)
        tally.on_event(json.dumps({"choices": [{"index": 0, "text": "b",
                                                "finish_reason": "length"}],
                                   "timings": {"draft_n": proposed,
                                               "draft_n_accepted": accepted}}), 0.2)
        assert tally.draft == (proposed, accepted)
        record = RequestRecord(index=i, ttft_s=0.1, e2e_s=0.2, output_tokens=2)
        record.draft_tokens, record.draft_accepted = tally.draft
        records.append(record)
    run = dict(base_url="http://x", model="m", concurrency=1, num_requests=2, prompt_len=4,
               output_len=2, text_prompts=False, seed=0, first_request=0)
    result = summarize(records, 1.0, **run)
    assert (result.spec_proposed, result.spec_accepted) == (16, 10)
    plain = summarize([RequestRecord(index=0, output_tokens=2)], 1.0, **run)
    assert plain.spec_proposed is None and plain.spec_accepted is None


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional .[bench] extra")
    from benchmarks.plot import main
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"servers": {"baton": [{"1": _row(40, 20.0)}]}}))
    out = tmp_path / "img" / "x.png"
    assert main(["--out", str(out), f"135M={path}"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_spec_totals_count_from_zero_before_the_first_proposal():
    """A labelled counter has no sample until it is first incremented: a Baton
    page without spec lines is (0, 0), so a run's first proposals count."""
    from benchmarks.workloads import spec_totals
    assert spec_totals("# HELP baton_requests_total x\nbaton_requests_total 3\n") == (0.0, 0.0)
    page = ('baton_spec_decode_proposed_tokens_total{method="ngram"} 40\n'
            'baton_spec_decode_accepted_tokens_total{method="ngram"} 30\n'
            'baton_spec_decode_proposed_tokens_total{method="draft_model"} 2\n')
    assert spec_totals(page) == (42.0, 30.0)
    assert spec_totals("vllm:num_requests_running 0\n") is None


def test_grounded_and_chat_count_a_peers_failed_requests():
    """Throughput workloads count failures and keep the figures of the rest
    (a peer that drops a connection still gets a row); the prefix-cache
    workloads, whose figures compare the same requests, still refuse."""
    from benchmarks.workloads import _figures
    ok = RequestRecord(index=0, ttft_s=0.1, e2e_s=0.5, output_tokens=4)
    bad = RequestRecord(index=1)
    bad.fail("connection", "Server disconnected")
    run = dict(base_url="http://x", model="m", concurrency=2, num_requests=2, prompt_len=4,
               output_len=4, text_prompts=False, seed=0, first_request=0)
    result = summarize([ok, bad], 1.0, **run)
    figures = _figures(result, count_failures=True)
    assert figures["num_errors"] == 1 and figures["num_ok"] == 1
    assert figures["output_tok_per_s"] == 4.0
    with pytest.raises(RuntimeError, match="1 requests failed"):
        _figures(result)
