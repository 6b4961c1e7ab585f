"""Swarm checkpoint pieces without a Trainer: files, fingerprints, catch-up, mapped restore."""

from __future__ import annotations

import functools
import gc
import json
import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_swarm import SwarmStrategy
from lightning_swarm.algorithm.diloco import catch_up_
from lightning_swarm.algorithm.model_layout import model_layout
from lightning_swarm.config import AnchorConfig, SwarmConfig
from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.memory.procfs import ProcReader
from lightning_swarm.outer import OuterSync
from lightning_swarm.outer.sync_state import SyncState
from lightning_swarm.resume import FORMAT_VERSION, SwarmCheckpointer
from lightning_swarm.resume.atomic import atomic_save
from lightning_swarm.resume.compatibility import compare_fingerprints, layout_record
from lightning_swarm.resume.errors import IntegrityError
from lightning_swarm.resume.files import (
    MMAP_ENV,
    begin_save,
    claim_save,
    discard_save,
    load_swarm_file,
    prune_saves,
    remove_orphan_saves,
    require_local_path,
    resolve_mmap,
    warn_legacy,
)
from lightning_swarm.resume.outer_record import OuterCounters, OuterRecord, PendingRound
from lightning_swarm.resume.records import AnchorsRecord, OptionsRecord, RecordError, SwarmRecord
from lightning_swarm.resume.restore import check_outer_states
from lightning_swarm.resume.training_view import TrainingView
from tests.transport_rounds import NamedRound

OUTER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


class OneIsland(NamedRound):
    """A transport for a single island: the average of one contribution is itself."""


def _params(seed: int = 0, meta: bool = False) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (4, 3), "b": (3,)}
    device = "meta" if meta else "cpu"
    return {
        k: torch.nn.Parameter(torch.randn(*s, generator=g).to(device)) for k, s in shapes.items()
    }


def _outer(params: Mapping[str, torch.nn.Parameter], **kw: object) -> OuterSync:
    return OuterSync(params, outer_optimizer=OUTER, transport=OneIsland(), sync_every=2, **kw)  # type: ignore[arg-type]


def _trained_outer(dtype: torch.dtype = torch.float32) -> tuple[OuterSync, dict[str, Tensor]]:
    params = _params()
    outer = _outer(params, anchor_dtype=dtype)
    with torch.no_grad():
        for step in range(5):  # two syncs (momentum exists) and one step past the second
            for p in params.values():
                p.add_(0.01 * (step + 1))
            outer.on_inner_step()
    return outer, params


def _payload(outer: OuterSync) -> dict[str, object]:
    return {"format": FORMAT_VERSION, "save_id": "s", "outer": [outer.state_dict()]}


# -- OuterSync round trip ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mmap", [True, False])
def test_outer_state_round_trip_continues_identically(
    tmp_path: Path, dtype: torch.dtype, mmap: bool
) -> None:
    outer, params = _trained_outer(dtype)
    atomic_save(_payload(outer), tmp_path / "anchors.pt")
    payload, legacy = load_swarm_file(tmp_path / "anchors.pt", mmap=mmap)
    assert not legacy
    twin_params = {k: torch.nn.Parameter(p.detach().clone()) for k, p in params.items()}
    twin = _outer(twin_params, anchor_dtype=dtype, defer_anchors=True)
    assert all(a.device.type == "meta" for a in twin.anchors.values())  # placeholders
    twin.load_state_dict(payload["outer"][0])
    assert all(a.device.type == "cpu" for a in twin.anchors.values())
    assert (twin.inner_steps, twin.outer_steps) == (5, 2)
    for name in params:
        assert twin.anchors[name].dtype == dtype
        assert torch.equal(twin.anchors[name], outer.anchors[name])
    # one more round on both: bitwise the same trajectory (momentum restored too)
    with torch.no_grad():
        for p, q in zip(params.values(), twin_params.values(), strict=True):
            p.add_(0.3)
            q.add_(0.3)
    outer.on_inner_step()
    twin.on_inner_step()
    for name in params:
        assert torch.equal(twin.anchors[name], outer.anchors[name])
        assert torch.equal(twin_params[name], params[name])


