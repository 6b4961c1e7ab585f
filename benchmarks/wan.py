"""Islands in separate network namespaces behind a rate-limited link (needs root).

Each island is one torchrun node in its own network namespace. Two islands are joined by one veth
pair; more hang off a bridge in a hub namespace, one veth pair each. Every veth end gets a tbf
qdisc at ``--rate`` (both directions of every link are limited), or none with ``--rate
unlimited``. ``--slow-island K --cpu-quota Q`` puts island K in a cgroup v1 ``cpu`` group
limited to Q of one core; ``--fast-quota F`` puts every other island in a group of its own at F
of a core (more islands than cores, each still at a known speed). Each island runs

    ip netns exec NS env GLOO_SOCKET_IFNAME=VETH ... python -m torch.distributed.run \\
        --nnodes N --nproc-per-node 1 --node-rank K --master-addr ISLAND0 --master-port PORT \\
        -m lightning_swarm.cli trainer.num_nodes=N trainer.devices=1 ... OVERRIDES

with ``benchmarks/wan_steps.StepTimes`` added as a callback, which writes each rank's step
times, validation losses and outer totals to ``OUT/island<K>/steps.json``. Everything made here
(namespaces, links, qdiscs, the cgroups) is removed when the run ends, fails or is interrupted;
``--cleanup`` removes leftovers of a killed harness by their name prefix.

Usage (as root):
    python benchmarks/wan.py --rate 10mbit --steps 30 -- strategy.sync_every=50
    python benchmarks/wan.py --rate unlimited --slow-island 1 --cpu-quota 0.4 -- ...
    python benchmarks/wan.py campaign [--only NAME ...]   # the runs of docs/wan.md
    python benchmarks/wan.py elastic [--kill-round 3]    # lighthouse + 3 torchft islands, a kill
    python benchmarks/wan.py plot                         # docs/wan.png from the results
    python benchmarks/wan.py --cleanup
Everything after ``--`` is passed to the Hydra app unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "lsw"
SUBNET = "10.77.0"
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
NETNS_ETC = Path("/etc/netns")  # ip netns exec bind-mounts /etc/netns/<ns>/<file> on /etc/<file>
RESULTS = ROOT / "docs" / "wan_results.json"
PLOT = ROOT / "docs" / "wan.png"


@dataclass(frozen=True)
class Plan:
    """What one harness run creates and launches; pure data, nothing touches the system.

    Args:
        islands: number of islands (one torchrun node of one rank each).
        rate: tbf rate of every veth end (``tc`` syntax, e.g. ``10mbit``); None = unlimited.
        prefix: start of every name made here (namespaces, links, cgroup); ``--cleanup`` looks
            for it.
        slow_island: the island put in a cpu-quota cgroup, or None.
        cpu_quota: that island's share of one core (0 < q).
        fast_quota: every other island's share of one core, each in a cgroup of its own, or
            None (no quota). With more islands than cores this keeps "one slow island" one:
            the fast islands share the cores evenly and the slow one runs at
            ``cpu_quota / fast_quota`` of their speed.
        port: torchrun's rendezvous port on island 0.
        checkout: the library checkout the islands import (another worktree, e.g. an older
            commit, measured with this harness); this one by default.
        lighthouse: elastic islands: one more namespace (``<prefix>-lh``, endpoint index
            ``islands``) holds ``swarm-lighthouse``, behind its own limited link; every
            namespace gets an ``/etc/netns/<ns>/hosts`` naming every endpoint, so the host names
            torchft advertises resolve to veth addresses.
        lighthouse_port: the lighthouse's port.
    """

    islands: int
    rate: str | None
    prefix: str = PREFIX
    slow_island: int | None = None
    cpu_quota: float = 0.4
    fast_quota: float | None = None
    port: int = 29571
    checkout: Path = ROOT
    lighthouse: bool = False
    lighthouse_port: int = 29510

    def __post_init__(self) -> None:
        if self.islands < 2:
            raise ValueError(f"--islands must be at least 2 (got {self.islands})")
        if self.islands > 200:
            raise ValueError(f"--islands must be at most 200 (got {self.islands}): one /24")
        if self.slow_island is not None and not 0 <= self.slow_island < self.islands:
            raise ValueError(
                f"--slow-island {self.slow_island} is not an island of {self.islands} "
                f"(0..{self.islands - 1})"
            )
        if self.cpu_quota <= 0:
            raise ValueError(f"--cpu-quota must be above 0 (got {self.cpu_quota})")
        if self.fast_quota is not None and (self.fast_quota <= 0 or self.slow_island is None):
            raise ValueError(
                f"--fast-quota {self.fast_quota} needs --slow-island and a value above 0"
            )
        if len(self.prefix) > 6 or not self.prefix.isalnum():
            raise ValueError(
                f"--prefix {self.prefix!r} must be 1-6 letters or digits (interface names "
                "are at most 15 characters)"
            )

    @property
    def endpoints(self) -> int:
        """Namespaces with a link: the islands, then the lighthouse's where there is one."""
        return self.islands + int(self.lighthouse)

    @property
    def hub(self) -> str | None:
        """The hub namespace holding the bridge (more than two endpoints), else None."""
        return f"{self.prefix}-hub" if self.endpoints > 2 else None

    def namespace(self, k: int) -> str:
        """Endpoint k's namespace: island k, or the lighthouse's at k == islands."""
        return f"{self.prefix}-lh" if k == self.islands else f"{self.prefix}-i{k}"

    def veth(self, k: int) -> str:
        """Island k's end of its link (what GLOO_SOCKET_IFNAME names)."""
        return f"{self.prefix}{k}"

    def hub_veth(self, k: int) -> str:
        return f"{self.prefix}{k}h"

    def address(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def cgroup(self, k: int) -> Path | None:
        """Island k's cpu cgroup, or None where it runs without a quota."""
        if k == self.slow_island:
            return CGROUP_CPU / f"{self.prefix}-slow"
        if self.fast_quota is not None:
            return CGROUP_CPU / f"{self.prefix}-q{k}"
        return None

    def quota(self, k: int) -> float:
        """Island k's share of one core (where ``cgroup(k)`` is not None)."""
        return self.cpu_quota if k == self.slow_island else float(self.fast_quota or 0)

    def cgroups(self) -> list[Path]:
        return [g for g in (self.cgroup(k) for k in range(self.islands)) if g is not None]

    def namespaces(self) -> list[str]:
        names = [self.namespace(k) for k in range(self.endpoints)]
        return [*names, self.hub] if self.hub else names


def _tbf(ns: str, dev: str, rate: str) -> list[str]:
    # burst: a few full-size packets at 10 Mbit/s; latency: the queue may hold 2 s of traffic
    # before tbf drops (a round's burst is queued, not dropped, so TCP does not back off).
    qdisc = ["tbf", "rate", rate, "burst", "64kb", "latency", "2000ms"]
    return ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *qdisc]


