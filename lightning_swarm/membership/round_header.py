"""The round header: what each member of a quorum tells the others before a pseudo-gradient moves.

Each round all-gathers one int64 row per island (``HeaderRow``); from the rows alone every member
reaches the same verdict (``judge``), so all abandon a round together and only the island at fault
raises: a non-finite pseudo-gradient, a duplicate ``island_id``, a different model layout, or
different settings (``swarm_settings``: ``config.ISLAND_SETTINGS`` and the outer optimizer). The
reference is the first member not being healed. Rows carry a hash of the settings; when hashes
differ the settings themselves are exchanged, so the error names each difference. Nothing here
talks to the network.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import astuple, dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from lightning_swarm.config import ISLAND_SETTINGS, SwarmConfig
from lightning_swarm.membership.errors import (
    DivergedIslandError,
    DuplicateIslandError,
    MembershipError,
    ModelMismatchError,
    SettingsMismatchError,
)

Settings = dict[str, Any]
"""Setting name -> a JSON value; equal on every island of a swarm."""


def _hash63(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1


def _json_value(value: object) -> Any:
    """``value`` as JSON can hold it (tuples as lists; anything else by its repr)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value)


def optimizer_settings(optimizer: torch.optim.Optimizer) -> Settings:
    """An optimizer's class and the hyper-parameters of each of its parameter groups."""
    prefix, cls = "outer_optimizer", type(optimizer)
    settings: Settings = {prefix: f"{cls.__module__}.{cls.__qualname__}"}
    for index, group in enumerate(optimizer.param_groups):
        key = prefix if len(optimizer.param_groups) == 1 else f"{prefix}[{index}]"
        for name, value in sorted(group.items()):
            if name != "params":
                settings[f"{key}.{name}"] = _json_value(value)
    return settings


def swarm_settings(config: SwarmConfig, outer_optimizer: torch.optim.Optimizer) -> Settings:
    """The settings every island of one swarm must share (see the module docstring)."""
    settings: Settings = {name: _json_value(getattr(config, name)) for name in ISLAND_SETTINGS}
    settings.update(optimizer_settings(outer_optimizer))
    return settings


def encode_settings(settings: Mapping[str, Any]) -> bytes:
    """A canonical encoding: equal settings give equal bytes on every island."""
    return json.dumps(dict(settings), sort_keys=True, separators=(",", ":")).encode()


def describe_settings_difference(own: Mapping[str, Any], swarm: Mapping[str, Any]) -> str:
    """Each setting that differs, with this island's value and the swarm's."""
    notes = [
        f"{name} is {own.get(name, 'unset')!r} here but {swarm.get(name, 'unset')!r} in the swarm"
        for name in sorted(set(own) | set(swarm))
        if own.get(name) != swarm.get(name) or (name in own) != (name in swarm)
    ]
    return "; ".join(notes) if notes else "the settings agree"


@dataclass
class HeaderRow:
    """One island's row of the round header (all int64)."""

    island: int  # hash of island_id
    model: int  # fingerprint of the model's layout
    healing: int  # 1 while this island is being healed in this round
    joined_ns: int  # when this island's membership started: the earlier twin keeps the id
    nonce: int  # tells two launches with one island_id apart
    finite: int  # 0 when its pseudo-gradient holds NaN or inf
    settings: int  # hash of its encoded settings
    settings_len: int  # length of its encoded settings
    # Its place in its schedule (``adopt.RoundPlace``): fragment, sent after, applies at.
    fragment: int = 0
    send_step: int = 0
    apply_step: int = 0
    # Under a time budget (``transport.base.Work``): inner steps since its last round (its
    # weight) and in all; 0 without a budget.
    work: int = 0
    inner_steps: int = 0

    def tensor(self) -> Tensor:
        return torch.tensor(astuple(self), dtype=torch.int64)

    @classmethod
    def of(cls, values: Tensor) -> HeaderRow:
        return cls(*(int(v) for v in values.tolist()))


def island_hash(island_id: str) -> int:
    return _hash63(island_id.encode())


def settings_hash(encoded: bytes) -> int:
    return _hash63(encoded)