def test_resume_converts_file_dtype_to_configured_anchor_dtype(tmp_path: Path) -> None:
    outer, params = _trained_outer(torch.float32)
    atomic_save(_payload(outer), tmp_path / "anchors.pt")
    payload, _ = load_swarm_file(tmp_path / "anchors.pt", mmap=True)
    twin = _outer(params, anchor_dtype=torch.bfloat16, defer_anchors=True)
    twin.load_state_dict(payload["outer"][0])
    for name in params:
        assert twin.anchors[name].dtype == torch.bfloat16
        assert torch.equal(twin.anchors[name], outer.anchors[name].to(torch.bfloat16))


def test_sync_on_deferred_placeholders_fails_loudly() -> None:
    outer = _outer(_params(), defer_anchors=True)
    outer.on_inner_step()  # _outer syncs every 2 inner steps: the second one starts a round
    with pytest.raises(RuntimeError, match="anchors are still placeholders.*load_state_dict"):
        outer.on_inner_step()


def test_outer_load_rejects_wrong_anchor_shape() -> None:
    outer, params = _trained_outer()
    state = outer.state_dict()
    state["anchors"] = {**state["anchors"], "w": torch.zeros(3, 4)}
    twin = _outer(params, defer_anchors=True)
    with pytest.raises(ValueError, match=r"parameter 'w' \(shape \(4, 3\)\) has shape \(3, 4\)"):
        twin.load_state_dict(state)


def _host(*outers: OuterSync) -> TrainingView:
    return SimpleNamespace(outer_syncs=list(outers))  # type: ignore[return-value]


def _anchors_record(*states: dict[str, Any]) -> AnchorsRecord:
    return AnchorsRecord(save_id="s", outer=[OuterRecord.from_dict(s) for s in states])


def test_resume_check_names_the_file_and_each_refusal() -> None:
    outer, params = _trained_outer()
    twin = _outer(params, defer_anchors=True)
    state = outer.state_dict()
    check_outer_states(_host(twin), _anchors_record(state), "/x/anchors.pt")  # fits
    no_b = {**state, "anchors": {"w": state["anchors"]["w"]}}
    with pytest.raises(
        SwarmCheckpointError, match=r"^/x/anchors.pt: parameter 'b' \(shape \(3,\)\) has no anchor"
    ):
        check_outer_states(_host(twin), _anchors_record(no_b), "/x/anchors.pt")
    pending = {"fragment": 0, "send_step": 4, "deltas": {}, "applied": True, "norm": 0.0}
    pending |= {"bytes_sent": 0, "bytes_received": 0, "transport_s": 0.0}
    in_flight = {**state, "pending": pending}
    with pytest.raises(
        SwarmCheckpointError,
        match=r"^/x/anchors.pt: the checkpoint has fragment 0 in flight at inner step 5 but this "
        r"run's schedule expects None",
    ):
        check_outer_states(_host(twin), _anchors_record(in_flight), "/x/anchors.pt")
    # The catch-up's older anchors: only their shapes matter.
    check_outer_states(_host(twin), _anchors_record(in_flight), "/x/a.pt", anchors_only=True)
    with pytest.raises(SwarmCheckpointError, match=r"^/x/a.pt \(optimizer 1\): parameter 'b'"):
        check_outer_states(_host(twin, twin), _anchors_record(state, no_b), "/x/a.pt")
    with pytest.raises(SwarmCheckpointError, match="/x/a.pt holds 1 anchor sets for 2 optimizers"):
        check_outer_states(_host(twin, twin), _anchors_record(state), "/x/a.pt")