def setup_commands(plan: Plan) -> list[list[str]]:
    """The commands that build ``plan``'s namespaces, links, qdiscs and cgroup, in order."""
    cmds: list[list[str]] = [["ip", "netns", "add", ns] for ns in plan.namespaces()]
    ends: list[tuple[str, str]] = []  # (namespace, device) of every veth end
    if plan.hub is None:
        a, b = plan.veth(0), plan.veth(1)
        cmds.append(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
        for k in (0, 1):
            cmds.append(["ip", "link", "set", plan.veth(k), "netns", plan.namespace(k)])
            ends.append((plan.namespace(k), plan.veth(k)))
    else:
        hub = plan.hub
        bridge = f"{plan.prefix}br"
        cmds.append(["ip", "-n", hub, "link", "add", bridge, "type", "bridge"])
        cmds.append(["ip", "-n", hub, "link", "set", bridge, "up"])
        for k in range(plan.endpoints):
            island, spoke = plan.veth(k), plan.hub_veth(k)
            cmds.append(["ip", "link", "add", island, "type", "veth", "peer", "name", spoke])
            cmds.append(["ip", "link", "set", island, "netns", plan.namespace(k)])
            cmds.append(["ip", "link", "set", spoke, "netns", hub])
            cmds.append(["ip", "-n", hub, "link", "set", spoke, "master", bridge])
            cmds.append(["ip", "-n", hub, "link", "set", spoke, "up"])
            ends.append((plan.namespace(k), island))
            ends.append((hub, spoke))
    for k in range(plan.endpoints):
        ns = plan.namespace(k)
        cmds.append(["ip", "-n", ns, "addr", "add", f"{plan.address(k)}/24", "dev", plan.veth(k)])
        cmds.append(["ip", "-n", ns, "link", "set", plan.veth(k), "up"])
        cmds.append(["ip", "-n", ns, "link", "set", "lo", "up"])
    if plan.rate is not None:
        cmds.extend(_tbf(ns, dev, plan.rate) for ns, dev in ends)
    return cmds


def cgroup_settings(plan: Plan, k: int) -> dict[str, str]:
    """File -> value to write into island k's cgroup (empty without one)."""
    if plan.cgroup(k) is None:
        return {}
    period = 100_000
    return {
        "cpu.cfs_period_us": str(period),
        "cpu.cfs_quota_us": str(round(plan.quota(k) * period)),
    }


def island_command(
    plan: Plan,
    k: int,
    overrides: Sequence[str],
    out: Path,
    python: str = sys.executable,
    trainer: str = "lightning",
) -> list[str]:
    """The command that launches island ``k``: torchrun inside its namespace, in the cgroup
    first where it is the slow island (``ip netns exec`` remounts /sys, so the cgroup tree is
    not reachable after it). ``trainer="lightning"`` runs the Hydra app with ``overrides``;
    ``"torchft"`` runs ``benchmarks/wan_torchft.py`` (torchft's DiLoCo) with them as its
    arguments."""
    island_dir = out / f"island{k}"
    env = [
        f"GLOO_SOCKET_IFNAME={plan.veth(k)}",
        f"PYTHONPATH={plan.checkout}{os.pathsep}{ROOT / 'benchmarks'}",
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}",
        f"WAN_ADDR={plan.address(k)}",
    ]
    cmd = ["ip", "netns", "exec", plan.namespace(k), "env", *env, python]
    cmd += ["-m", "torch.distributed.run", "--nnodes", str(plan.islands), "--nproc-per-node", "1"]
    cmd += ["--node-rank", str(k), "--master-addr", plan.address(0)]
    cmd += ["--master-port", str(plan.port)]
    if trainer == "torchft":
        cmd += ["-m", "wan_torchft", f"--out={island_dir}", *overrides]
    elif trainer != "lightning":
        raise ValueError(f"--trainer must be lightning or torchft (got {trainer!r})")
    else:
        cmd += ["-m", "lightning_swarm.cli", *_hydra_args(plan.islands, island_dir, overrides)]
    group = plan.cgroup(k)
    if group is not None:
        # $0 is the cgroup directory; the shell joins it and becomes the launch command.
        join = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
        cmd = ["sh", "-c", join, str(group), *cmd]
    return cmd


def _hydra_args(
    num_nodes: int, island_dir: Path, overrides: Sequence[str], devices: int = 1
) -> list[str]:
    return [
        f"trainer.num_nodes={num_nodes}",
        f"trainer.devices={devices}",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={island_dir}",
        "+callbacks.wan_steps._target_=wan_steps.StepTimes",
        f"+callbacks.wan_steps.path={island_dir}/steps.json",
        *overrides,
    ]


