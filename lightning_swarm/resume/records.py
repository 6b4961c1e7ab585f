"""Typed records of a swarm checkpoint: what each owner hands over, and the format version.
Only ``FORMAT_VERSION`` is read. ``SwarmRecord`` is sealed by ``record_checksum`` and repeats
Lightning's step counters, so a Lightning file saved at another step is refused."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Protocol

import xxhash

from lightning_swarm.algorithm.outer_optimizer import merge_by_name
from lightning_swarm.config import RESUME_OPTIONS
from lightning_swarm.errors import SwarmCheckpointError
from lightning_swarm.resume.errors import RecordError
from lightning_swarm.resume.outer_record import OuterRecord

FORMAT_VERSION = 3
DIGEST_ALGORITHM = "xxh3_128"
_CHECKSUM = "checksum"
_ISLAND_LOOPS = "island_loops"


def check_format(payload: object, what: str) -> dict[str, Any]:
    """``payload`` as a dict if it is a record of ``FORMAT_VERSION``, else ``RecordError``."""
    if isinstance(payload, dict):
        found = payload.get("format")
        # type() and not isinstance(): True, 3.0 or "3" are not the format number 3.
        if type(found) is int and found == FORMAT_VERSION:
            return payload
        state = "has no format number" if found is None else f"is of format {found!r}"
    else:
        state = f"is a {type(payload).__name__}, not a lightning_swarm record"
    raise RecordError(
        f"{what} {state}, but this lightning_swarm reads format {FORMAT_VERSION} only (the "
        "formats before it were never released and are no longer read). To use it, resume with "
        "the lightning_swarm version that wrote it, or start fresh (fit without ckpt_path)."
    )


@dataclass(frozen=True)
class FileDigest:
    """Size and checksum of one swarm file, as written."""

    num_bytes: int
    digest: str

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.num_bytes, DIGEST_ALGORITHM: self.digest}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FileDigest:
        return cls(int(data["bytes"]), str(data[DIGEST_ALGORITHM]))


@dataclass(frozen=True)
class OptionsRecord:
    """The options that shape the outer loop, as the saving run had them: ``values`` holds
    ``SwarmConfig.resume_options()``; per outer optimizer, its class name and its first param
    group's plain-valued entries."""

    values: dict[str, Any]
    outer_optimizer: list[str] = field(default_factory=list)
    outer_hyperparameters: list[dict[str, Any]] = field(default_factory=list)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.values,
            "outer_optimizer": list(self.outer_optimizer),
            "outer_hyperparameters": [dict(h) for h in self.outer_hyperparameters],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OptionsRecord:
        return cls(
            values={name: data[name] for name in RESUME_OPTIONS},
            outer_optimizer=list(data["outer_optimizer"]),
            outer_hyperparameters=list(data["outer_hyperparameters"]),
        )