def test_load_checks_once_and_a_checked_install_checks_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outer, params = _trained_outer()
    calls: list[int] = []
    check = SyncState.check_state_dict

    def counted(self: SyncState, state: Mapping[str, Any]) -> None:
        calls.append(1)
        check(self, state)

    monkeypatch.setattr(SyncState, "check_state_dict", counted)
    _outer(params, defer_anchors=True).load_state_dict(outer.state_dict())
    assert len(calls) == 1
    _outer(params, defer_anchors=True).load_checked_state_dict(outer.state_dict())
    assert len(calls) == 1


def test_outer_record_round_trips_and_keeps_the_saved_layout() -> None:
    outer, _ = _trained_outer()
    state = outer.state_dict()
    # The layout of format 3, key for key: checkpoints written before the record still load.
    assert list(state) == [
        "anchors",
        "outer_optimizer",
        "inner_steps",
        "outer_steps",
        "fragment_rounds",
        "pending",
        "synced_at",
        "ended_at",
        "merged_at",
        "layout",
    ]
    assert state["layout"]["w"] == [[4, 3], "float32", [0, 0], [4, 3]]
    record = OuterRecord.from_dict(state)
    assert record.to_dict() == state
    assert OuterRecord.from_dict(record.to_dict()) == record
    pending = PendingRound(1, 6, {"w": torch.ones(4, 3)}, True, 2.0, 3, 4, 0.5, share_norm=True)
    sharded = OuterRecord(
        anchors={"w": torch.zeros(4, 3)},
        outer_optimizer={"state": {}, "param_groups": []},
        counters=OuterCounters(6, 3, [2, 1], [None, 4], 4, [6, None]),
        pending=pending,
        param_names=["w"],
        share=(1, 2),
    )
    assert sharded.to_dict()["pending"]["share_norm"] is True
    assert sharded.to_dict()["share"] == [1, 2]
    assert OuterRecord.from_dict(sharded.to_dict()) == sharded


def test_a_checkpoint_dict_of_todays_form_loads() -> None:
    outer, params = _trained_outer()
    saved: dict[str, Any] = {
        "anchors": {k: a.clone() for k, a in outer.anchors.items()},
        "outer_optimizer": outer.outer_optimizer.state_dict(),
        "inner_steps": 5,
        "outer_steps": 2,
        "fragment_rounds": [2],
        "pending": None,
        "synced_at": [None],
        "ended_at": None,
        "merged_at": [None],
    }
    payload = {"format": FORMAT_VERSION, "save_id": "s", "outer": [saved]}
    record = AnchorsRecord.from_dict(payload, "anchors.pt")
    assert record.to_dict() == payload
    twin = _outer(params, defer_anchors=True)
    twin.load_state_dict(record.outer[0])
    assert (twin.inner_steps, twin.outer_steps, twin.fragment_rounds) == (5, 2, [2])
    for name in params:
        assert torch.equal(twin.anchors[name], outer.anchors[name])
    # Saves older than the per-fragment counters lack them: in sync unknown, fit never ended.
    old = {k: v for k, v in saved.items() if k not in ("fragment_rounds", "synced_at", "ended_at")}
    twin.load_state_dict({**old, "merged_at": [3]})
    assert (twin.fragment_rounds, twin.synced_at, twin.ended_at) == ([0], [None], None)
    assert twin.merged_at == [3]
    del old["merged_at"]  # and those older than the merge mark: merged at an unknown step
    twin.load_state_dict(old)
    assert twin.merged_at == [None]


# -- catch-up ---------------------------------------------------------------------------------
def test_catch_up_against_hand_computed_values() -> None:
    local = torch.tensor([1.0, 2.0, -3.0])
    anchor_old = torch.tensor([0.5, 0.5, -1.0])
    global_new = torch.tensor([2.0, 3.0, 0.25])
    catch_up_(local, anchor_old, global_new)
    # global_new + (local - anchor_old) = [2 + 0.5, 3 + 1.5, 0.25 - 2]
    assert torch.equal(local, torch.tensor([2.5, 4.5, -1.75]))
    assert torch.equal(anchor_old, torch.tensor([0.5, 0.5, -1.0]))