def refusal(
    euid: int,
    which: Callable[[str], str | None],
    cgroup_cpu: Path | None,
) -> str | None:
    """Why this machine cannot run the harness (None when it can, as far as checks without
    side effects tell). ``cgroup_cpu`` is the cgroup v1 cpu mount when a slow island is asked
    for, else None."""
    if euid != 0:
        return (
            "benchmarks/wan.py must run as root: it creates network namespaces (ip netns), "
            "veth links, tc qdiscs and a cpu cgroup. Run it with sudo, or as root in a "
            "container with CAP_NET_ADMIN and CAP_SYS_ADMIN."
        )
    missing = [tool for tool in ("ip", "tc") if which(tool) is None]
    if missing:
        return (
            f"benchmarks/wan.py needs {' and '.join(missing)} on PATH (package iproute2): "
            f"install it (e.g. apt-get install iproute2) and run again."
        )
    if cgroup_cpu is not None and not (cgroup_cpu / "cpu.cfs_quota_us").exists():
        return (
            f"--slow-island needs the cgroup v1 cpu controller at {cgroup_cpu} (no "
            "cpu.cfs_quota_us there); on a cgroup v2-only host drop --slow-island."
        )
    return None


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def probe_namespaces(prefix: str) -> str | None:
    """Make and remove one namespace; the reason it failed, or None."""
    name = f"{prefix}-probe"
    made = _run(["ip", "netns", "add", name], check=False)
    if made.returncode != 0:
        return (
            f"benchmarks/wan.py cannot create a network namespace ({made.stderr.strip()}); "
            "it needs root with CAP_SYS_ADMIN and a kernel with network namespaces."
        )
    _run(["ip", "netns", "del", name], check=False)
    return None


def _remove_hosts_files(prefix: str) -> list[str]:
    """Remove the ``/etc/netns/<prefix>-*/hosts`` files (and their folders) made here."""
    removed: list[str] = []
    for folder in NETNS_ETC.glob(f"{prefix}-*"):
        with contextlib.suppress(FileNotFoundError):
            (folder / "hosts").unlink()
            removed.append(f"hosts {folder / 'hosts'}")
        with contextlib.suppress(OSError):
            folder.rmdir()
    return removed


