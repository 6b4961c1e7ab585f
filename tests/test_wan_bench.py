"""benchmarks/wan.py: the plan it builds, the commands it runs, its refusals, its step figures;
and (``-m slow``, root only) a real run of two islands over a 10 Mbit/s link."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import wan
from benchmarks.wan import Plan, island_command, refusal, setup_commands, step_stats


def _flat(cmds: list[list[str]]) -> list[str]:
    return [" ".join(c) for c in cmds]


def test_two_islands_are_one_veth_pair_limited_at_both_ends() -> None:
    cmds = _flat(setup_commands(Plan(islands=2, rate="10mbit")))
    assert "ip netns add lsw-i0" in cmds and "ip netns add lsw-i1" in cmds
    assert not any("hub" in c for c in cmds)
    assert "ip link add lsw0 type veth peer name lsw1" in cmds
    assert "ip -n lsw-i1 addr add 10.77.0.2/24 dev lsw1" in cmds
    tbf = [c for c in cmds if " tbf " in c]
    assert len(tbf) == 2
    assert all("rate 10mbit" in c for c in tbf)
    assert {c.split()[3] for c in tbf} == {"lsw-i0", "lsw-i1"}


def test_unlimited_link_has_no_qdisc() -> None:
    assert not any("tc" in c for c in setup_commands(Plan(islands=2, rate=None)))


def test_more_islands_hang_off_a_bridge_in_a_hub_namespace() -> None:
    plan = Plan(islands=3, rate="100mbit")
    cmds = _flat(setup_commands(plan))
    assert plan.namespaces() == ["lsw-i0", "lsw-i1", "lsw-i2", "lsw-hub"]
    assert "ip -n lsw-hub link add lswbr type bridge" in cmds
    assert sum(" master lswbr" in c for c in cmds) == 3
    # every link limited at both its ends: 3 island ends + 3 hub ends
    assert sum(" tbf " in c for c in cmds) == 6


def test_island_command_runs_torchrun_in_its_namespace(tmp_path: Path) -> None:
    plan = Plan(islands=2, rate="10mbit")
    cmd = island_command(plan, 1, ["strategy.sync_every=50"], tmp_path, python="py")
    assert cmd[:4] == ["ip", "netns", "exec", "lsw-i1"]
    assert "GLOO_SOCKET_IFNAME=lsw1" in cmd
    joined = " ".join(cmd)
    assert "py -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --node-rank 1" in joined
    assert "--master-addr 10.77.0.1" in joined
    assert "trainer.num_nodes=2" in cmd and "trainer.devices=1" in cmd
    assert f"+callbacks.wan_steps.path={tmp_path}/island1/steps.json" in cmd
    assert cmd[-1] == "strategy.sync_every=50"  # user overrides come last and win


def test_slow_island_joins_its_cgroup_before_entering_the_namespace(tmp_path: Path) -> None:
    plan = Plan(islands=2, rate=None, slow_island=1, cpu_quota=0.4)
    settings = wan.cgroup_settings(plan, 1)
    assert settings == {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "40000"}
    slow = island_command(plan, 1, [], tmp_path, python="py")
    assert slow[:2] == ["sh", "-c"] and slow[3] == str(plan.cgroup(1))
    assert slow.index("ip") > 3  # ip netns exec remounts /sys: the cgroup must come first
    fast = island_command(plan, 0, [], tmp_path, python="py")
    assert fast[0] == "ip" and plan.cgroups() == [plan.cgroup(1)]
    assert wan.cgroup_settings(plan, 0) == {}


def test_fast_quota_puts_every_other_island_in_a_cgroup_of_its_own(tmp_path: Path) -> None:
    plan = Plan(islands=4, rate=None, slow_island=3, cpu_quota=0.2, fast_quota=0.45)
    groups = plan.cgroups()
    assert len(set(groups)) == 4
    assert [wan.cgroup_settings(plan, k)["cpu.cfs_quota_us"] for k in range(4)] == [
        "45000",
        "45000",
        "45000",
        "20000",
    ]
    for k in range(4):
        cmd = island_command(plan, k, [], tmp_path, python="py")
        assert cmd[:2] == ["sh", "-c"] and cmd[3] == str(plan.cgroup(k))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"islands": 1}, "--islands must be at least 2"),
        ({"islands": 2, "slow_island": 2}, "--slow-island 2 is not an island of 2"),
        ({"islands": 2, "cpu_quota": 0.0}, "--cpu-quota must be above 0"),
        ({"islands": 2, "fast_quota": 0.5}, "--fast-quota 0.5 needs --slow-island"),
        ({"islands": 2, "prefix": "far-too-long"}, "must be 1-6 letters or digits"),
    ],
)
def test_plan_refuses_bad_options(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Plan(rate=None, **kwargs)  # type: ignore[arg-type]


def test_refusals_name_the_problem_and_the_fix(tmp_path: Path) -> None:
    def have(tool: str) -> str:
        return f"/usr/sbin/{tool}"

    not_root = refusal(1000, have, None)
    assert not_root is not None and "must run as root" in not_root and "sudo" in not_root
    no_tc = refusal(0, lambda t: None if t == "tc" else have(t), None)
    assert no_tc is not None and "needs tc on PATH" in no_tc and "iproute2" in no_tc
    no_cgroup = refusal(0, have, tmp_path)
    assert no_cgroup is not None and "cgroup v1 cpu controller" in no_cgroup
    (tmp_path / "cpu.cfs_quota_us").write_text("-1")
    assert refusal(0, have, tmp_path) is None


def test_main_exits_with_the_refusal_when_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wan.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="must run as root"):
        wan.main(["--rate", "10mbit", "--steps", "2"])


def test_step_figures_leave_out_validation_start_up_and_the_last_step() -> None:
    record = {
        "step_end_s": [1.0, 1.2, 1.4, 2.6, 2.8, 6.0],
        "val_spans": [(1.4, 2.4)],  # 1.0 s of validation inside the 4th step (1.4 -> 2.6)
        "thread_cpu_s": [0.0, 0.1, 0.2, 0.3, 0.4, 0.5],
        "thread_wait_s": [0.0] * 6,
        "sync_wall_s": [0.0, 0.0, 0.0, 0.0, 0.0, 3.0],
        "val_points": [(2.4, 3, 4.0)],
        "fit_s": 6.0,
        "outer_steps": 1,
        "bytes_sent": 10,
    }
    stats = step_stats(record)
    assert stats["inner_median_s"] == pytest.approx(0.2)
    assert stats["inner_sum_s"] == pytest.approx(0.8)  # 4 steps of 0.2 s, validation out
    assert stats["last_step_s"] == pytest.approx(3.2)
    assert stats["sync_last_step_s"] == pytest.approx(3.0) and stats["sync_in_inner_s"] == 0
    # thread times only over the 3 inner steps without validation: 0.1 s on a CPU each
    assert stats["training_cpu_s"] == pytest.approx(0.3)
    assert stats["asleep_s"] == pytest.approx(0.3)


def _root_and_tools() -> str | None:
    return refusal(os.geteuid(), shutil.which, None)


@pytest.mark.slow  # ~40 s on 2 busy cores: two Lightning islands over a 10 Mbit/s link
@pytest.mark.skipif(_root_and_tools() is not None, reason="needs root, ip and tc")
def test_two_islands_over_a_10mbit_link_and_nothing_left_behind(tmp_path: Path) -> None:
    prefix = "lswt"
    if wan.probe_namespaces(prefix) is not None:
        pytest.skip("network namespaces cannot be made here")
    plan = Plan(islands=2, rate="10mbit", prefix=prefix, port=29581)
    overrides = ["trainer.max_steps=6", "trainer.val_check_interval=3", "strategy.sync_every=3"]
    overrides += ["logger=none", "callbacks=none"]
    result = wan.run_plan(plan, overrides, tmp_path, timeout_s=300)
    for island in result["islands"]:
        assert island["steps"] == 6
        assert island["outer_steps"] == 2
        assert len(island["val_points"]) == 2
    # one fp32 round of the main job's model: megabytes, over 10 Mbit/s: well above a second
    assert result["islands"][0]["sync_last_step_s"] > 1.0
    assert result["summary"]["outer_steps"] == 2
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in names
    assert not list(wan.CGROUP_CPU.glob(f"{prefix}-*"))


@pytest.mark.slow
@pytest.mark.skipif(_root_and_tools() is not None, reason="needs root, ip and tc")
def test_cleanup_removes_leftovers_by_prefix() -> None:
    prefix = "lswc"
    subprocess.run(["ip", "netns", "add", f"{prefix}-i0"], check=True)
    subprocess.run(
        ["ip", "link", "add", f"{prefix}0", "type", "veth", "peer", "name", f"{prefix}1"]
    )
    removed = wan.cleanup(prefix)
    assert f"netns {prefix}-i0" in removed
    assert any(item.startswith(f"link {prefix}") for item in removed)  # one end takes both
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert prefix not in names and prefix not in links


def test_campaign_names_runs_by_name_and_rate_and_refuses_unknown_ones() -> None:
    assert wan.campaign_runs(["ddp@10mbit"]) == [("ddp", "10mbit")]
    assert wan.campaign_runs(["torchft_diloco"]) == [
        ("torchft_diloco", r) for r in ("unlimited", "100mbit", "10mbit")
    ]
    whole = wan.campaign_runs(None)
    assert ("streaming_int4", "10mbit") in whole and all(n != "no_round" for n, _ in whole)
    with pytest.raises(SystemExit, match=r"unknown campaign runs \['dilocoo@10mbit'\]"):
        wan.campaign_runs(["dilocoo@10mbit"])


def test_torchft_islands_run_the_torchft_script(tmp_path: Path) -> None:
    plan = Plan(islands=2, rate=None)
    cmd = island_command(plan, 0, ["--sync-every=50"], tmp_path, python="py", trainer="torchft")
    assert "-m wan_torchft" in " ".join(cmd) and cmd[-1] == "--sync-every=50"
    assert not any(c.startswith("trainer.") for c in cmd)
    assert "WAN_ADDR=10.77.0.1" in cmd
    with pytest.raises(ValueError, match="--trainer must be lightning or torchft"):
        island_command(plan, 0, [], tmp_path, trainer="deepspeed")


def test_cleanup_refuses_when_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wan.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="must run as root"):
        wan.main(["--cleanup"])


def test_elastic_plan_puts_the_lighthouse_behind_its_own_limited_link() -> None:
    plan = Plan(islands=3, rate="10mbit", lighthouse=True)
    assert plan.namespaces() == ["lsw-i0", "lsw-i1", "lsw-i2", "lsw-lh", "lsw-hub"]
    cmds = _flat(setup_commands(plan))
    assert "ip -n lsw-lh addr add 10.77.0.4/24 dev lsw3" in cmds
    # 4 endpoints on the bridge, every link limited at both ends: the lighthouse's too
    assert sum(" master lswbr" in c for c in cmds) == 4
    assert sum(" tbf " in c for c in cmds) == 8
    assert any(c.startswith("ip netns exec lsw-lh tc qdisc add dev lsw3 ") for c in cmds)
    hosts = wan.hosts_file(plan).splitlines()
    assert "10.77.0.1 lsw-i0" in hosts and "10.77.0.4 lsw-lh" in hosts
    assert "127.0.0.1 localhost" in hosts


def test_elastic_islands_are_named_launches_that_meet_at_the_lighthouse(tmp_path: Path) -> None:
    plan = Plan(islands=3, rate="10mbit", lighthouse=True)
    cmd = wan.elastic_island_command(plan, 2, ["strategy.sync_every=5"], tmp_path, python="py")
    joined = " ".join(cmd)
    assert cmd[:4] == ["ip", "netns", "exec", "lsw-i2"]
    # its own host name, which every namespace's hosts file resolves to its veth address
    assert cmd[4:7] == ["unshare", "--uts", "sh"] and cmd[9] == "lsw-i2"
    assert "torch.distributed.run" not in joined  # one launch per island, no shared world
    assert "strategy.membership=torchft" in cmd and "strategy.island_id=i2" in cmd
    assert "strategy.lighthouse=http://10.77.0.4:29510" in cmd
    assert "trainer.num_nodes=1" in cmd and "GLOO_SOCKET_IFNAME=lsw2" in cmd
    assert cmd[-1] == "strategy.sync_every=5"
    lighthouse = " ".join(wan.lighthouse_command(plan, 5000, 120_000, python="py"))
    assert lighthouse.startswith("ip netns exec lsw-lh ")
    assert "--port 29510 --min-islands 2" in lighthouse
    assert "--heartbeat-timeout-ms 5000" in lighthouse


def test_full_commits_counts_rounds_committed_with_every_island() -> None:
    member = "QuorumMember { replica_id: x }"
    log = "\n".join(
        [
            f"got lighthouse quorum {member}, {member}",
            "should_commit=True enough_replicas=True",  # two islands of three: not full
            f"got lighthouse quorum {member}, {member}, {member}",
            "should_commit=False enough_replicas=True",
            f"got lighthouse quorum {member}, {member}, {member}",
            "should_commit=True enough_replicas=True",
        ]
    )
    assert wan.full_commits(log, 3) == 1
    assert wan.full_commits(log, 2) == 1


def test_busy_spans_are_the_transfers_at_half_the_rate_or_more() -> None:
    # 10 Mbit/s = 1.25 MB/s: 0.25 s samples of 312 KB are full rate, 1 KB is a heartbeat
    sent = [0, 312_500, 625_000, 626_000, 627_000, 627_000, 627_000, 939_500, 1_252_000]
    samples = [(0.25 * i, {"lsw0": (n, 0)}) for i, n in enumerate(sent)]
    spans = wan.busy_spans(samples, "lsw0", 10e6, gap_s=0.5)
    assert [(a, round(d, 2), n) for a, d, n in spans] == [
        (0.0, 0.5, 625_000),
        (1.5, 0.5, 625_000),
    ]
    assert wan.rate_bps("10mbit") == 10e6 and wan.rate_bps("512kbit") == 512e3
    with pytest.raises(ValueError, match="kbit, mbit or gbit"):
        wan.rate_bps("fast")


@pytest.mark.slow  # ~1 min on 2 busy cores: a lighthouse and three Lightning islands
@pytest.mark.skipif(_root_and_tools() is not None, reason="needs root, ip and tc")
def test_elastic_islands_over_10mbit_survive_a_kill_mid_transfer(tmp_path: Path) -> None:
    prefix = "lswe"
    if wan.probe_namespaces(prefix) is not None:
        pytest.skip("network namespaces cannot be made here")
    plan = Plan(islands=3, rate="10mbit", prefix=prefix, lighthouse=True, lighthouse_port=29591)
    # the default model (3.5 MB fp32 rounds: about 3 s of transfer each), a round every 5 steps
    overrides = [*wan.ELASTIC_OVERRIDES, "model.n_embd=128", "strategy.sync_every=5"]
    overrides.append("trainer.max_steps=40")
    result = wan.run_elastic(plan, overrides, tmp_path, timeout_s=420, kill_island=2)
    assert result["kill"] is not None and result["kill"]["after_full_rounds"] == 3
    # rounds of all three islands went over the full link, and none lost an island
    assert result["full_rounds_before_kill"] >= 2
    assert result["short_rounds_before_kill"] == []
    assert result["kill_to_next_commit_s"] is not None
    assert result["survivors_equal"]
    survivors = [i for i in result["islands"] if i["island"] != 2]
    assert all(i["rounds"][-1]["islands"] == 2 for i in survivors)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in names and not list(wan.NETNS_ETC.glob(f"{prefix}-*"))
