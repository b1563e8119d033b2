"""The Ray Serve ingress's /metrics merges the replicas' expositions, each
series labelled with its replica (service/replica_metrics.py)."""

from __future__ import annotations


def test_replica_metrics_merge_keeps_every_series_apart():
    """The Ray Serve ingress's /metrics: each replica's series, labelled."""
    from prometheus_client.parser import text_string_to_metric_families

    from service.replica_metrics import merge_expositions
    text = ("# HELP baton_requests_total Requests.\n# TYPE baton_requests_total counter\n"
            'baton_requests_total{finish_reason="stop"} %d\n')
    merged = merge_expositions({"a1": text % 3, "b2": text % 5})
    (family,) = [f for f in text_string_to_metric_families(merged)
                 if f.name == "baton_requests"]
    assert sorted((s.labels["replica"], s.value) for s in family.samples
                  if s.name == "baton_requests_total") == [("a1", 3.0), ("b2", 5.0)]
    assert merged.count("# TYPE baton_requests_total counter") == 1