def test_catch_up_with_bfloat16_anchors_computes_in_float32() -> None:
    local = torch.tensor([1.0 + 2**-12])
    anchor_old = torch.tensor([1.0], dtype=torch.bfloat16)
    global_new = torch.tensor([4.0], dtype=torch.bfloat16)
    catch_up_(local, anchor_old, global_new)
    assert local.item() == 4.0 + 2**-12  # the small progress survives the rebase


def test_catch_up_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="catch-up needs one shape"):
        catch_up_(torch.zeros(2), torch.zeros(3), torch.zeros(2))


# -- fingerprint ------------------------------------------------------------------------------
def _fp(num_islands: int = 2, fragments: object = None, **shapes: tuple[int, ...]) -> dict:
    shapes = shapes or {"w": (4, 3), "b": (3,)}
    params = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    return layout_record(num_islands, [model_layout(params)], fragments)


def test_matching_fingerprints_pass() -> None:
    compare_fingerprints(_fp(), _fp())
    compare_fingerprints(_fp(), _fp(num_islands=3))  # another island count reshards


@pytest.mark.parametrize(
    ("current", "message"),
    [
        (_fp(w=(4, 3), bias=(3,)), r"only in checkpoint \['b'\], only in this run \['bias'\]"),
        (_fp(w=(4, 4), b=(3,)), r"parameter 'w' reshaped: checkpoint \[4, 3\], this run \[4, 4\]"),
        (_fp(fragments=[["w"], ["b"]]), r"fragment layout: checkpoint has None"),
    ],
)
def test_fingerprint_mismatch_names_the_difference(current: dict, message: str) -> None:
    with pytest.raises(SwarmCheckpointError, match=message):
        compare_fingerprints(_fp(), current)


def test_fingerprint_counts_optimizers() -> None:
    saved = _fp()
    current = {**saved, "params": saved["params"] * 2}
    with pytest.raises(SwarmCheckpointError, match="optimizers: checkpoint has 1, this run has 2"):
        compare_fingerprints(saved, current)


# -- files ------------------------------------------------------------------------------------
def test_missing_file_says_incomplete(tmp_path: Path) -> None:
    with pytest.raises(SwarmCheckpointError, match="is missing; the checkpoint is incomplete"):
        load_swarm_file(tmp_path / "anchors.pt", mmap=True)


@pytest.mark.parametrize("mmap", [True, False])
def test_truncated_file_is_reported(tmp_path: Path, mmap: bool) -> None:
    outer, _ = _trained_outer()
    path = tmp_path / "anchors.pt"
    atomic_save(_payload(outer), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SwarmCheckpointError, match="is truncated or corrupt"):
        load_swarm_file(path, mmap=mmap)


def test_corrupt_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "anchors.pt"
    path.write_bytes(b"PK\x03\x04" + os.urandom(4096))
    with pytest.raises(SwarmCheckpointError, match="is truncated or corrupt"):
        load_swarm_file(path, mmap=True)


class _Note:
    """A plain Python object: not on torch's weights_only allowlist."""

    def __init__(self, text: str = "") -> None:
        self.text = text


class _NotedLinear(torch.nn.Linear):
    def get_extra_state(self) -> _Note:
        return _Note("extra")

    def set_extra_state(self, state: object) -> None:
        assert isinstance(state, _Note)


def _island_payload(where: str) -> dict[str, object]:
    """What an island file holds (module and optimizer state), with one object not allowed."""
    module = _NotedLinear(3, 2) if where == "extra_state" else torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    if where == "optimizer":
        optimizer.state[module.weight]["note"] = _Note("custom optimizer state")
    return {
        "format": FORMAT_VERSION,
        "module": module.state_dict(),
        "optimizers": [optimizer.state_dict()],
    }