def _kill_namespace_pids(ns: str) -> None:
    pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Remove every namespace, root-namespace link and cpu cgroup whose name starts with
    ``prefix`` (processes left in them are killed). Returns what was removed."""
    removed: list[str] = []
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith(f"{prefix}-"):
            _kill_namespace_pids(ns)
            if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
                removed.append(f"netns {ns}")
    links = _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines()
    for line in links:
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        ours = name.startswith(prefix) and name[len(prefix) :][:1].isdigit()
        if ours and _run(["ip", "link", "del", name], check=False).returncode == 0:
            removed.append(f"link {name}")
    removed += _remove_hosts_files(prefix)
    if CGROUP_CPU.is_dir():
        for group in CGROUP_CPU.glob(f"{prefix}-*"):
            procs = (group / "cgroup.procs").read_text().split()
            for pid in procs:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            for _ in range(50):
                try:
                    group.rmdir()
                    removed.append(f"cgroup {group}")
                    break
                except OSError:
                    time.sleep(0.1)
    return removed


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _deltas(values: Sequence[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(values)]


def step_stats(record: dict[str, Any]) -> dict[str, Any]:
    """Inner-step figures of one rank's ``steps.json``.

    A step is the time from the previous batch's end to this one's, less any validation pass
    between them. The first step (start-up) is left out; ``inner_*`` also leaves out the last
    (it holds the end-of-fit round). ``training_cpu_s`` / ``runqueue_s`` / ``asleep_s``: the
    training thread's time on a CPU, runnable but waiting, and neither (blocked: a lock, the
    GIL, a future, a socket), summed over the inner steps without a validation pass.
    """
    ends = record["step_end_s"]
    spans = record["val_spans"]
    steps: list[float] = []
    quiet: list[bool] = []  # no validation pass inside the step
    for i in range(1, len(ends)):
        lo, hi = ends[i - 1], ends[i]
        val = sum(min(b, hi) - max(a, lo) for a, b in spans if b > lo and a < hi)
        steps.append(hi - lo - val)
        quiet.append(val == 0)
    inner = steps[:-1]
    cpu = _deltas(record["thread_cpu_s"])[:-1]
    wait = _deltas(record["thread_wait_s"])[:-1]
    sync = _deltas(record["sync_wall_s"])
    kept = [i for i in range(len(inner)) if quiet[i]]
    kept_cpu, kept_wait = sum(cpu[i] for i in kept), sum(wait[i] for i in kept)
    out = {
        "steps": len(ends),
        "step_s": [round(x, 4) for x in steps],
        "inner_median_s": _median(inner),
        "inner_sum_s": sum(inner),
        "inner_max_s": max(inner) if inner else float("nan"),
        "last_step_s": steps[-1] if steps else float("nan"),
        "sync_in_inner_s": sum(sync[:-1]),
        "sync_last_step_s": sync[-1] if sync else 0.0,
        "training_cpu_s": kept_cpu,
        "runqueue_s": kept_wait,
        "quiet_inner_sum_s": sum(inner[i] for i in kept),
        "asleep_s": sum(inner[i] for i in kept) - kept_cpu - kept_wait,
        "fit_s": record["fit_s"],
        "outer_steps": record["outer_steps"],
        "bytes_sent": record["bytes_sent"],
        "val_points": record["val_points"],
        "threads_cpu_s": record.get("threads_cpu_s", {}),
    }
    if "process_cpu_s" in record:
        proc = record["process_cpu_s"]
        out["other_threads_cpu_s"] = (
            proc[-1] - proc[0] - (record["thread_cpu_s"][-1] - record["thread_cpu_s"][0])
        )
    return out


@dataclass
class IslandRun:
    cmd: list[str]
    proc: subprocess.Popen[bytes]
    log: Path


def _stop(runs: list[IslandRun]) -> None:
    for run in runs:
        if run.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.proc.pid, signal.SIGKILL)
    for run in runs:
        run.proc.wait()


def _teardown(plan: Plan, runs: list[IslandRun], made: Sequence[Path] = ()) -> None:
    """Kill what ``plan`` launched, then remove its namespaces, hosts files and the cgroups
    ``made``."""
    _stop(runs)
    for ns in plan.namespaces():
        _kill_namespace_pids(ns)
        _run(["ip", "netns", "del", ns], check=False)
    _remove_hosts_files(plan.prefix)
    for group in made:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def run_plan(
    plan: Plan,
    overrides: Sequence[str],
    out: Path,
    timeout_s: float,
    trainer: str = "lightning",
) -> dict[str, Any]:
    """Build ``plan``, run one island per namespace, tear everything down; return each
    island's step figures plus rank 0's ``summary.json``. Raises RuntimeError if an island
    fails (with the end of its log)."""
    out.mkdir(parents=True, exist_ok=True)
    runs: list[IslandRun] = []
    made: list[Path] = []
    try:
        for cmd in setup_commands(plan):
            _run(cmd)
        for k in range(plan.islands):
            group = plan.cgroup(k)
            if group is None:
                continue
            group.mkdir(exist_ok=True)
            made.append(group)
            for name, value in cgroup_settings(plan, k).items():
                (group / name).write_text(value)
        start = time.perf_counter()
        for k in range(plan.islands):
            cmd = island_command(plan, k, overrides, out, trainer=trainer)
            log = out / f"island{k}.log"
            with open(log, "wb") as f:
                proc = subprocess.Popen(
                    cmd, stdout=f, stderr=subprocess.STDOUT, cwd=out, start_new_session=True
                )
            runs.append(IslandRun(cmd, proc, log))
        deadline = start + timeout_s
        while any(r.proc.poll() is None for r in runs):
            failed = [r for r in runs if r.proc.returncode not in (None, 0)]
            if failed or time.perf_counter() > deadline:
                break
            time.sleep(0.5)
        wall = time.perf_counter() - start
        bad = [(k, r) for k, r in enumerate(runs) if r.proc.returncode != 0]
        if bad:
            _stop(runs)
            k, r = bad[0]
            why = "timed out" if r.proc.returncode is None else f"exit {r.proc.returncode}"
            tail = r.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"island {k} {why} ({' '.join(r.cmd)}):\n{tail}")
    finally:
        _teardown(plan, runs, made)
    result: dict[str, Any] = {"wall_s": wall, "islands": []}
    for k in range(plan.islands):
        record = json.loads((out / f"island{k}" / "steps.json").read_text())
        result["islands"].append(step_stats(record))
    summary = out / "island0" / "summary.json"
    if summary.exists():
        result["summary"] = json.loads(summary.read_text())
    return result


# -- elastic islands: the lighthouse and each island in a namespace of its own ----------------


def hosts_file(plan: Plan) -> str:
    """The ``/etc/hosts`` of every namespace of an elastic plan: each endpoint's namespace name,
    which its processes take as their host name, at its veth address. torchft advertises the
    host name (its manager server, the island's store), so every island must resolve every
    other island's name to an address on the link."""
    lines = ["127.0.0.1 localhost"]
    lines += [f"{plan.address(k)} {plan.namespace(k)}" for k in range(plan.endpoints)]
    return "\n".join(lines) + "\n"


def lighthouse_url(plan: Plan) -> str:
    return f"http://{plan.address(plan.islands)}:{plan.lighthouse_port}"


def lighthouse_command(
    plan: Plan, heartbeat_timeout_ms: int, join_timeout_ms: int, python: str = sys.executable
) -> list[str]:
    """``swarm-lighthouse`` in the lighthouse's namespace (a quorum needs two islands)."""
    env = [f"PYTHONPATH={plan.checkout}"]
    cmd = ["ip", "netns", "exec", plan.namespace(plan.islands), "env", *env, python]
    cmd += ["-m", "lightning_swarm.membership.lighthouse", "--bind", "0.0.0.0"]
    cmd += ["--port", str(plan.lighthouse_port), "--min-islands", "2"]
    cmd += ["--join-timeout-ms", str(join_timeout_ms)]
    return [*cmd, "--heartbeat-timeout-ms", str(heartbeat_timeout_ms)]


def elastic_island_command(
    plan: Plan,
    k: int,
    overrides: Sequence[str],
    out: Path,
    python: str = sys.executable,
    devices: int = 1,
) -> list[str]:
    """Island ``k`` as its own launch of the Hydra app (``devices`` ranks, ``membership=torchft``,
    island id ``i<k>``), in its namespace and in a UTS namespace of its own whose host name is
    the namespace's name (``hosts_file`` resolves it on every endpoint)."""
    island_dir = out / f"island{k}"
    name = plan.namespace(k)
    env = [
        f"GLOO_SOCKET_IFNAME={plan.veth(k)}",
        f"PYTHONPATH={plan.checkout}{os.pathsep}{ROOT / 'benchmarks'}",
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}",
        "PYTHONUNBUFFERED=1",  # the kill watches torchft's round lines in the log as they come
    ]
    # $0 is the host name; the shell sets it in the new UTS namespace and becomes the launch.
    named = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', name]
    cmd = ["ip", "netns", "exec", name, *named, "env", *env, python, "-m", "lightning_swarm.cli"]
    elastic = [
        "strategy.membership=torchft",
        f"strategy.lighthouse={lighthouse_url(plan)}",
        f"strategy.island_id=i{k}",
    ]
    return [*cmd, *_hydra_args(1, island_dir, [*elastic, *overrides], devices=devices)]


def rate_bps(rate: str) -> float:
    """Bits per second of a tc rate such as ``10mbit``."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: give a number with kbit, mbit or gbit (tc syntax)")


def qdisc_stats(ns: str) -> dict[str, tuple[int, int]]:
    """(bytes sent, bytes queued) of each tbf qdisc of namespace ``ns``, by device."""
    done = _run(["tc", "-n", ns, "-j", "-s", "qdisc", "show"], check=False)
    try:
        rows = json.loads(done.stdout or "[]")
    except json.JSONDecodeError:
        return {}
    return {
        r["dev"]: (int(r.get("bytes", 0)), int(r.get("backlog", 0)))
        for r in rows
        if r.get("kind") == "tbf"
    }


Sample = tuple[float, dict[str, tuple[int, int]]]
"""(unix time, device -> (bytes sent, bytes queued)): one look at every link end's qdisc."""


