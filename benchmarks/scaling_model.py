"""A latency + bandwidth + codec-work model of each wire, fitted to ``scaling.py``'s points.

Model of one round's time for a method ``m`` at ``n`` islands, ``N`` float32 elements per rank:

    T = lat * steps_m(n) + over(n) * (wire_m(n) / bw + work_m(n) * N * k_m)

- ``steps_m(n)``: messages in sequence on the critical path. The fp32 and gather transports
  first agree on finiteness with a ring all-gather of one flag (n - 1 steps); then the ring
  all-reduce takes 2 (n - 1), the gather's ring all-gather n - 1. The reduce-scatter votes with
  one ``all_to_all`` and exchanges with two: 3 steps (every rank sends to all peers at once).
  The rotating swarm round is 4 (descriptor + payload in, status + result out); the sharded one
  (with its default ``mean``, summed as it arrives) 2 one-step votes plus its scatter and
  gather in lockstep chunks of 4 MiB per peer.
- ``wire_m(n)``: bytes through the busiest rank's link, in sequence: ``bytes_sent`` for the
  all-reduce transports (sending and receiving overlap: ring steps and all-to-all are full
  duplex), sent + received for the swarm aggregator (it receives every payload, then sends).
  At measured points these are the transports' own counts; projections use the formulas they
  follow: 2 (n - 1) / n P (fp32), 2 (n - 1) / n E (reduce-scatter, E the encoded payload),
  (n - 1) E (gather), 2 (n - 1) P (rotating swarm), 2 (n - 1) / n P (sharded swarm).
- ``work_m(n) * N``: elements through the codec or the aggregator per rank (k_m per element):
  reduce-scatter 3 + 1 / n (encode all, decode n shares, encode and decode the mean: about
  three passes), gather 1 + n (encode, decode n payloads), rotating swarm n (the aggregator
  writes, reads back and sums every contribution), sharded swarm 2 (its shard of each,
  summed as it arrives, and the copies in and out of the streams' buffers), fp32
  2 (n - 1) / n (the ring's additions and copies).
- ``over(n) = max(1, n / cores)``: the measured ranks share this machine's cores, so every
  byte copied and every element encoded waits for a core. Projections are for one machine per
  island: ``over = 1``.

``lat`` and ``bw`` are not fitted: ``scaling.py`` probes the loopback link (ping-pong of 1 byte
and 16 MiB; the median over its runs). Fitted on the measured points (least squares on relative
error, non-negative): ``k`` per family (fp32 all-reduce, int8, int4, rotating and sharded
swarm). Projections replace ``lat`` by half a round-trip time and ``bw`` by the link's rate,
and either keep ``k`` as measured on this CPU (one thread per rank) or leave the work out (the
wire alone: a GPU encodes 1e9 elements in milliseconds, so the wire-only figures are the ones
for GPU islands).

Run:   .venv/bin/python benchmarks/scaling_model.py docs/scaling_cpu.json --plot docs/scaling.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

# Elements of the projected model: 1e9 float32 parameters (a 1B-parameter model's pseudo-
# gradient), besides the measured payload.
PROJECT_NUMEL = 10**9
PROJECT_ISLANDS = (16, 32, 64, 128, 256)
LINKS_GBIT = (1.0, 10.0)
RTTS_MS = (10.0, 100.0)
PARAMS = ("k_fp32_s", "k_int8_s", "k_int4_s", "k_swarm_s", "k_sharded_s")
CHUNK_BYTES = 4 * 2**20  # the swarm transports' chunk_mb default


def encoded_bytes_per_element(method: str, block_size: int) -> float:
    if method.startswith("int8"):
        return 1 + 4 / block_size
    if method.startswith("int4"):
        return 0.5 + 4 / block_size
    return 4.0


def steps(method: str, n: int, numel: int) -> float:
    finite = n - 1
    if method == "fp32 allreduce":
        return finite + 2 * (n - 1)
    if method.endswith("gather"):
        return finite + (n - 1)
    if method.endswith("rs"):
        return 1 + 2  # its finiteness vote is one all-to-all step too
    if method == "swarm sharded":
        # the layout vote and the verdict table (one all-to-all each; a summed mean needs no
        # flag vote), then the scatter and the gather in lockstep chunks of 4 MiB per peer
        return 2 + 2 * math.ceil(4 * numel / n / CHUNK_BYTES)
    return 4.0  # swarm


def wire_bytes(method: str, n: int, numel: int, block_size: int) -> float:
    """Bytes through the busiest link for ``numel`` elements (the formulas of the docstring)."""
    encoded = encoded_bytes_per_element(method, block_size) * numel
    if method == "fp32 allreduce" or method.endswith("rs"):
        return 2 * (n - 1) / n * encoded
    if method.endswith("gather"):
        return (n - 1) * encoded
    if method == "swarm sharded":
        return 2 * (n - 1) / n * encoded
    return 2 * (n - 1) * encoded  # swarm: in, then out


def work(method: str, n: int) -> float:
    if method == "fp32 allreduce":
        return 2 * (n - 1) / n  # the ring's additions and copies follow its bytes
    if method.endswith("rs"):
        return 3 + 1 / n
    if method.endswith("gather"):
        return 1 + n
    if method == "swarm sharded":
        return 2.0  # its shard of n contributions summed, packed and unpacked: about 2 passes
    return float(n)  # swarm


def k_index(method: str) -> int:
    if method.startswith("int8"):
        return 1
    if method.startswith("int4"):
        return 2
    if method == "swarm":
        return 3
    if method == "swarm sharded":
        return 4
    return 0


def measured_wire(method: str, r: dict[str, Any]) -> float:
    sent, received = r["bytes_sent_per_rank"], r["bytes_received_per_rank"]
    if method == "swarm":
        return max(s + q for s, q in zip(sent, received, strict=True))
    return float(max(max(sent), max(received)))


def row(method: str, n: int, numel: int, wire: float, over: float) -> np.ndarray:
    """The coefficients of the ``k`` parameters for one point."""
    x = np.zeros(len(PARAMS))
    x[k_index(method)] = over * work(method, n) * numel
    return x


def link_of(report: dict[str, Any]) -> tuple[float, float]:
    """The loopback link's one-way latency (s) and bandwidth (bytes/s): medians of the probes."""
    probes = [m["link"] for m in report["islands"].values()]
    latency = float(np.median([p["latency_s"] for p in probes]))
    return latency, float(np.median([p["bytes_per_s"] for p in probes]))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with non-negative parameters: drop a negative one and refit."""
    active = list(range(a.shape[1]))
    while True:
        x, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (x >= 0).all():
            full = np.zeros(a.shape[1])
            full[active] = x
            return full
        active.pop(int(np.argmin(x)))


def fit(report: dict[str, Any]) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """Fit the ``k`` per element (``PARAMS``) with the probed link's latency and bandwidth
    fixed; returns them and, per measured point, the model's time and its error."""
    numel = report["payload_bytes"] // 4
    cores = int(report["machine"].split()[0])
    latency, bandwidth = link_of(report)
    points = []
    for n_text, methods in report["islands"].items():
        n = int(n_text)
        for method in report["args"]["methods"]:
            r = methods[method]
            over = max(1.0, n / cores)
            wire = measured_wire(method, r)
            fixed = latency * steps(method, n, numel) + over * wire / bandwidth
            points.append((method, n, row(method, n, numel, wire, over), fixed, r))
    a = np.stack([p[2] for p in points])
    t = np.array([p[4]["time_s"] for p in points])
    fixed = np.array([p[3] for p in points])
    params = nnls(a / t[:, None], (t - fixed) / t)  # relative error
    table = []
    for (method, n, x, f, r), measured in zip(points, t, strict=True):
        predicted = float(x @ params) + f
        table.append(
            {
                "method": method,
                "islands": n,
                "measured_s": float(measured),
                "model_s": predicted,
                "error": predicted / float(measured) - 1,
                "busiest_bytes": measured_wire(method, r),
                "formula_bytes": wire_bytes(method, n, numel, report["block_size"]),
            }
        )
    return params, table