@pytest.mark.parametrize("where", ["extra_state", "optimizer"])
def test_disallowed_object_is_not_reported_as_corruption(tmp_path: Path, where: str) -> None:
    path = tmp_path / "island-00000.pt"
    atomic_save(_island_payload(where), path)
    with pytest.raises(SwarmCheckpointError) as caught:
        load_swarm_file(path, mmap=True)
    message = str(caught.value)
    assert "truncated or corrupt" not in message
    name = f"{__name__}._Note"
    refusal = "is readable, but torch.load(weights_only=True) refuses to unpickle an object"
    assert f"{refusal} of type {name}" in message
    assert "get_extra_state()" in message and "optimizer's state" in message
    assert f"torch.serialization.add_safe_globals([{name}])" in message
    with torch.serialization.safe_globals([_Note]):  # the fix the message names works
        payload, _ = load_swarm_file(path, mmap=True)
    assert payload["format"] == FORMAT_VERSION


def test_foreign_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "anchors.pt"
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(SwarmCheckpointError, match="is not a lightning_swarm state file"):
        load_swarm_file(path, mmap=True)


def test_legacy_format_is_read_eagerly_with_one_warning(tmp_path: Path) -> None:
    outer, _ = _trained_outer()
    paths = [tmp_path / "anchors.pt", tmp_path / "island-00000.pt"]
    for path in paths:
        torch.save(_payload(outer), path, _use_new_zipfile_serialization=False)
    with pytest.raises(RuntimeError, match="mmap can only be used"):
        torch.load(paths[0], mmap=True, weights_only=True)  # why the fallback exists
    loaded = [load_swarm_file(p, mmap=True) for p in paths]
    assert all(legacy for _, legacy in loaded)
    anchors = loaded[0][0]["outer"][0]["anchors"]
    assert torch.equal(anchors["w"], outer.anchors["w"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_legacy([p for p, (_, legacy) in zip(paths, loaded, strict=True) if legacy])
    assert len(caught) == 1
    assert "legacy (non-zipfile) format" in str(caught[0].message)
    assert all(str(p) in str(caught[0].message) for p in paths)


def test_atomic_save_keeps_previous_file_when_the_write_fails(tmp_path: Path) -> None:
    path = tmp_path / "anchors.pt"
    atomic_save({"format": FORMAT_VERSION, "value": torch.ones(3)}, path)
    with pytest.raises(Exception, match="Can't (pickle|get local object)"):
        atomic_save({"format": FORMAT_VERSION, "bad": lambda: None}, path)
    payload, _ = load_swarm_file(path, mmap=True)
    assert torch.equal(payload["value"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anchors.pt"]


def test_prune_keeps_only_the_named_save(tmp_path: Path) -> None:
    for name in ("old", "new", "orphan"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "anchors.pt").write_bytes(b"x")
    prune_saves(tmp_path, keep="new")
    assert [p.name for p in tmp_path.iterdir()] == ["new"]


def _swarm_dir(folder: Path, name: str, *files: str) -> Path:
    save = folder / name / "0123456789ab"
    save.mkdir(parents=True)
    for f in files:
        (save / f).write_bytes(b"x")
    return folder / name


def test_orphan_swarm_directories_are_removed_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "named.ckpt").write_bytes(b"x")
    named = _swarm_dir(tmp_path, "named.ckpt.swarm", "anchors.pt")
    orphan = _swarm_dir(tmp_path, "step=6.ckpt.swarm", "anchors.pt", "island-00001.pt")
    half = _swarm_dir(tmp_path, "step=7.ckpt.swarm", ".island-00000.pt.tmp-4242")
    current = _swarm_dir(tmp_path, "now.ckpt.swarm", "anchors.pt")  # its .ckpt comes next
    foreign = _swarm_dir(tmp_path, "notes.swarm", "anchors.pt", "README.txt")
    (tmp_path / "last.ckpt").symlink_to(tmp_path / "gone.ckpt")  # dangling, still a name
    linked = _swarm_dir(tmp_path, "last.ckpt.swarm", "anchors.pt")
    removed = remove_orphan_saves(tmp_path, keep=current)
    assert sorted(p.name for p in removed) == [orphan.name, half.name]
    assert not orphan.exists() and not half.exists()
    assert all(p.is_dir() for p in (named, current, foreign, linked))
    assert remove_orphan_saves(tmp_path / "missing", keep=current) == []


def test_another_process_save_in_progress_is_never_taken_for_an_orphan(tmp_path: Path) -> None:
    """Elastic islands sharing a dirpath: island b's save, whose Lightning file is still to
    come, survives island a's pruning while b's writer lives; it goes once b is known dead."""
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = _swarm_dir(tmp_path, "b-step=6.ckpt.swarm", "anchors.pt", "island-00000.pt")
        (theirs / "0123456789ab.writing").write_text(
            json.dumps({"host": socket.gethostname(), "pid": writer.pid})
        )
        mine = tmp_path / "a-step=6.ckpt.swarm"
        save_id = begin_save(mine)
        assert (mine / f"{save_id}.writing").is_file()
        assert (theirs / "0123456789ab" / "anchors.pt").is_file(), "b's save was removed"
    finally:
        writer.kill()
        writer.wait()
    # b's writer died before its Lightning file: now the directory is an interrupted save.
    assert remove_orphan_saves(tmp_path, keep=mine) == [theirs]
    assert not theirs.exists()
    # a's own save completes: pruning drops its claim with the older saves.
    (mine / save_id).mkdir()
    prune_saves(mine, keep=save_id)
    assert [p.name for p in mine.iterdir()] == [save_id]


def test_claims_from_other_hosts_or_unreadable_keep_their_save(tmp_path: Path) -> None:
    remote = _swarm_dir(tmp_path, "remote.ckpt.swarm", "anchors.pt")
    (remote / "0123456789ab.writing").write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    garbled = _swarm_dir(tmp_path, "garbled.ckpt.swarm", "anchors.pt")
    (garbled / "0123456789ab.writing").write_text("{not json")
    ours = tmp_path / "now.ckpt.swarm"
    assert remove_orphan_saves(tmp_path, keep=ours) == []
    assert remote.is_dir() and garbled.is_dir()


def test_a_discarded_save_leaves_no_claim(tmp_path: Path) -> None:
    root = tmp_path / "x.ckpt.swarm"
    claim = claim_save(root, "abc")
    assert json.loads(claim.read_text())["pid"] == os.getpid()
    (root / "abc").mkdir()
    discard_save(root, "abc")
    assert not root.exists()


def test_remote_paths_are_rejected() -> None:
    with pytest.raises(SwarmCheckpointError, match=r"'s3://bucket/x.ckpt' is not a local path"):
        require_local_path("s3://bucket/x.ckpt", what="checkpoint path")
    assert require_local_path("file:///tmp/x.ckpt", what="x") == Path("/tmp/x.ckpt")


# -- options ----------------------------------------------------------------------------------
def test_mmap_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MMAP_ENV, raising=False)
    assert resolve_mmap(True) == (True, "memory-mapped")
    assert resolve_mmap(False) == (False, "eager read (anchors.mmap=false)")
    monkeypatch.setenv(MMAP_ENV, "0")
    assert resolve_mmap(True) == (False, f"eager read ({MMAP_ENV}=0)")
    monkeypatch.setenv(MMAP_ENV, "1")
    assert resolve_mmap(True)[0] and not resolve_mmap(False)[0]
    monkeypatch.setenv(MMAP_ENV, "maybe")
    with pytest.raises(ValueError, match=f"{MMAP_ENV}='maybe' is not understood; set it to 0"):
        resolve_mmap(True)


def test_anchor_config_forms() -> None:
    assert SwarmConfig(anchors={"mmap": False}).anchors == AnchorConfig(mmap=False)
    assert SwarmConfig().anchors.mmap is True
    assert SwarmStrategy(anchors={"mmap": False}).config.anchors.mmap is False
    assert SwarmStrategy(anchors=AnchorConfig(mmap=False)).config.anchors.mmap is False
    with pytest.raises(
        ValueError, match=r"anchors has unknown keys \['map'\]; known keys: \['mmap', 'verify'\]"
    ):
        SwarmConfig(anchors={"map": False})
    with pytest.raises(ValueError, match="anchors.mmap must be true or false, got 'no'"):
        SwarmConfig(anchors={"mmap": "no"})
    with pytest.raises(ValueError, match="anchors.verify must be true or false, got 1"):
        SwarmConfig(anchors={"verify": 1})
    assert SwarmConfig().anchors.verify is True
    assert SwarmStrategy(anchors={"verify": False}).config.anchors.verify is False
    with pytest.raises(
        TypeError, match="anchors must be a dict such as .* or an instance of AnchorConfig"
    ):
        SwarmConfig(anchors=True)  # type: ignore[arg-type]


# -- checkpointer -----------------------------------------------------------------------------
_RECORD = SwarmRecord(
    save_id="abc",
    fingerprint={},
    anchor_dtype=None,
    outer_steps=[1],
    inner_steps=[3],
    files={},
    options=OptionsRecord(values=SwarmConfig().resume_options()),
).to_dict()


def test_plain_lightning_checkpoint_warns_and_keeps_fresh_anchors() -> None:
    checkpointer = SwarmCheckpointer()
    with pytest.warns(UserWarning, match="holds no swarm state .* anchors start fresh"):
        checkpointer.capture("/tmp/plain.ckpt", {"state_dict": {}}, rank=0)
    assert not checkpointer.pending


def test_a_new_fit_forgets_a_checkpoint_captured_by_an_earlier_one() -> None:
    """A fit that failed between capture and restore must not leave its checkpoint pending."""
    checkpointer = SwarmCheckpointer()
    checkpointer.capture("/tmp/x.ckpt", {"swarm": _RECORD}, rank=0)
    assert checkpointer.defer_anchors(resuming=True)
    assert not checkpointer.defer_anchors(resuming=False)  # the next fit has no ckpt_path
    assert not checkpointer.pending


@pytest.mark.parametrize(
    ("found", "said"),
    [
        (1, "is of format 1"),
        (2, "is of format 2"),
        (99, "is of format 99"),
        ("3", "is of format '3'"),
        (True, "is of format True"),
        (None, "has no format number"),
    ],
)
def test_a_swarm_record_of_another_format_is_refused(found: object, said: str) -> None:
    """Only format 3 is read; the message names what was found and the two ways out."""
    record = {**_RECORD, "format": found}
    if found is None:
        del record["format"]
    with pytest.raises(RecordError) as info:
        SwarmCheckpointer().capture("/tmp/x.ckpt", {"swarm": record}, rank=0)
    assert str(info.value) == (
        f"the swarm record of /tmp/x.ckpt {said}, but this lightning_swarm reads format 3 only "
        "(the formats before it were never released and are no longer read). To use it, "
        "resume with the lightning_swarm version that wrote it, or start fresh (fit without "
        "ckpt_path)."
    )


def test_a_swarm_record_that_is_not_a_dict_is_refused() -> None:
    with pytest.raises(RecordError, match=r"x.ckpt is a list, not a lightning_swarm record, but"):
        SwarmCheckpointer().capture("/tmp/x.ckpt", {"swarm": [3]}, rank=0)


def test_the_record_of_format_3_is_captured_and_sealed() -> None:
    checkpointer = SwarmCheckpointer()
    checkpointer.capture("/tmp/x.ckpt", {"swarm": _RECORD}, rank=0)
    assert checkpointer.pending
    with pytest.raises(RecordError, match="was changed after it was written"):
        checkpointer.capture("/tmp/x.ckpt", {"swarm": {**_RECORD, "outer_steps": [2]}}, rank=0)


# -- mapped restore: anonymous memory -----------------------------------------------------------
def _anonymous() -> int:
    rollup = ProcReader().smaps_rollup()
    if rollup is None:
        pytest.skip("/proc/self/smaps_rollup is not readable here")
    return rollup["Anonymous"]


def _restore_anchor_growth(path: Path, mmap: bool) -> tuple[int, OuterSync]:
    """Anonymous bytes added by loading ``path`` and installing it into a deferred OuterSync."""
    params = {"w": torch.nn.Parameter(torch.empty(64, 2**20, device="meta"))}
    outer = _outer(params, defer_anchors=True)
    gc.collect()
    before = _anonymous()
    payload, _ = load_swarm_file(path, mmap=mmap)
    outer.load_state_dict(payload["outer"][0])
    del payload
    return _anonymous() - before, outer


def test_mapped_anchors_stay_out_of_anonymous_memory(tmp_path: Path) -> None:
    anchor_bytes = 64 * 2**20 * 4  # 256 MiB of float32 anchors
    path = tmp_path / "anchors.pt"
    anchors = {"w": torch.full((64, 2**20), 0.5)}
    state = {"anchors": anchors, "outer_optimizer": _outer_state(), "inner_steps": 7}
    atomic_save({"format": FORMAT_VERSION, "outer": [{**state, "outer_steps": 3}]}, path)
    del anchors, state
    gc.collect()
    mapped, outer = _restore_anchor_growth(path, mmap=True)
    assert torch.equal(outer.anchors["w"][-1, -4:], torch.full((4,), 0.5))
    del outer
    gc.collect()
    eager, outer = _restore_anchor_growth(path, mmap=False)
    del outer
    assert mapped < 0.05 * anchor_bytes, f"mapped restore added {mapped / 2**20:.1f} MiB"
    assert eager > 0.9 * anchor_bytes, f"eager restore added only {eager / 2**20:.1f} MiB"


def _outer_state() -> dict[str, object]:
    meta = {"w": torch.nn.Parameter(torch.empty(1, device="meta"))}
    return _outer(meta, defer_anchors=True).outer_optimizer.state_dict()


# -- integrity ----------------------------------------------------------------------------------
def test_file_digest_reads_in_chunks_and_sees_one_flipped_bit(tmp_path: Path) -> None:
    from lightning_swarm.resume.integrity import check_file, file_digest

    path = tmp_path / "anchors.pt"
    path.write_bytes(os.urandom(3 * 1000 + 7))
    whole = file_digest(path)
    assert file_digest(path, chunk_bytes=1000) == whole  # chunk edges change nothing
    assert whole.num_bytes == 3007
    check_file(path, whole, verify=True)
    data = bytearray(path.read_bytes())
    data[1500] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=rf"{path}: checksum mismatch"):
        check_file(path, whole, verify=True)
    check_file(path, whole, verify=False)  # the switch skips the read
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(
        IntegrityError, match=r"is truncated or corrupt \(100 bytes, its checkpoint"
    ):
        check_file(path, whole, verify=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_found_and_named(
    tmp_path: Path, dtype: torch.dtype, bad: float
) -> None:
    from lightning_swarm.resume.integrity import check_finite

    big = torch.zeros(2**22 + 5, dtype=dtype)  # past one scan chunk
    tensors = {"a": torch.ones(3, dtype=dtype), "b": big, "step": torch.tensor(3)}
    check_finite(tensors, source=tmp_path, what="x")
    big[-1] = bad  # in the last, partial chunk
    with pytest.raises(SwarmCheckpointError, match=rf"non-finite values in {tmp_path}: b \(x"):
        check_finite(tensors, source=tmp_path, what="x")
