"""The benchmark and reliability pages' plots and tables, drawn from bench/results at every build.

``FILES`` draws the plots (matplotlib, Agg, PNG) that docs/benchmarks.md and docs/reliability.md show;
``GENERATED`` makes the tables of figures. Both read only the JSON files in bench/results, so a new benchmark run
committed there is on the site at the next build. A missing file or key fails the build (generate.py): a page
must never show a figure that is not in the results.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gpubroker_bench.fairness import share_series

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"

__all__ = ["FILES", "GENERATED", "RESULTS"]

SIZES = ("64MiB", "128MiB", "256MiB", "512MiB")
LINK_SIZES = ("64MiB", "256MiB")


@functools.cache
def _load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


# -- formatting ------------------------------------------------------------------------------------------------------
def _num(x: float, digits: int = 3) -> str:
    """A figure to ``digits`` significant digits, with thousands separators for large ones."""
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    text = f"{x:.{digits}g}"
    if "e" in text:
        return f"{x:,.0f}"
    return text


def _spread(f: dict[str, float], scale: float = 1.0, digits: int = 3) -> str:
    """``median [min-max]`` of a figure measured over several runs."""
    return f"{_num(f['median'] * scale, digits)} [{_num(f['min'] * scale, digits)}-{_num(f['max'] * scale, digits)}]"


def _ratio(f: dict[str, float]) -> str:
    return f"{f['median']:.2f}x [{f['min']:.2f}-{f['max']:.2f}]"


def _table(header: list[str], rows: Iterable[list[str]], align: str = "") -> str:
    align = align or "l" + "r" * (len(header) - 1)
    marks = [":---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(marks) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _commit(d: dict[str, Any]) -> str:
    source = d.get("source", {})
    commit = source.get("commit", "")[:7]
    return commit + (" (with uncommitted changes)" if source.get("dirty") else "")


# -- the data plane: gpubroker bench remote --------------------------------------------------------------------------
# The targets' list: a later run than the table's, judged by issue 25's bounds (the table's file has issue 13's).
_REMOTE_TARGETS = "remote-h200-cdf35dc.json"


def _remote_host(name: str) -> str:
    d = _load(name)
    host = d["host"]
    return (f"`bench/results/{name}`: {host['device']} ({host['driver']}; {host['runtime']}), "
            f"commit {_commit(d)}, {d['date'][:10]}, {d['runs']} runs{' (--quick)' if d['quick'] else ''}.")


def _remote_table(name: str) -> str:
    d = _load(name)
    nat, rem, ratio = d["native_figures"], d["remote_figures"], d["remote_over_native"]
    native_name = "native" if d["backend"] == "opencl" else "native CuPy"
    rows = [
        ["launch + sync p50, same host (ring), synchronous (µs)", _num(nat["launch_sync_p50_us"]["median"]),
         _spread(rem["launch_sync_p50_us"]), _ratio(ratio["launch_sync_p50"])],
        ["the same, `async_commands` (µs)", "", _spread(rem["launch_sync_async_p50_us"]),
         _ratio(ratio["launch_sync_async_p50"])],
        ["asynchronous launches per second", _num(nat["async_launches_per_s"]["median"]),
         _spread(rem["async_launches_per_s"]), _ratio(ratio["async_launch_rate"])],
        ["client CPU per queued launch (µs)", _num(nat["cpu_us_per_launch"]["median"]),
         _spread(rem["cpu_us_per_launch"]), _ratio(ratio["cpu_per_launch"])],
        [f"{d['plan']['dependent_steps']:,} dependent ~{d['kernels']['small']['native_us']:.0f} µs kernels, "
         f"a 4-byte read every {d['kernels']['read_back_every']} (ms)",
         _num(nat["dependent_small_kernels_s"]["median"] * 1e3),
         _spread(rem["dependent_small_kernels_s"], 1e3), _ratio(ratio["dependent_small_kernels_time"])],
        [f"{d['plan']['large_count']} ~{d['kernels']['large']['native_ms']:.0f} ms kernels, each synchronized (ms)",
         _num(nat["large_kernels_s"]["median"] * 1e3), _spread(rem["large_kernels_s"], 1e3),
         _ratio(ratio["large_kernels_time"])],
    ]
    # (what is copied, the native copy it is set against: their figures' keys, and the ratios')
    copies = (("`host_array`", "pinned", "copies_host_array", "copies_pinned", "host_array_vs_pinned"),
              ("numpy array", "pageable", "copies_numpy", "copies_pageable", "numpy_vs_pageable"))
    for what, against, ours, native, ratios in copies:
        for size in SIZES:
            for way in ("h2d", "d2h"):
                rows.append([f"{what} copy {size} {way.upper()} (GB/s), against {against}",
                             _num(nat[native][size][f"{way}_gbps"]["median"]),
                             _spread(rem[ours][size][f"{way}_gbps"]), _ratio(ratio[ratios][size][way])])
    rows.append(["gRPC `Commands`: launch + sync p50 (µs)", "", _spread(rem["grpc_launch_sync_p50_us"]),
                 _ratio(ratio["grpc_launch_sync_p50"])])
    links = (("tcp_tls", "loopback TCP link with TLS"), ("vsock_standin", "vsock (a Unix socket standing in)"))
    for key, label in links:
        link = rem[key]
        rows.append([f"{label}: launch + sync p50 (µs)", "", _spread(link["launch_sync_p50_us"]),
                     _ratio(ratio[f"{key}_launch_sync_p50"])])
        rows.append([f"{label}: the same, `async_commands` (µs)", "", _spread(link["launch_sync_async_p50_us"]), ""])
        for size in LINK_SIZES:
            for way in ("h2d", "d2h"):
                rows.append([f"{label}: copy {size} {way.upper()} (GB/s)", "",
                             _spread(link["copies"][size][f"{way}_gbps"]), ""])
    return _table(["measure", native_name, "gpubroker, median [min-max]", "ratio, median [min-max]"], rows)


def _remote_targets(name: str) -> str:
    d = _load(name)
    lines = []
    for key, target in d["targets"].items():
        values = ", ".join(f"{k} {_num(v)}" for k, v in target["values"].items())
        met = "met" if target["met"] else "**not met**"
        lines.append(f"- {met}: {key.replace('_', ' ')} ({target['target']}): {values}")
    return "\n".join(lines) + "\n"


# -- fairness ----------------------------------------------------------------------------------------------------------
_FAIRNESS = (("fairness-h200.json", "H200, before issue 13"),
             ("fairness-h200-dataplane.json", "H200, issue 13's data plane"),
             ("fairness-pocl.json", "PoCL, 2 cores"))


def _fairness_table() -> str:
    runs = [(_load(name), label) for name, label in _FAIRNESS]
    header = ["target"] + [f"{label} (`{name}`)" for (name, _), (_, label) in zip(_FAIRNESS, runs, strict=True)]
    rows = [
        ["8 equal tenants: Jain's index >= 0.99"] + [f"{d['equal8']['jain_index']:.4f}" for d, _ in runs],
        ["weights 1 : 2 : 4, each within 5 % of its target share"]
        + [", ".join(f"{t['off_target_pct']:+.1f} %" for t in d["weighted"]["tenants"].values()) for d, _ in runs],
        ["light tenant's p99 scheduler wait <= quantum + longest kernel + 1 ms (11 ms), equal / weighted"]
        + [f"{d['equal8']['light_wait_ms']['p99']:.1f} / {d['weighted']['light_wait_ms']['p99']:.1f} ms"
           for d, _ in runs],
        ["light tenant's launch + sync latency p50 / p99, equal"]
        + [f"{d['equal8']['light_latency_ms']['p50']:.1f} / {d['equal8']['light_latency_ms']['p99']:.1f} ms"
           for d, _ in runs],
        ["lone tenant >= 95 % of its throughput with the scheduler off"]
        + [f"{100 * d['lone']['ratio']:.1f} %" for d, _ in runs],
        ["measured window, equal / weighted"]
        + [f"{d['equal8']['window_s']:.1f} / {d['weighted']['window_s']:.1f} s" for d, _ in runs],
    ]
    return _table(header, rows)


# -- several GPUs ------------------------------------------------------------------------------------------------------
def _multi_table() -> str:
    d = _load("multi-h200x2.json")
    devs = [str(dev["id"]) for dev in d["devices"]]
    rows = [["device and its health", *[f"{dev['name']}, {dev['health']}" for dev in d["devices"]]],
            [f"{len(d['placement'])} sessions opened without a device went to", ", ".join(map(str, d["placement"])),
             ""]]
    rows.append([f"{d['sessions_at_once'][0]['launches']} saxpy launches, both devices at once: correct (time)",
                 *[f"{'yes' if s['correct'] else 'NO'} ({s['seconds'] * 1e3:.1f} ms)" for s in d["sessions_at_once"]]])
    pairs = [f"{a}->{b}" for a, b in zip(devs, reversed(devs), strict=True)]
    size = d["peer_copy"][pairs[0]]["bytes"] / 2**30
    rows.append([f"copy of {size:g} GiB from this device, GPUs' peer path (best / median GB/s)",
                 *[f"{d['peer_copy'][p]['gb_per_s_best']:.0f} / {d['peer_copy'][p]['gb_per_s_median']:.0f}"
                   for p in pairs]])
    rows.append(["the same through host memory (`peer_copies = \"host\"`)",
                 *[f"{d['peer_copy_host_path'][p]['gb_per_s_best']:.1f} / "
                   f"{d['peer_copy_host_path'][p]['gb_per_s_median']:.1f}" for p in pairs]])
    fair = d["fairness"]
    rows.append([f"fairness, {fair['tenants_per_device']} equal tenants per device, both at once: Jain's index",
                 *[f"{fair['devices'][dev]['jain_index']:.5f}" for dev in devs]])
    rows.append(["light tenant's scheduler wait p50 / p99 (bound: 11 ms)",
                 *[f"{fair['devices'][dev]['light_wait_ms']['p50']:.2f} / "
                   f"{fair['devices'][dev]['light_wait_ms']['p99']:.1f} ms" for dev in devs]])
    return _table(["measure", *[f"device {dev}" for dev in devs]], rows)


# -- cold start, arrays, conformance ---------------------------------------------------------------------------------
_COLD_START_MODES = (("sandbox", "sandboxed, forked from the zygote"),
                     ("sandbox_exec", "sandboxed, exec'd (worker_zygote = false)"), ("no_sandbox", "not sandboxed"))


def _cold_start_table() -> str:
    d = _load("cold-start-h200.json")
    rows = []
    for key, label in _COLD_START_MODES:
        if key not in d:
            continue
        runs = d[key]["p50_s_per_run"]
        rows.append([label, *[f"{x:.3f} s" for x in runs],
                     f"**{d[key]['p50_s_median']:.3f} s** ({d[key]['spread_s']:.2f} s)"])
    return _table(["cold first session p50", *[f"run {i + 1}" for i in range(d["runs"])], "median (spread)"], rows)


def _arrays_table() -> str:
    d = _load("arrays-h200.json")
    w = d["workloads"]
    labels = {
        "mlp": f"MLP {'-'.join(map(str, w['mlp']['sizes']))}, {w['mlp']['dtype']}, batch {w['mlp']['batch']:,}, "
               f"{w['mlp']['steps']} SGD steps",
        "pca": f"sklearn `PCA(n_components={w['pca']['n_components']}).fit`, {w['pca']['samples']:,} x "
               f"{w['pca']['features']} {w['pca']['dtype']}",
    }
    rows = []
    for key, label in labels.items():
        target = d["targets"][key]
        rows.append([label, f"{d['native_figures'][f'{key}_s']['median']:.4g}",
                     _spread(d["ours_figures"][f"{key}_s"], digits=3), _ratio(d["ours_over_native"][key]),
                     f"{target['target']}: {'met' if target['met'] else '**not met**'}"])
    return _table(["workload", "native (s)", "gpubroker (s)", "ratio", "target"], rows, "lrrrl")


def _arrays_ops_table() -> str:
    d = _load("arrays-h200.json")
    if "ops" not in d["workloads"]:
        return ""
    w = d["workloads"]
    rows = []
    for key, expression in w["ops"]["expressions"].items():
        target = d["targets"][f"ops.{key}"]
        rows.append([f"`{expression}`", f"{d['native_figures']['ops_us'][key]['median']:.1f}",
                     _spread(d["ours_figures"]["ops_us"][key], digits=1), _ratio(d["ours_over_native"]["ops"][key]),
                     f"{target['target']}: {'met' if target['met'] else '**not met**'}"])
    for key, label in (("softmax", f"row softmax + log-sum-exp + argmax, {w['softmax']['iterations']} iterations "
                                   "(s)"),
                       ("stencil", f"heat diffusion by slicing, {w['stencil']['steps']} steps (s)")):
        if key in w:
            target = d["targets"][key]
            rows.append([label, f"{d['native_figures'][f'{key}_s']['median']:.4g}",
                         _spread(d["ours_figures"][f"{key}_s"], digits=4), _ratio(d["ours_over_native"][key]),
                         f"{target['target']}: {'met' if target['met'] else '**not met**'}"])
    return _table([f"operation ({w['ops']['operands']}; us per call)", "native", "gpubroker", "ratio", "target"],
                  rows, "lrrrl")


def _arrays_host() -> str:
    name = "arrays-h200.json"
    d = _load(name)
    versions = ", ".join(f"{k} {v}" for k, v in d["host"]["versions"].items())
    return (f"`bench/results/{name}`: {d['host']['device']}, commit {_commit(d)}, {d['date'][:10]}, "
            f"{d['runs']} runs of {', '.join(d['parts'])}; native: {d['native']}; ours: {d['ours']}. "
            f"Versions: {versions}.\n")



def _array_api_table() -> str:
    runs = [("array-api-h200.json", "H200 (CUDA)"), ("array-api-pocl.json", "PoCL (OpenCL)")]
    data = [_load(name) for name, _ in runs]
    files = sorted(set().union(*(d["per_file"] for d in data)))
    rows = []
    for f in files:
        rows.append([f"`{f}`", *[" / ".join(str(d["per_file"].get(f, {}).get(k, 0))
                                            for k in ("passed", "failed", "skipped")) for d in data]])
    rows.append(["**total**", *[f"**{d['totals']['passed']} / {d['totals']['failed']} / {d['totals']['skipped']}**"
                                for d in data]])
    rows.append(["passed / (passed + failed)", *[f"**{d['pass_percent']:.2f} %**" for d in data]])
    return _table(["test file: passed / failed / skipped", *[f"{label} (`{name}`)" for name, label in runs]], rows)


# -- reliability -------------------------------------------------------------------------------------------------------
def _bad_statuses(d: dict[str, Any]) -> str:
    bad = {k: n for k, n in d["statuses"].items() if k in ("INTERNAL", "UNKNOWN")}
    return ", ".join(f"**{n:,} {k}**" for k, n in bad.items()) if bad else "no INTERNAL or UNKNOWN"


def _fuzz_summary() -> str:
    d = _load("fuzz-pocl.json")
    kinds = ", ".join(f"{n:,} {k.replace('_', ' ')}" for k, n in d["cases_by_kind"].items())
    statuses = ", ".join(f"{k} {n:,}" for k, n in d["statuses"].items())
    return (f"- `bench/results/fuzz-pocl.json` (backend {d['backend']}, seed {d['seed']}, at most {d['max_steps']} "
            f"calls a gRPC case): **{d['cases']:,} cases** ({kinds}) making **{d['calls']:,} calls** in "
            f"{d['duration_s'] / 60:.0f} minutes ({d['cases_per_s']:.1f} cases a second).\n"
            f"- Answers: {statuses}; {_bad_statuses(d)}.\n"
            f"- Broker alive at the end: {'yes' if d['broker_alive'] else 'NO'}; accounting exact after every case: "
            f"{'yes' if d['accounting_exact'] else 'NO'}; tracebacks in the broker's log: {d['broker_tracebacks']}; "
            f"workers lost: {d['worker_deaths']}.\n")


def _soak_table() -> str:
    d = _load("soak-pocl.json")
    base, final = d["baseline"], d["final"]

    def workers(snapshot: dict[str, Any], key: str, scale: float = 1.0) -> str:
        values = [w[key] / scale for w in snapshot["workers"].values()]
        lo, hi = min(values), max(values)
        fmt = "{:.1f}" if scale != 1.0 else "{:g}"
        return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"

    def segments(snapshot: dict[str, Any]) -> str:
        parts = [snapshot["broker"]["segments_mapped"], snapshot["broker"]["segment_fds"]]
        for w in snapshot["workers"].values():
            parts += [w["segments_mapped"], w["segment_fds"]]
        return str(sum(parts))

    n = len(base["workers"])
    rows = [
        ["broker RSS (MiB)", f"{base['broker']['rss_kib'] / 1024:.1f}", f"{final['broker']['rss_kib'] / 1024:.1f}"],
        [f"each worker's RSS (MiB, {n} workers)", workers(base, "rss_kib", 1024), workers(final, "rss_kib", 1024)],
        ["broker file descriptors / threads", f"{base['broker']['fds']} / {base['broker']['threads']}",
         f"{final['broker']['fds']} / {final['broker']['threads']}"],
        ["each worker's file descriptors", workers(base, "fds"), workers(final, "fds")],
        ["shared segments mapped and memfds held, broker and workers", segments(base), segments(final)],
        ["device memory charged (front) and held (workers)",
         str(base["device_memory_used"] + sum(w["device_bytes_in_use"] for w in base["workers"].values())),
         str(final["device_memory_used"] + sum(w["device_bytes_in_use"] for w in final["workers"].values()))],
        ["sessions", str(base["sessions"]), str(final["sessions"])],
    ]
    head = (f"`bench/results/soak-pocl.json` (backend {d['backend']}): {d['cycles']:,} session cycles "
            f"({d['tenants']} tenants x {d['cycles_per_tenant']:,}) in {d['duration_s']:.0f} s "
            f"({d['cycles_per_s']:.0f} a second), {d['errors']} errors; back to baseline: "
            f"{'yes' if d['back_to_baseline'] else 'NO'}.\n\n")
    return head + _table(["held", "baseline (after warm-up)", f"after {d['cycles']:,} cycles"], rows)


GENERATED: dict[str, Callable[[], str]] = {
    "bench-remote-host": lambda: _remote_host("remote-h200.json") + "\n",
    "bench-remote-table": lambda: _remote_table("remote-h200.json"),
    "bench-remote-host-targets": lambda: _remote_host(_REMOTE_TARGETS) + "\n",
    "bench-remote-targets": lambda: _remote_targets(_REMOTE_TARGETS),
    "bench-remote-pocl-host": lambda: _remote_host("remote-pocl.json") + "\n",
    "bench-remote-pocl-table": lambda: _remote_table("remote-pocl.json"),
    "bench-remote-pocl-targets": lambda: _remote_targets("remote-pocl.json"),
    "bench-fairness-table": _fairness_table,
    "bench-multi-table": _multi_table,
    "bench-cold-start-table": _cold_start_table,
    "bench-arrays-ops-table": _arrays_ops_table,
    "bench-arrays-host": _arrays_host,
    "bench-arrays-table": _arrays_table,
    "bench-array-api-table": _array_api_table,
    "reliability-fuzz-summary": _fuzz_summary,
    "reliability-soak-table": _soak_table,
}


# -- plots -------------------------------------------------------------------------------------------------------------
def _figure(width: float, height: float, cols: int = 1) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "axes.grid": True, "grid.alpha": 0.3})
    return plt.subplots(1, cols, figsize=(width, height), squeeze=False)


def _png(fig: Any, layout: bool = True) -> bytes:
    import matplotlib.pyplot as plt

    out = io.BytesIO()
    if layout:
        fig.tight_layout()
    fig.savefig(out, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    return out.getvalue()


def _err(f: dict[str, float], scale: float = 1.0) -> tuple[float, list[float]]:
    m = f["median"] * scale
    return m, [m - f["min"] * scale, f["max"] * scale - m]


def _latency_plot() -> bytes:
    d = _load("remote-h200.json")
    rem = d["remote_figures"]
    bars = [("native CuPy, in process", d["native_figures"]["launch_sync_p50_us"]),
            ("ring (same host), async_commands", rem["launch_sync_async_p50_us"]),
            ("ring (same host), synchronous", rem["launch_sync_p50_us"]),
            ("vsock stand-in, async_commands", rem["vsock_standin"]["launch_sync_async_p50_us"]),
            ("vsock stand-in, synchronous", rem["vsock_standin"]["launch_sync_p50_us"]),
            ("TCP + TLS, async_commands", rem["tcp_tls"]["launch_sync_async_p50_us"]),
            ("TCP + TLS, synchronous", rem["tcp_tls"]["launch_sync_p50_us"]),
            ("gRPC Commands stream", rem["grpc_launch_sync_p50_us"])]
    fig, axes = _figure(9, 4.4)
    ax = axes[0][0]
    ys = range(len(bars))
    medians, errors = zip(*(_err(f) for _, f in bars), strict=True)
    colors = ["#888888"] + ["#3f51b5"] * (len(bars) - 1)
    ax.barh(list(ys), medians, xerr=list(zip(*errors, strict=True)), color=colors, capsize=3)
    for y, (_, f) in zip(ys, bars, strict=True):
        m = f["median"]
        ax.text(f["max"] * 1.12, y, f"{m:,.0f} µs" if m >= 10 else f"{m:.1f} µs", va="center", fontsize=9)
    ax.set_yticks(list(ys), [label for label, _ in bars])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(5, 5000)
    ax.set_xlabel(f"launch + synchronize p50, µs (log scale): median of {d['runs']} runs, whiskers min-max")
    ax.set_title(f"Launch + sync by path, {d['host']['device']}, commit {_commit(d)}, {d['date'][:10]}")
    return _png(fig)


def _copies_plot() -> bytes:
    d = _load("remote-h200.json")
    nat, rem = d["native_figures"], d["remote_figures"]
    fig, axes = _figure(10, 4.8, cols=2)
    mib = [int(s.removesuffix("MiB")) for s in SIZES]
    series = [("native, pinned", nat["copies_pinned"], SIZES, "#888888", "--", "o"),
              ("gpubroker host_array", rem["copies_host_array"], SIZES, "#3f51b5", "-", "o"),
              ("native, pageable", nat["copies_pageable"], SIZES, "#bbbbbb", "--", "s"),
              ("gpubroker numpy array", rem["copies_numpy"], SIZES, "#009688", "-", "s"),
              ("TCP + TLS link", rem["tcp_tls"]["copies"], LINK_SIZES, "#e91e63", "-", "^"),
              ("vsock stand-in", rem["vsock_standin"]["copies"], LINK_SIZES, "#ff9800", "-", "v")]
    for ax, way, title in ((axes[0][0], "h2d", "host to device"), (axes[0][1], "d2h", "device to host")):
        for label, figures, sizes, color, style, marker in series:
            xs = [int(s.removesuffix("MiB")) for s in sizes]
            meds, errs = zip(*(_err(figures[s][f"{way}_gbps"]) for s in sizes), strict=True)
            ax.errorbar(xs, meds, yerr=list(zip(*errs, strict=True)), label=label, color=color, linestyle=style,
                        marker=marker, capsize=3)
        ax.set_xscale("log", base=2)
        ax.set_xticks(mib, [f"{m} MiB" for m in mib])
        ax.set_ylim(0, 60)
        ax.set_xlabel("copy size")
        ax.set_ylabel(f"GB/s: median of {d['runs']} runs, whiskers min-max")
        ax.set_title(f"Copies {title}, {d['host']['device']}, commit {_commit(d)}")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return _png(fig, layout=False)


def _fairness_plot() -> bytes:
    d = _load("fairness-h200-dataplane.json")
    fig, axes = _figure(11, 4.2, cols=2)
    titles = {"equal8": "8 equal tenants", "weighted": "weights 1 : 2 : 4"}
    for ax, name in zip(axes[0], ("equal8", "weighted"), strict=True):
        run = d[name]
        tenants = list(run["tenants"])
        timeline = run["timeline"]
        for tenant in tenants:
            ts, shares = share_series(timeline, tenants, tenant)
            line = ax.plot(ts, shares, label=f"{tenant} (weight {run['tenants'][tenant]['weight']})", linewidth=1.2)
            if name == "weighted" or tenant == tenants[0]:
                ax.axhline(run["tenants"][tenant]["target"], color=line[0].get_color(), linestyle=":", linewidth=1)
        ax.set_ylim(0, 0.8 if name == "weighted" else 0.4)
        ax.set_xlabel("seconds since the tenants started")
        ax.set_ylabel("share of the device time charged, per 0.25 s")
        ax.set_title(f"{titles[name]} (dotted: target share; Jain {run['jain_index']:.4f})")
        ax.legend(fontsize=7, ncol=2 if name == "equal8" else 1, loc="upper right")
    fig.suptitle(f"Fair scheduling on the H200, {d['backend']} backend, quantum {d['quantum_ms']:g} ms "
                 "(bench/results/fairness-h200-dataplane.json)", fontsize=11)
    return _png(fig)


def _cold_start_plot() -> bytes:
    d = _load("cold-start-h200.json")
    fig, axes = _figure(9, 3.6)
    ax = axes[0][0]
    modes = [(key, label) for key, label in _COLD_START_MODES if key in d]
    for row, (key, _) in enumerate(modes):
        for run, samples in enumerate(d[key]["samples_s"]):
            ys = [row + (run - 1) * 0.12] * len(samples)
            ax.scatter(samples, ys, s=18, label=f"run {run + 1}" if row == 0 else None,
                       color=["#3f51b5", "#009688", "#ff9800"][run % 3])
        ax.plot([d[key]["p50_s_median"]] * 2, [row - 0.4, row + 0.4], color="black")
        ax.text(d[key]["p50_s_median"], row + 0.3, f" median p50 {d[key]['p50_s_median']:.2f} s", fontsize=9)
    ax.set_yticks(range(len(modes)), [label for _, label in modes])
    ax.set_ylim(-0.5, len(modes) - 0.5)
    ax.set_xlim(left=0)
    ax.set_xlabel("a tenant's first session, worker start included (s)")
    ax.set_title(f"Cold first session on the H200, CUDA ({d['tenants']} tenants a run, {d['runs']} runs)")
    ax.legend(fontsize=8, loc="lower right")
    return _png(fig)


def _arrays_plot() -> bytes:
    d = _load("arrays-h200.json")
    fig, axes = _figure(9, 3.6, cols=2)
    for ax, key, title, scale, unit in ((axes[0][0], "mlp", "MLP, 100 SGD steps", 1.0, "s"),
                                        (axes[0][1], "pca", "sklearn PCA(32).fit, 100,000 x 256", 1e3, "ms")):
        labels = ["CuPy native", "gpubroker"]
        figures = [d["native_figures"][f"{key}_s"], d["ours_figures"][f"{key}_s"]]
        meds, errs = zip(*(_err(f, scale) for f in figures), strict=True)
        ax.bar(labels, meds, yerr=list(zip(*errs, strict=True)), color=["#888888", "#3f51b5"], capsize=4)
        for x, m in enumerate(meds):
            ax.text(x, m / 2, f"{m:.3g} {unit}", ha="center", color="white", fontsize=10)
        ax.set_ylabel(f"{unit}: median of {d['runs']} runs, whiskers min-max")
        ax.set_title(f"{title}: ratio {d['ours_over_native'][key]['median']:.2f}x")
    fig.suptitle(f"Array namespace against CuPy, {d['host']['device']} (commit {_commit(d)}, {d['date'][:10]})",
                 fontsize=11)
    return _png(fig)


def _multi_plot() -> bytes:
    d = _load("multi-h200x2.json")
    fig, axes = _figure(7, 3.6)
    ax = axes[0][0]
    pairs = list(d["peer_copy"])
    width = 0.35
    for i, (key, label, color) in enumerate((("peer_copy", "GPUs' peer path", "#3f51b5"),
                                             ("peer_copy_host_path", "through host memory", "#ff9800"))):
        xs = [p + (i - 0.5) * width for p in range(len(pairs))]
        best = [d[key][p]["gb_per_s_best"] for p in pairs]
        median = [d[key][p]["gb_per_s_median"] for p in pairs]
        ax.bar(xs, median, width, color=color, label=f"{label} (median of 5)")
        ax.scatter(xs, best, color="black", marker="_", s=200, zorder=3, label="best" if i == 0 else None)
        for x, m, b in zip(xs, median, best, strict=True):
            ax.text(x, b + 5, f"{m:.0f}", ha="center", fontsize=9)
    ax.set_xticks(range(len(pairs)), [f"device {p.replace('->', ' to ')}" for p in pairs])
    ax.set_ylabel("GB/s")
    ax.set_ylim(0, 250)
    size = d["peer_copy"][pairs[0]]["bytes"] / 2**30
    ax.set_title(f"copy_peer of {size:g} GiB between two H200s (NV18)")
    ax.legend(fontsize=8)
    return _png(fig)


def _fuzz_plot() -> bytes:
    d = _load("fuzz-pocl.json")
    fig, axes = _figure(8, 3.6)
    ax = axes[0][0]
    statuses = sorted(d["statuses"].items(), key=lambda kv: -kv[1])
    ax.barh([k for k, _ in statuses], [v for _, v in statuses], color="#3f51b5")
    for y, (_, v) in enumerate(statuses):
        ax.text(v * 1.15, y, f"{v:,}", va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(500, 5e6)
    ax.set_xlabel("calls answered with this status (log scale)")
    ax.set_title(f"{d['cases']:,} fuzz cases on PoCL (seed {d['seed']}): {_bad_statuses(d).replace('**', '')}")
    return _png(fig)


@functools.cache
def _files() -> dict[str, bytes]:
    return {
        "img/bench-latency.png": _latency_plot(),
        "img/bench-copies.png": _copies_plot(),
        "img/bench-fairness.png": _fairness_plot(),
        "img/bench-cold-start.png": _cold_start_plot(),
        "img/bench-arrays.png": _arrays_plot(),
        "img/bench-multi.png": _multi_plot(),
        "img/reliability-fuzz.png": _fuzz_plot(),
    }


def FILES() -> dict[str, bytes]:  # (the name generate.py looks for)
    """The plots, by their path in the site."""
    return _files()
