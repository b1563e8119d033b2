"""Several replicas' Prometheus metrics as one exposition, each series
labelled with its ``replica``, so one scrape of the Ray Serve ingress gives
Prometheus (and the Grafana dashboard, which sums over series) the whole
application and each replica apart.

Parsing and rendering are prometheus_client's: the replicas' texts are read
into metric families, relabelled, and written back out by its exposition
code.
"""

from __future__ import annotations

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

REPLICA_LABEL = "replica"


class _Merged(Collector):
    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def collect(self):
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    merged.samples.append(sample._replace(
                        labels={**sample.labels, REPLICA_LABEL: replica}))
        yield from families.values()


def merge_expositions(texts: dict[str, str]) -> str:
    """replica id -> its /metrics text, to one text in Prometheus' format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(texts))
    return generate_latest(registry).decode()