def busy_spans(
    samples: Sequence[Sample], dev: str, bps: float, gap_s: float = 1.0
) -> list[tuple[float, float, int]]:
    """(start, seconds, bytes) of each stretch in which ``dev`` sent at half its rate or more,
    stretches less than ``gap_s`` apart joined: the transfers on that link end."""
    spans: list[list[float]] = []
    for (t0, a), (t1, b) in itertools.pairwise(samples):
        if dev not in a or dev not in b or t1 <= t0:
            continue
        sent = b[dev][0] - a[dev][0]
        if sent * 8 / (t1 - t0) < bps / 2:
            continue
        if spans and t0 - spans[-1][1] < gap_s:
            spans[-1][1], spans[-1][2] = t1, spans[-1][2] + sent
        else:
            spans.append([t0, t1, sent])
    return [(a, b - a, int(n)) for a, b, n in spans]


def full_commits(log: str, islands: int) -> int:
    """Rounds an island's log shows committed in a quorum of all ``islands`` (torchft's
    ``got lighthouse quorum`` line lists the members; ``should_commit=True`` ends a round). An
    island's join, healed in such a quorum, counts too."""
    count, full = 0, False
    for line in log.splitlines():
        if "got lighthouse quorum" in line:
            full = line.count("QuorumMember {") == islands
        elif "should_commit=True" in line and full:
            count += 1
    return count


def run_elastic(
    plan: Plan,
    overrides: Sequence[str],
    out: Path,
    timeout_s: float,
    *,
    kill_island: int | None = None,
    kill_round: int = 3,
    kill_after_s: float = 2.0,
    heartbeat_timeout_ms: int = 5_000,
    join_timeout_ms: int = 120_000,
    devices: int = 1,
) -> dict[str, Any]:
    """Build ``plan`` (with its lighthouse), start the lighthouse, then every island as its own
    elastic launch; once island ``kill_island``'s log shows ``kill_round`` rounds committed with
    every island, SIGKILL its process group ``kill_after_s`` after its next round's quorum
    (inside that round's exchange; the kill records the link's rate then); tear everything
    down. Every link's queue is sampled
    throughout. Returns ``elastic_report``'s figures.
    Raises RuntimeError if the lighthouse does not start or a surviving island fails."""
    if not plan.lighthouse or plan.rate is None:
        raise ValueError("run_elastic needs a plan with lighthouse=True and a rate")
    out.mkdir(parents=True, exist_ok=True)
    runs: list[IslandRun] = []
    samples: list[Sample] = []
    kill: dict[str, Any] | None = None
    armed_at: int | None = None  # the victim's quorum count once it had kill_round full rounds
    round_seen: float | None = None  # when the victim's next round began
    try:
        for cmd in setup_commands(plan):
            _run(cmd)
        for k in range(plan.endpoints):
            folder = NETNS_ETC / plan.namespace(k)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(hosts_file(plan))
        log = out / "lighthouse.log"
        cmd = lighthouse_command(plan, heartbeat_timeout_ms, join_timeout_ms)
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        runs.append(IslandRun(cmd, proc, log))
        deadline = time.perf_counter() + 60
        while "lighthouse at" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"the lighthouse did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        islands: list[IslandRun] = []
        for k in range(plan.islands):
            cmd = elastic_island_command(plan, k, overrides, out, devices=devices)
            log = out / f"island{k}.log"
            with open(log, "wb") as f:
                proc = subprocess.Popen(
                    cmd, stdout=f, stderr=subprocess.STDOUT, cwd=out, start_new_session=True
                )
            islands.append(IslandRun(cmd, proc, log))
        runs += islands
        start = time.perf_counter()
        namespaces = [plan.namespace(k) for k in range(plan.endpoints)]
        if plan.hub is not None:
            namespaces.append(plan.hub)
        while any(r.proc.poll() is None for r in islands):
            now = time.time()
            seen: dict[str, tuple[int, int]] = {}
            for ns in namespaces:
                seen.update(qdisc_stats(ns))
            if kill_island is not None and kill is None:
                text = islands[kill_island].log.read_text(errors="replace")
                quorums = text.count("got lighthouse quorum")
                if armed_at is None and full_commits(text, plan.islands) >= kill_round:
                    armed_at = quorums
                elif armed_at is not None and quorums > armed_at and round_seen is None:
                    round_seen = now  # the next round's quorum: its exchange starts now
                if round_seen is not None and now - round_seen >= kill_after_s and samples:
                    os.killpg(islands[kill_island].proc.pid, signal.SIGKILL)
                    dev = plan.veth(kill_island)
                    t_prev, prev = samples[-1]
                    sent = seen.get(dev, (0, 0))[0] - prev.get(dev, (0, 0))[0]
                    kill = {"island": kill_island, "t": now, "after_full_rounds": kill_round}
                    kill["into_round_s"] = now - round_seen
                    kill["link_mbit_s"] = sent * 8 / max(now - t_prev, 1e-3) / 1e6
                    kill["queued_bytes"] = seen.get(dev, (0, 0))[1]
            samples.append((now, seen))
            failed = [
                k
                for k, r in enumerate(islands)
                if r.proc.returncode not in (None, 0) and k != kill_island
            ]
            if failed or time.perf_counter() > start + timeout_s:
                break
            time.sleep(0.25)
        wall = time.perf_counter() - start
        bad = [(k, r) for k, r in enumerate(islands) if r.proc.returncode != 0 and k != kill_island]
        if bad:
            k, r = bad[0]
            why = "timed out" if r.proc.returncode is None else f"exit {r.proc.returncode}"
            tail = r.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"island {k} {why} ({' '.join(r.cmd)}):\n{tail}")
        if kill_island is not None and kill is None:
            raise RuntimeError(
                f"island {kill_island} was not killed: it did not commit {kill_round} rounds "
                "with every island and start another; run more steps or lower kill_round"
            )
    finally:
        _teardown(plan, runs)
    return elastic_report(plan, out, wall, kill, samples)


