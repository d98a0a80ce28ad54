"""The metrics list, generated from the broker's metric table (src/gpubroker/broker/front/_metrics.py) at every build.

``METRICS`` is the table ``BrokerCollector.collect`` yields its families from, and ``RPC_METRIC`` the RPC latency
histogram's; a family added there appears here, with its name, type, labels and help string.
"""

from __future__ import annotations

from collections.abc import Callable

from gpubroker.broker.front._metrics import METRICS, RPC_BUCKETS, RPC_METRIC, SCHEDULER_WAIT, MetricSpec
from gpubroker.broker.front.scheduler import WAIT_BUCKETS

__all__ = ["GENERATED", "metrics_list", "series"]


def series(spec: MetricSpec) -> list[str]:
    """The sample names a scrape shows for a family."""
    if spec.type == "counter":
        return [f"{spec.name}_total"]
    if spec.type == "histogram":
        # prometheus_client also serves each labelled series' creation time of its own Histogram (the RPC one)
        # as ``_created`` (a gauge); the collector's (built at each scrape) have none
        created = [f"{spec.name}_created"] if spec is RPC_METRIC else []
        return [f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count", *created]
    return [spec.name]


def _row(spec: MetricSpec, extra: str = "") -> str:
    names = "<br>".join(f"`{name}`" for name in series(spec))
    labels = ", ".join(f"`{label}`" for label in spec.labels) or "(none)"
    return f"| {names} | {spec.type} | {labels} | {spec.help.replace('|', '/')}{extra} |"


def metrics_list() -> str:
    """Markdown: a table of every family the broker's /metrics serves (besides prometheus_client's process_*)."""
    buckets = ", ".join(f"{b:g}" for b in RPC_BUCKETS)
    waits = ", ".join(f"{b:g}" for b in WAIT_BUCKETS)
    lines = ["| metric | type | labels | what it measures |", "| --- | --- | --- | --- |"]
    lines += [_row(spec, f" Buckets (seconds): {waits}." if spec is SCHEDULER_WAIT else "") for spec in METRICS]
    lines.append(_row(RPC_METRIC, f" Buckets (seconds): {buckets}."))
    return "\n".join(lines) + "\n"


GENERATED: dict[str, Callable[[], str]] = {"metrics-list": metrics_list}