@dataclass(frozen=True)
class SwarmRecord:
    """``ckpt["swarm"]``: names the save, describes the run, and checks every file of it. A
    counter is ``None`` where Lightning saved none (not compared then); ``island_loops`` is
    ``None`` (no key) unless the islands stepped at their own pace."""

    save_id: str
    fingerprint: dict[str, Any]
    anchor_dtype: str | None
    outer_steps: list[int]
    inner_steps: list[int]
    files: dict[str, FileDigest]
    options: OptionsRecord
    global_step: int | None = None
    optimizer_steps: int | None = None
    island_loops: list[IslandLoops] | None = None

    def to_dict(self) -> dict[str, Any]:
        body = {
            "format": FORMAT_VERSION,
            "save_id": self.save_id,
            "fingerprint": self.fingerprint,
            "anchor_dtype": self.anchor_dtype,
            "outer_steps": list(self.outer_steps),
            "inner_steps": list(self.inner_steps),
            "files": {name: d.to_dict() for name, d in self.files.items()},
            "options": self.options.to_dict(),
            "global_step": self.global_step,
            "optimizer_steps": self.optimizer_steps,
        }
        if self.island_loops is not None:
            body[_ISLAND_LOOPS] = [loops.to_dict() for loops in self.island_loops]
        body[_CHECKSUM] = record_checksum(body)
        return body

    @classmethod
    def of(cls, checkpoint: object, what: str) -> SwarmRecord | None:
        """The record in a loaded Lightning checkpoint, or None (a plain Lightning one)."""
        payload = checkpoint.get("swarm") if isinstance(checkpoint, dict) else None
        return None if payload is None else cls.from_dict(payload, what)

    @classmethod
    def from_dict(cls, payload: object, what: str) -> SwarmRecord:
        """Parse a saved record; ``RecordError`` for another format or a broken seal."""
        data = check_format(payload, what)
        found, expected = data.get(_CHECKSUM), record_checksum(data)
        if found != expected:
            state = "has no checksum" if found is None else f"checksum {found} != {expected}"
            raise RecordError(
                f"{what} was changed after it was written ({state}): one of its fields, such as "
                "the round or step counters, no longer holds what the save wrote. Resume from "
                "another checkpoint."
            )
        steps = data["global_step"], data["optimizer_steps"]
        loops = data.get(_ISLAND_LOOPS)
        return cls(
            save_id=str(data["save_id"]),
            fingerprint=dict(data["fingerprint"]),
            anchor_dtype=data["anchor_dtype"],
            outer_steps=[int(s) for s in data["outer_steps"]],
            inner_steps=[int(s) for s in data["inner_steps"]],
            files={str(n): FileDigest.from_dict(d) for n, d in data["files"].items()},
            options=OptionsRecord.from_dict(data["options"]),
            global_step=None if steps[0] is None else int(steps[0]),
            optimizer_steps=None if steps[1] is None else int(steps[1]),
            island_loops=None if loops is None else [IslandLoops.from_dict(x) for x in loops],
        )