def _round_rows(island_dir: Path) -> list[dict[str, float]]:
    """The rows of an island's CSV log that hold an outer round's metrics."""
    import csv

    rows: list[dict[str, float]] = []
    for path in sorted(island_dir.glob("logs/version_*/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get("swarm/islands_in_round"):
                    rows.append({k: float(v) for k, v in row.items() if v not in ("", None)})
    return rows


def elastic_report(
    plan: Plan,
    out: Path,
    wall_s: float,
    kill: dict[str, Any] | None,
    samples: list[Sample],
) -> dict[str, Any]:
    """The figures of an elastic run, from the islands' files and the queue samples.

    Per island: its rounds (islands in each, from the CSV log; the killed island's log may end
    before it did), abandoned rounds, committed rounds and their times (``steps.json``), and the
    digest of its final parameters. Across them: rounds before the kill with fewer than all
    islands (a quorum lost to a starved heartbeat would show there), the seconds from the kill
    to the survivors' next committed round, whether the survivors end bitwise equal, and each
    link end's longest queue in bytes and in seconds at the link's rate (what a heartbeat
    behind a round waits)."""
    assert plan.rate is not None
    bps = rate_bps(plan.rate)
    islands: list[dict[str, Any]] = []
    for k in range(plan.islands):
        island_dir = out / f"island{k}"
        rows = _round_rows(island_dir)
        one: dict[str, Any] = {
            "island": k,
            "rounds": [
                {"step": r.get("step", -1), "islands": r["swarm/islands_in_round"]} for r in rows
            ],
            "rounds_abandoned": max((r.get("swarm/rounds_abandoned", 0) for r in rows), default=0),
        }
        steps_path = island_dir / "steps.json"
        if steps_path.exists():
            record = json.loads(steps_path.read_text())
            ends = [record["t0_unix"] + t for t in record["step_end_s"]]
            outer = record["outer_steps_at"]
            one["commit_times"] = [
                ends[i] for i in range(len(ends)) if outer[i] > (outer[i - 1] if i else 0)
            ]
            step_time = dict(zip(record["global_step"], ends, strict=True))
            for r in one["rounds"]:
                r["t"] = step_time.get(int(r["step"]), float("nan"))
            one.update(
                steps=len(ends),
                outer_steps=record["outer_steps"],
                params_sha256=record["params_sha256"],
                fit_s=record["fit_s"],
            )
        islands.append(one)
    survivors = [i for i in islands if kill is None or i["island"] != kill["island"]]
    kill_t = kill["t"] if kill is not None else float("inf")
    # From the first round with every island in it (islands that start a moment apart join
    # over the first rounds) to the kill: a round short of an island there is a lost quorum.
    # A round is before the kill when its step ended before it; the killed island's log holds
    # nothing after it.
    full = [r["t"] for one in survivors for r in one["rounds"] if r["islands"] == plan.islands]
    first_full = min((t for t in full if t == t), default=float("inf"))
    short = [
        (one["island"], r["step"], r["islands"])
        for one in survivors
        for r in one["rounds"]
        if first_full < r.get("t", float("nan")) < kill_t and r["islands"] < plan.islands
    ]
    after = [t - kill_t for s in survivors for t in s.get("commit_times", []) if t > kill_t]
    # The survivors' first round to end after the kill: the round in flight, abandoned when
    # its collectives lose the killed island (a committed round does not count it).
    ended = [r["t"] - kill_t for s in survivors for r in s["rounds"] if r.get("t", 0) > kill_t]
    queues: dict[str, int] = {}
    for _, seen in samples:
        for dev, (_, backlog) in seen.items():
            queues[dev] = max(queues.get(dev, 0), backlog)
    digests = {s.get("params_sha256") for s in survivors}
    t_start = samples[0][0] if samples else 0.0
    transfers = {
        plan.veth(k): [
            (round(a - t_start, 1), round(d, 1), n)
            for a, d, n in busy_spans(samples, plan.veth(k), bps)
        ]
        for k in range(plan.islands)
    }
    return {
        "wall_s": wall_s,
        "rate": plan.rate,
        "kill": kill,
        "kill_at_s": kill_t - t_start if kill is not None else None,
        "islands": islands,
        "first_full_round_s": first_full - t_start if full else None,
        "short_rounds_before_kill": short,
        "full_rounds_before_kill": max(
            (
                sum(1 for r in one["rounds"] if r["islands"] == plan.islands and r["t"] < kill_t)
                for one in survivors
            ),
            default=0,
        ),
        "kill_to_round_end_s": min(ended) if ended else None,
        "kill_to_next_commit_s": min(after) if after else None,
        "survivors_equal": len(digests) == 1 and None not in digests,
        "survivor_outer_steps": [s.get("outer_steps") for s in survivors],
        "max_queue_bytes": queues,
        "max_queue_s": {dev: b * 8 / bps for dev, b in queues.items()},
        "transfers": transfers,
        "samples": len(samples),
    }


def _rate(text: str) -> str | None:
    return None if text in ("unlimited", "none", "0") else text


def _raise_on_sigterm() -> None:
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def check_or_exit(plan_prefix: str, slow: bool) -> None:
    """Exit with the refusal message when this machine cannot run the harness."""
    why = refusal(os.geteuid(), shutil.which, CGROUP_CPU if slow else None)
    if why is None:
        why = probe_namespaces(plan_prefix)
    if why is not None:
        sys.exit(why)


# The runs of docs/wan.md: name -> Hydra overrides (besides max_steps and validation).
CONFIGS: dict[str, list[str]] = {
    "ddp": ["strategy=ddp"],
    "diloco_fp32": ["strategy=swarm", "strategy.sync_every=50"],
    "diloco_fp32_overlap": ["strategy=swarm", "strategy.sync_every=50", "strategy.sync_delay=20"],
    "streaming_int4": [
        "strategy=swarm",
        "strategy.sync_every=50",
        "strategy.num_fragments=2",
        "strategy.sync_delay=5",
        "strategy.quantize=int4",
        "strategy.error_feedback=true",
    ],
    "swarm_small": ["strategy=swarm_small"],
    # No round inside the run (the pacing check, with and without a slow island).
    "no_round": ["strategy=swarm", "strategy.sync_every=1000"],
}
# Runs of benchmarks/wan_torchft.py (torchft's own DiLoCo): name -> its arguments.
TORCHFT_CONFIGS: dict[str, list[str]] = {"torchft_diloco": ["--sync-every=50"]}
RATES = ["unlimited", "100mbit", "10mbit"]
# The elastic run's Hydra overrides: the main job's GPT widened to 1.34M parameters, so one fp32
# round is 5.4 MB (a ring over three islands sends 7.1 MB from each: about 6 s at 10 Mbit/s),
# a round every 10 inner steps, no validation (each island would validate alone).
ELASTIC_OVERRIDES = [
    "model.n_embd=160",
    "strategy.sync_every=10",
    "trainer.max_steps=80",
    "trainer.limit_val_batches=0",
    "trainer.log_every_n_steps=1",
    "logger=csv",
    "callbacks=none",
]


# docs/wan.md was measured with the outer momentum held constant (the default before the
# momentum ramp of docs/tuning.md, and what torchft's DiLoCo does): the campaign keeps it so.
CONSTANT_MOMENTUM = ["strategy.outer_momentum_warmup=0", "strategy.outer_momentum_cooldown=0"]


def campaign_overrides(name: str, steps: int, val_every: int) -> list[str]:
    if name in TORCHFT_CONFIGS:
        return [*TORCHFT_CONFIGS[name], f"--steps={steps}", f"--val-every={val_every}"]
    return [
        *CONFIGS[name],
        *(CONSTANT_MOMENTUM if name != "ddp" else []),
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={val_every}",
        "logger=none",
        "callbacks=none",
    ]


def campaign_runs(only: Sequence[str] | None) -> list[tuple[str, str]]:
    """(name, rate) of each campaign run ``--only`` names (``NAME`` = at every rate), or of the
    whole campaign; raises SystemExit naming an unknown name."""
    known = [*CONFIGS, *TORCHFT_CONFIGS]
    items = list(only) if only else [n for n in known if n != "no_round"]
    unknown = [item for item in items if item.partition("@")[0] not in known]
    if unknown:
        raise SystemExit(
            f"unknown campaign runs {unknown}: names are {known}, as NAME or NAME@RATE"
        )
    runs: list[tuple[str, str]] = []
    for item in items:
        name, _, rate = item.partition("@")
        runs.extend((name, r) for r in ([rate] if rate else RATES))
    return runs


def _main_run(
    args: argparse.Namespace, overrides: list[str], trainer: str = "lightning"
) -> dict[str, Any]:
    plan = Plan(
        islands=args.islands,
        rate=_rate(args.rate),
        prefix=args.prefix,
        slow_island=args.slow_island,
        cpu_quota=args.cpu_quota,
        fast_quota=args.fast_quota,
        checkout=args.checkout.resolve(),
    )
    check_or_exit(plan.prefix, plan.slow_island is not None)
    cleanup(plan.prefix)  # leftovers of an earlier, killed run would block the names
    return run_plan(plan, overrides, args.out, args.timeout, trainer=trainer)


def _elastic_run(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    plan = Plan(
        islands=args.islands,
        rate=_rate(args.rate),
        prefix=args.prefix,
        checkout=args.checkout.resolve(),
        lighthouse=True,
    )
    if plan.rate is None:
        sys.exit("elastic: give a --rate (the run measures queues on a limited link)")
    kill = (
        None
        if args.no_kill
        else (plan.islands - 1 if args.kill_island is None else args.kill_island)
    )
    if kill is not None and not 0 <= kill < plan.islands:
        sys.exit(f"--kill-island {kill} is not an island of {plan.islands} (0..{plan.islands - 1})")
    check_or_exit(plan.prefix, False)
    cleanup(plan.prefix)
    fsdp = ["strategy.island_size=2", "strategy.island_parallel=fsdp"] if args.fsdp_islands else []
    return run_elastic(
        plan,
        [*ELASTIC_OVERRIDES, *fsdp, *overrides],
        args.out,
        args.timeout,
        kill_island=kill,
        kill_round=args.kill_round,
        kill_after_s=args.kill_after_s,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        join_timeout_ms=args.join_timeout_ms,
        devices=2 if args.fsdp_islands else 1,
    )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "mode",
        nargs="?",
        default="run",
        choices=["run", "campaign", "plot", "table", "restat", "elastic"],
    )
    parser.add_argument("--rate", default="10mbit", help="tbf rate, or 'unlimited'")
    parser.add_argument("--islands", type=int, default=None, help="2; elastic: 3")
    parser.add_argument("--slow-island", type=int, default=None)
    parser.add_argument("--cpu-quota", type=float, default=0.4)
    parser.add_argument(
        "--fast-quota", type=float, default=None, help="each other island's share of a core"
    )
    parser.add_argument("--prefix", default=PREFIX)
    parser.add_argument("--checkout", type=Path, default=ROOT, help="library checkout to run")
    parser.add_argument("--tag", default="", help="campaign: suffix of the results' keys")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/wan_run"))
    parser.add_argument("--only", nargs="*", default=None, help="campaign: NAME@RATE or NAME")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--cleanup", action="store_true", help="remove leftovers and exit")
    elastic = parser.add_argument_group("elastic (a lighthouse namespace, torchft islands)")
    elastic.add_argument("--kill-island", type=int, default=None, help="default: the last")
    elastic.add_argument("--no-kill", action="store_true", help="kill no island")
    elastic.add_argument(
        "--kill-round", type=int, default=3, help="kill after N rounds with every island"
    )
    elastic.add_argument("--kill-after-s", type=float, default=2.0, help="into the next round")
    elastic.add_argument("--heartbeat-timeout-ms", type=int, default=5_000)
    elastic.add_argument("--join-timeout-ms", type=int, default=120_000)
    elastic.add_argument(
        "--fsdp-islands",
        action="store_true",
        help="islands of 2 ranks, the model FSDP-sharded over them (each rank its own shard)",
    )
    args = parser.parse_args(argv)
    if args.islands is None:
        args.islands = 3 if args.mode == "elastic" else 2
    if args.cleanup:
        if os.geteuid() != 0:
            sys.exit(refusal(os.geteuid(), shutil.which, None))
        removed = cleanup(args.prefix)
        print("\n".join(removed) if removed else f"nothing named {args.prefix}* to remove")
        return
    if args.mode == "restat":  # recompute the step figures from the runs' steps.json files
        results = json.loads(args.results.read_text())
        for one in results.values():
            out = Path(one["out"])
            n = len(one["islands"])
            one["islands"] = [
                step_stats(json.loads((out / f"island{k}" / "steps.json").read_text()))
                for k in range(n)
            ]
        args.results.write_text(json.dumps(results, indent=1))
        return
    if args.mode == "table":
        print(table(json.loads(args.results.read_text()), args.tag))
        return
    if args.mode == "plot":
        print(plot(json.loads(args.results.read_text()), PLOT))
        return
    if args.mode == "campaign":
        campaign_runs(args.only)  # an unknown name stops here, before anything is made
    check_or_exit(args.prefix, args.slow_island is not None)
    _raise_on_sigterm()
    if args.mode == "elastic":
        result = _elastic_run(args, overrides)
        (args.out / "elastic.json").write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "islands"}, indent=1))
        return
    if args.mode == "run":
        if not any(o.startswith("trainer.max_steps=") for o in overrides):
            overrides.insert(0, f"trainer.max_steps={args.steps}")
        result = _main_run(args, overrides)
        print(json.dumps(result, indent=1))
        return
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    base = args.out
    for name, r in campaign_runs(args.only):
        args.rate = r
        key = f"{name}@{r}{args.tag}"
        if args.slow_island is not None:
            key += f"+slow{args.slow_island}q{args.cpu_quota}"
        args.out = base / key.replace("@", "-")  # one folder per run: restat reads it
        extra = campaign_overrides(name, args.steps, args.val_every)
        trainer = "torchft" if name in TORCHFT_CONFIGS else "lightning"
        one = _main_run(args, [*extra, *overrides], trainer=trainer)
        one.update({"config": name, "rate": r, "overrides": [*extra, *overrides]})
        one.update({"out": str(args.out), "checkout": str(args.checkout)})
        if args.slow_island is not None:
            one.update({"slow_island": args.slow_island, "cpu_quota": args.cpu_quota})
        results[key] = one
        args.results.write_text(json.dumps(results, indent=1))
        i0 = one["islands"][0]
        brief = f"median {i0['inner_median_s']:.3f} s sum {i0['inner_sum_s']:.1f} s"
        print(f"{key}: wall {one['wall_s']:.1f} s, island 0 {brief}", flush=True)