def project(
    params: np.ndarray,
    method: str,
    n: int,
    numel: int,
    gbit: float,
    rtt_ms: float,
    block: int,
    *,
    compute: bool = True,
) -> float:
    """Round time at ``n`` islands, one machine each, over links of ``gbit`` and ``rtt_ms``;
    ``compute=False`` leaves out the per-element work (the wire alone)."""
    wire = wire_bytes(method, n, numel, block)
    work_s = work(method, n) * numel * float(params[k_index(method)]) if compute else 0.0
    return rtt_ms / 2e3 * steps(method, n, numel) + wire * 8 / (gbit * 1e9) + work_s


def markdown(report: dict[str, Any], params: np.ndarray, table: list[dict[str, Any]]) -> str:
    """The measured points against the model, then the projections, as Markdown tables."""
    payload = report["payload_bytes"]
    latency, bandwidth = link_of(report)
    lines = [
        f"Probed link: one-way latency {1e6 * latency:.0f} us, {bandwidth / 1e9:.2f} GB/s. "
        "Fitted per element: "
        + ", ".join(f"{p}={v:.3g}" for p, v in zip(PARAMS, params, strict=True)),
        "",
        "| islands | method | bytes/rank (x fp32 payload) | formula | measured s | model s "
        "| error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['islands']} | {r['method']} | {r['busiest_bytes'] / payload:.3f} | "
            f"{r['formula_bytes'] / payload:.3f} | {r['measured_s']:.3f} | {r['model_s']:.3f} | "
            f"{100 * r['error']:+.0f}% |"
        )
    methods = report["args"]["methods"]
    block = report["block_size"]
    scenarios = [(g, r) for g in LINKS_GBIT for r in RTTS_MS]
    for numel, label, compute in (
        (payload // 4, f"{payload / 2**20:.0f} MiB payload, codec work at this CPU's speed", True),
        (PROJECT_NUMEL, "1e9 parameters, the wire alone (latency + bytes)", False),
        (PROJECT_NUMEL, "1e9 parameters, codec work at this CPU's speed", True),
    ):
        lines += ["", f"Projected round time (s), {label}, one machine per island:", ""]
        lines += ["| link | RTT | islands | " + " | ".join(methods) + " | fastest |"]
        lines += ["|---" * (len(methods) + 4) + "|"]
        for gbit, rtt in scenarios:
            for n in PROJECT_ISLANDS:
                times = {
                    m: project(params, m, n, numel, gbit, rtt, block, compute=compute)
                    for m in methods
                }
                best = min(times, key=lambda m: times[m])
                cells = " | ".join(f"{times[m]:.3g}" for m in methods)
                lines.append(f"| {gbit:g} Gbit/s | {rtt:g} ms | {n} | {cells} | {best} |")
    return "\n".join(lines)


def plot(
    report: dict[str, Any], params: np.ndarray, table: list[dict[str, Any]], out: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = report["args"]["methods"]
    payload = report["payload_bytes"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colors: dict[str, Any] = {}
    for method in methods:
        rows = [r for r in table if r["method"] == method]
        n = [r["islands"] for r in rows]
        line = axes[0].plot(n, [r["busiest_bytes"] / payload for r in rows], "o-", label=method)
        colors[method] = line[0].get_color()
        axes[1].plot(n, [r["measured_s"] for r in rows], "o", color=colors[method], label=method)
        axes[1].plot(n, [r["model_s"] for r in rows], "--", color=colors[method])
        proj = [
            project(
                params, method, k, PROJECT_NUMEL, 1.0, 100.0, report["block_size"], compute=False
            )
            for k in PROJECT_ISLANDS
        ]
        axes[2].plot(PROJECT_ISLANDS, proj, "o-", color=colors[method], label=method)
    axes[0].set(
        xlabel="islands",
        ylabel="bytes / fp32 payload",
        yscale="log",
        title="Measured bytes per round, busiest link\n(swarm aggregator: in + out)",
    )
    axes[1].set(
        xlabel="islands",
        ylabel="round time (s)",
        title=f"Measured (dots) and model (dashes)\n{payload / 2**20:.0f} MiB, 2 shared cores",
    )
    axes[2].set(
        xlabel="islands",
        ylabel="round time (s)",
        xscale="log",
        yscale="log",
        title="Projected wire time\n1e9 params, 1 Gbit/s, 100 ms RTT",
    )
    axes[2].set_xticks(PROJECT_ISLANDS, [str(k) for k in PROJECT_ISLANDS])
    axes[2].minorticks_off()
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"lightning_swarm wires, measured {report['date']} (benchmarks/scaling.py)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--plot", type=Path, default=None)
    ns = parser.parse_args()
    report = json.loads(ns.json.read_text())
    params, table = fit(report)
    print(markdown(report, params, table))
    if ns.plot is not None:
        plot(report, params, table, ns.plot)


if __name__ == "__main__":
    main()
