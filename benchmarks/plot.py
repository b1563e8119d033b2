"""Plot benchmarks/compare.py results (its --json files) as PNG bar charts.

Each JSON file is one compare.py run (one model, one CPU kind); its label is
``LABEL=FILE`` on the command line, or the file's stem. Two panels per
figure: output tokens per second at the highest concurrency measured, and
the inter-token p50 at concurrency 1, one bar group per file, one bar per
server (medians over the run's rounds, as compare.py's table).
``--workload NAME`` plots workloads runs (compare.py --workload NAME
--users N, one file per N) instead: output tok/s of that workload, one group
per concurrency, one bar per server.

    .venv/bin/python benchmarks/plot.py --out docs/img/amx.png --title "Xeon (AMX)" \\
        135M=/tmp/amx-135m.json 360M=/tmp/amx-360m.json 1.7B=/tmp/amx-1.7b.json

matplotlib is not a dependency of Baton: ``pip install matplotlib``
(``.[bench]``) first.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _runs(values: list[str]) -> list[tuple[str, dict]]:
    runs = []
    for value in values:
        label, _, path = value.rpartition("=")
        runs.append((label or Path(path).stem, json.loads(Path(path).read_text())))
    return runs


def _median(rounds: list[dict], concurrency: str, key: str) -> float | None:
    values = [r[concurrency][key] for r in rounds
              if concurrency in r and r[concurrency].get(key) is not None]
    return statistics.median(values) if values else None


def figures(runs: list[tuple[str, dict]]) -> tuple[list[str], dict[str, list], dict[str, list],
                                                   str]:
    """(group labels, {server: tok/s at the top concurrency per group},
    {server: c=1 inter-token p50 per group}, the top concurrency's label)."""
    servers: list[str] = []
    for _, run in runs:
        servers += [s for s in run["servers"] if s not in servers]
    top = max(int(c) for _, run in runs for rounds in run["servers"].values()
              for r in rounds for c in r)
    throughput = {s: [] for s in servers}
    latency = {s: [] for s in servers}
    for _, run in runs:
        for s in servers:
            rounds = run["servers"].get(s, [])
            throughput[s].append(_median(rounds, str(top), "output_tok_per_s"))
            latency[s].append(_median(rounds, "1", "itl_p50_ms"))
    return [label for label, _ in runs], throughput, latency, f"c={top}"


def _bars(ax, groups: list[str], series: dict[str, list], ylabel: str) -> None:
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        heights = [v or 0 for v in values]
        bars = ax.bar(xs, heights, width, label=name)
        for bar, v in zip(bars, values):
            if v is not None:
                ax.annotate(f"{v:.0f}" if v >= 10 else f"{v:.1f}",
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def plot_compare(runs, out: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups, throughput, latency, top = figures(runs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    _bars(left, groups, throughput, f"output tok/s at {top} (higher is better)")
    _bars(right, groups, latency, "c=1 inter-token p50, ms (lower is better)")
    left.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def workload_series(runs, workload: str) -> tuple[list[int], dict[str, dict[int, float]]]:
    """(concurrencies, {server: {concurrency: median output tok/s}}) of a
    workload over compare.py --workload runs (one --users N each)."""
    series: dict[str, dict[int, list[float]]] = {}
    for _, run in runs:
        for server, rounds in run["servers"].items():
            for r in rounds:
                figures = r.get(workload)
                if figures and figures.get("output_tok_per_s") is not None:
                    series.setdefault(server, {}).setdefault(
                        int(figures["concurrency"]), []).append(figures["output_tok_per_s"])
    levels = sorted({c for values in series.values() for c in values})
    return levels, {n: {c: statistics.median(v) for c, v in values.items()}
                    for n, values in series.items()}


def plot_workload(runs, workload: str, out: Path, title: str) -> None:
    """One group per concurrency, one bar per server."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    levels, series = workload_series(runs, workload)
    fig, ax = plt.subplots(figsize=(9, 4))
    _bars(ax, [f"c={c}" for c in levels],
          {n: [v.get(c) for c in levels] for n, v in series.items()},
          "output tok/s (higher is better)")
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="[LABEL=]FILE.json")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--title", default="")
    ap.add_argument("--workload", default=None)
    args = ap.parse_args(argv)
    runs = _runs(args.runs)
    if args.workload:
        plot_workload(runs, args.workload, args.out, args.title)
    else:
        plot_compare(runs, args.out, args.title)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