def utilisation(
    results: dict[str, Any], name: str, rate: str, tag: str = ""
) -> tuple[float, float]:
    """Island 0's compute utilisation of ``name`` at ``rate``: (median inner step unlimited /
    median at the rate, mean inner step unlimited / mean at the rate). Inner steps leave out the
    first and the last (end-of-fit round) and validation; the mean keeps the rounds' stalls."""
    base = results[f"{name}@unlimited{tag}"]["islands"][0]
    one = results[f"{name}@{rate}{tag}"]["islands"][0]
    mean = one["inner_sum_s"] / max(one["steps"] - 2, 1)
    base_mean = base["inner_sum_s"] / max(base["steps"] - 2, 1)
    return base["inner_median_s"] / one["inner_median_s"], base_mean / mean


def table(results: dict[str, Any], tag: str = "") -> str:
    """The markdown table of docs/wan.md from the campaign's results (keys ending in ``tag``).
    Run queue: the training thread's time runnable but off a CPU (other processes' load);
    blocked: its time asleep (rounds, locks, sockets); both over inner steps without
    validation."""
    head = (
        "| run | link | steps | fit (s) | final val loss | median step (s) | mean step (s) "
        "| max step (s) | run queue (s) | blocked (s) | last step (s) | util. median "
        "| util. mean | not blocked |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for name in [*CONFIGS, *TORCHFT_CONFIGS]:
        for rate in RATES:
            key = f"{name}@{rate}{tag}"
            if key not in results:
                continue
            i0 = results[key]["islands"][0]
            mean = i0["inner_sum_s"] / max(i0["steps"] - 2, 1)
            loss = i0["val_points"][-1][2] if i0["val_points"] else float("nan")
            util = ("", "")
            if f"{name}@unlimited{tag}" in results:
                med, avg = utilisation(results, name, rate, tag)
                util = (f"{med:.3f}", f"{avg:.3f}")
            rows.append(
                f"| {name} | {rate} | {i0['steps']} | {i0['fit_s']:.1f} | {loss:.4f} "
                f"| {i0['inner_median_s']:.3f} | {mean:.3f} | {i0['inner_max_s']:.2f} "
                f"| {i0['runqueue_s']:.1f} | {i0['asleep_s']:.2f} | {i0['last_step_s']:.2f} "
                f"| {util[0]} | {util[1]} | {1 - i0['asleep_s'] / i0['quiet_inner_sum_s']:.3f} |"
            )
    return "\n".join(rows)


def plot(results: dict[str, Any], path: Path) -> str:
    """Validation loss (island 0's view) against seconds since the fit started, one panel per
    link rate, for the campaign's main runs; returns what was written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for r in RATES if any(v.get("rate") == r for v in results.values())]
    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), sharey=True)
    axes = [axes] if len(rates) == 1 else list(axes)
    for ax, rate in zip(axes, rates, strict=True):
        for key, one in sorted(results.items()):
            # the campaign's main runs only: no repeats (tagged keys), no pacing runs
            if key != f"{one.get('config')}@{rate}" or one["config"] == "no_round":
                continue
            points = one["islands"][0]["val_points"]
            if points:
                xs = [p[0] for p in points]
                ys = [p[2] for p in points]
                ax.plot(xs, ys, marker="o", label=one["config"])
        ax.set_title(f"link: {rate}")
        ax.set_xlabel("seconds since fit start")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"wrote {path}"


if __name__ == "__main__":
    main()