def reference_index(rows: list[HeaderRow]) -> int:
    """The swarm's reference: the first member not being healed, else the first member."""
    return next((i for i, r in enumerate(rows) if not r.healing), 0)


def settings_disagree(rows: list[HeaderRow]) -> bool:
    """Whether the settings must be exchanged (the same answer on every member)."""
    reference = rows[reference_index(rows)].settings
    return any(r.settings != reference for r in rows)


def settings_tensor(encoded: bytes, rows: list[HeaderRow]) -> Tensor:
    """This island's encoded settings, zero-padded to the longest of the round."""
    out = torch.zeros(max(r.settings_len for r in rows), dtype=torch.uint8)
    out[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    return out


def decode_settings(padded: Tensor, length: int) -> Settings:
    decoded = json.loads(padded[:length].numpy().tobytes().decode())
    if not isinstance(decoded, dict):
        raise ValueError("a round header carried settings that are not a mapping")
    return decoded


class Verdict(Enum):
    """What a member does after reading the header (the same rows give the same verdicts)."""

    GO = "go"  # every row agrees: average
    ABANDON = "abandon"  # another member is refused: abandon the round, stay
    DIVERGED = "diverged"  # this island's pseudo-gradient is not finite: leave
    DUPLICATE = "duplicate"  # this island is the later of two with one island_id: leave
    MODEL = "model"  # this island's model differs from the reference: leave
    SETTINGS = "settings"  # this island's settings differ from the reference: leave


def judge(rows: list[HeaderRow], mine: HeaderRow) -> Verdict:
    """This member's verdict on the round's header (``mine`` is one of ``rows``)."""
    reference = rows[reference_index(rows)]
    twins = [r for r in rows if r.island == mine.island and r.nonce != mine.nonce]
    if not mine.finite:
        return Verdict.DIVERGED
    if twins and min((r.joined_ns, r.nonce) for r in twins) < (mine.joined_ns, mine.nonce):
        return Verdict.DUPLICATE
    if mine.model != reference.model:
        return Verdict.MODEL
    if mine.settings != reference.settings:
        return Verdict.SETTINGS
    refused = (
        twins
        or any(r.model != reference.model or r.settings != reference.settings for r in rows)
        or not all(r.finite for r in rows)
    )
    return Verdict.ABANDON if refused else Verdict.GO


def refusal(
    verdict: Verdict,
    island_id: str,
    own_model: int,
    swarm_model: int,
    own_settings: Mapping[str, Any],
    swarm_settings: Mapping[str, Any] | None,
) -> MembershipError:
    """The error this island raises for a refusing ``verdict``, naming the cause and the fix."""
    name = island_id
    if verdict is Verdict.DIVERGED:
        return DivergedIslandError(
            f"island {name!r} leaves the swarm: its pseudo-gradient holds NaN or inf, so its "
            "training diverged (the other islands abandon this round and go on); lower the "
            "inner learning rate or clip gradients, then restart it."
        )
    if verdict is Verdict.DUPLICATE:
        return DuplicateIslandError(
            f"island_id {name!r} is already taken by a live island of the swarm; give this "
            "launch another island_id (each island needs its own)."
        )
    if verdict is Verdict.MODEL:
        return ModelMismatchError(
            f"island {name!r} was refused: its model (fingerprint {own_model:x}) differs from "
            f"the swarm's ({swarm_model:x}). Start it with the model the swarm trains."
        )
    assert verdict is Verdict.SETTINGS, verdict
    swarm = swarm_settings or {}
    shares = ""
    if own_settings.get("outer_shares") != swarm.get("outer_shares"):
        shares = (
            " outer_shares is how many ranks share an island's outer state: its ranks with "
            "shard_outer=True, else 1; give every island the same number of ranks, or set "
            "shard_outer=False on every island."
        )
    return SettingsMismatchError(
        f"island {name!r} was refused: its DiLoCo settings differ from the swarm's: "
        f"{describe_settings_difference(own_settings, swarm)}. Start it with the "
        f"swarm's settings (every island of a swarm must use the same ones).{shares}"
    )