def record_checksum(body: Mapping[str, Any]) -> str:
    """XXH3-128 of the record's fields (all but the checksum) as canonical JSON."""
    fields = {k: v for k, v in body.items() if k != _CHECKSUM}
    if _ISLAND_LOOPS in fields:
        # Lightning's loop state may hold a dataloader's own state, whose keys need not all be
        # strings (JSON cannot sort mixed keys); the stored value keeps its keys as they were.
        fields[_ISLAND_LOOPS] = _text_keys(fields[_ISLAND_LOOPS])
    text = json.dumps(fields, sort_keys=True, default=str, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(text.encode())


def _text_keys(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _text_keys(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_text_keys(v) for v in value]
    return value


@dataclass(frozen=True)
class AnchorsRecord:
    """``anchors.pt`` (or one shard per rank of island 0): one ``OuterRecord`` per optimizer."""

    save_id: str
    outer: list[OuterRecord]

    def to_dict(self) -> dict[str, Any]:
        outer = [record.to_dict() for record in self.outer]
        return {"format": FORMAT_VERSION, "save_id": self.save_id, "outer": outer}

    @classmethod
    def from_dict(cls, payload: object, what: str) -> AnchorsRecord:
        data = check_format(payload, what)
        try:
            outer = [OuterRecord.from_dict(state) for state in data["outer"]]
        except (KeyError, TypeError, ValueError) as err:
            raise RecordError(f"{what} holds a damaged outer state ({err!r})") from err
        return cls(save_id=str(data.get("save_id")), outer=outer)


class Totals(Protocol):
    """The running totals a strategy keeps of its outer syncs (``SwarmTotals``)."""

    outer_steps: int
    bytes_sent: int
    bytes_received: int
    sync_wall_s: float


@dataclass(frozen=True)
class TotalsRecord:
    outer_steps: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    sync_wall_s: float = 0.0

    @classmethod
    def of(cls, totals: Totals) -> TotalsRecord:
        return cls(**{f.name: getattr(totals, f.name) for f in fields(cls)})

    def install(self, totals: Totals) -> None:
        for f in fields(self):
            setattr(totals, f.name, getattr(self, f.name))


@dataclass(frozen=True)
class IslandRecord:
    """``island-NNNNN.pt``: one island's own state (differs between islands between syncs)."""

    save_id: str
    island: int
    module: dict[str, Any]
    optimizers: list[dict[str, Any]]
    totals: TotalsRecord
    outer_island: list[dict[str, Any]]
    # Per-rank files (model-sharded islands): the slice of each ``module`` tensor this rank
    # holds (``algorithm.model_layout``, plain lists); None for whole tensors or older saves.
    module_layout: dict[str, list[Any]] | None = None
    # Per inner optimizer, the module's name of each parameter in its state's order (what a
    # resume onto another layout slices the state by); None in older saves.
    optimizer_params: list[list[str]] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "format": FORMAT_VERSION,
            "save_id": self.save_id,
            "island": self.island,
            "module": self.module,
            "optimizers": self.optimizers,
            "totals": asdict(self.totals),
            # Error-feedback residuals differ per island, like the inner optimizer state.
            "outer_island": self.outer_island,
        }
        if self.module_layout is not None:
            out["module_layout"] = self.module_layout
        if self.optimizer_params is not None:
            out["optimizer_params"] = self.optimizer_params
        return out

    @classmethod
    def from_dict(cls, payload: object, what: str) -> IslandRecord:
        data = check_format(payload, what)
        totals = data.get("totals") or {}
        known = TotalsRecord.__dataclass_fields__
        return cls(
            save_id=str(data.get("save_id")),
            island=int(data["island"]),
            module=dict(data["module"]),
            optimizers=list(data["optimizers"]),
            totals=TotalsRecord(**{k: v for k, v in totals.items() if k in known}),
            outer_island=list(data.get("outer_island", [])),
            module_layout=data.get("module_layout"),
            optimizer_params=data.get("optimizer_params"),
        )


def merge_shards(shards: Sequence[AnchorsRecord], what: str) -> AnchorsRecord:
    """Every shard's anchors and outer state joined by name, so a resume may re-shard; tensors
    are not copied. ``RecordError`` when the shards disagree (they come from different saves)."""
    counts = {len(r.outer) for r in shards}
    if len(counts) != 1:
        raise RecordError(f"{what}: the anchor shards hold different optimizer counts {counts}")
    merged = [_merge_outer([r.outer[i] for r in shards], what) for i in range(counts.pop())]
    return AnchorsRecord(save_id=shards[0].save_id, outer=merged)


def _merge_outer(records: Sequence[OuterRecord], what: str) -> OuterRecord:
    first = records[0]
    for record in records[1:]:
        differ = [
            f.name
            for f in fields(first.counters)
            if getattr(record.counters, f.name) != getattr(first.counters, f.name)
        ]
        if (record.pending is None) != (first.pending is None):
            differ.append("pending")
        if differ:
            raise RecordError(
                f"{what}: the anchor shards disagree on {differ}; the save directory mixes "
                "saves. Resume from another checkpoint."
            )
    anchors = {name: t for record in records for name, t in record.anchors.items()}
    names, optimizer = merge_by_name([(r.names, r.outer_optimizer) for r in records])
    pending = first.pending
    if pending is not None:
        shares = [r.pending for r in records if r.pending is not None]
        deltas = {n: t for p in shares for n, t in p.deltas.items()}
        # Each share saved the norm of its own part: the whole round's is their root-sum-square.
        norm = math.sqrt(sum(p.norm**2 for p in shares))
        pending = replace(pending, deltas=deltas, norm=norm, share_norm=False)
    return replace(
        first, anchors=anchors, outer_optimizer=optimizer, param_names=names, pending=pending
    )


def plain_values(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters that are plain data (no params, no tensors)."""
    out: dict[str, Any] = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, bool | int | float | str) or value is None:
            out[key] = value
        elif isinstance(value, Sequence) and all(isinstance(v, int | float) for v in value):
            out[key] = list(value)
    return out


_AUTOMATIC = "epoch_loop.automatic_optimization.optim_progress"
_MANUAL = "epoch_loop.manual_optimization.optim_step_progress"


def optimizer_steps(checkpoint: Mapping[str, Any]) -> int | None:
    """Completed optimizer steps in Lightning's fit-loop state (automatic + manual)."""
    try:
        loop = checkpoint["loops"]["fit_loop"]
        automatic = int(loop[_AUTOMATIC]["optimizer"]["step"]["total"]["completed"])
        manual = int(loop[_MANUAL]["total"]["completed"])
    except (KeyError, TypeError, ValueError):
        return None
    return automatic + manual


@dataclass(frozen=True)
class IslandLoops:
    """One island's ``trainer.global_step`` and ``checkpoint["loops"]`` (progress counters and a
    stateful dataloader's position), for islands that step at their own pace."""

    global_step: int | None
    loops: dict[str, Any]

    @classmethod
    def of(cls, checkpoint: Mapping[str, Any]) -> IslandLoops:
        return cls(global_step(checkpoint), dict(checkpoint.get("loops") or {}))

    def to_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "loops": self.loops}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> IslandLoops:
        step = data["global_step"]
        return cls(None if step is None else int(step), dict(data["loops"]))


def use_island_loops(
    record: SwarmRecord,
    checkpoint: MutableMapping[str, Any],
    ckpt_path: Any,
    *,
    island: int,
    own_pace: bool,
) -> None:
    """Before Lightning restores its loops from ``checkpoint``: give it island ``island``'s own
    (``own_pace``: this run's islands step at their own pace). ``SwarmCheckpointError`` when
    there is none for ``island``, or this run keeps in step islands saved at different steps."""
    saved = record.island_loops
    if saved is None:
        return
    steps = [loops.global_step for loops in saved]
    if not own_pace:
        if len(set(steps)) > 1:
            raise SwarmCheckpointError(
                f"{ckpt_path} was saved with rounds on a time budget (sync_every_s), where each "
                f"island keeps its own step count (global_step by island: {steps}), but this run "
                "syncs every sync_every steps, which needs every island at the same step. "
                "Resume with sync_every_s set (any budget), or from a checkpoint where the "
                "islands stood at one step."
            )
        return
    if not 0 <= island < len(saved):
        raise SwarmCheckpointError(
            f"{ckpt_path} holds the loop state of {len(saved)} island(s), but this run's island "
            f"{island} has none: resume with the island count the checkpoint was written by."
        )
    checkpoint["loops"] = saved[island].loops
    checkpoint["global_step"] = saved[island].global_step


def global_step(checkpoint: Mapping[str, Any]) -> int | None:
    value = checkpoint.get("global_step")
    return int(value) if isinstance(value, int) else None


def check_loop_state(record: SwarmRecord, checkpoint: Mapping[str, Any], ckpt_path: Any) -> None:
    """Raise ``SwarmCheckpointError`` when Lightning's counters differ from the record's."""
    pairs = (
        ("global_step", record.global_step, global_step(checkpoint)),
        (
            "optimizer steps (fit_loop's optimizer step progress)",
            record.optimizer_steps,
            optimizer_steps(checkpoint),
        ),
    )
    for name, saved, found in pairs:
        if saved is not None and found is not None and saved != found:
            raise SwarmCheckpointError(
                f"{ckpt_path}: Lightning's {name} is {found}, but its swarm record was saved at "
                f"{saved}; the file was changed or damaged after the save, and resuming would "
                "continue from a step the anchors were not saved at. Resume from another "
                "checkpoint."
            )
