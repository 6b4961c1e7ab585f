"""The round header: one int64 row per member of a quorum, all-gathered before a pseudo-gradient
moves; every member decides from the rows alone, so all decide alike. The reference is the first
member not being healed. Collectives line up only when every member averages the same fragment:
an island being healed averages zeros and adopts the swarm's round (``opening_of``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import astuple, dataclass, replace
from typing import Any

import torch
from torch import Tensor

from lightning_swarm.algorithm.budget import scale_of
from lightning_swarm.algorithm.model_layout import hash63
from lightning_swarm.config import ISLAND_SETTINGS, SwarmConfig
from lightning_swarm.membership.errors import (
    DivergedIslandError,
    DuplicateIslandError,
    MembershipError,
    ModelMismatchError,
    SettingsMismatchError,
)
from lightning_swarm.transport.base import Opening, RoundPlace, checked_work

Settings = dict[str, Any]  # setting name -> a JSON value; equal on every island of a swarm


def _json_value(value: object) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value)


def swarm_settings(config: SwarmConfig, outer_optimizer: torch.optim.Optimizer) -> Settings:
    """The settings every island of one swarm must share: ``ISLAND_SETTINGS``, the outer
    optimizer's class and the hyper-parameters of each of its parameter groups."""
    settings: Settings = {name: _json_value(getattr(config, name)) for name in ISLAND_SETTINGS}
    prefix, cls, groups = "outer_optimizer", type(outer_optimizer), outer_optimizer.param_groups
    settings[prefix] = f"{cls.__module__}.{cls.__qualname__}"
    for index, group in enumerate(groups):
        key = prefix if len(groups) == 1 else f"{prefix}[{index}]"
        for name, value in sorted(group.items()):
            if name != "params":
                settings[f"{key}.{name}"] = _json_value(value)
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
    """One island's row of the round header."""

    island: int  # hash of island_id
    model: int  # fingerprint of the model's layout
    healing: int  # 1 while this island is being healed in this round
    joined_ns: int  # when this island's membership started: the earlier twin keeps the id
    nonce: int  # tells two launches with one island_id apart
    finite: int  # 0 when its pseudo-gradient holds NaN or inf
    settings: int = 0  # hash of its encoded settings (``set_settings``)
    settings_len: int = 0  # length of its encoded settings
    # Its place in its schedule (``RoundPlace``): fragment, sent after, applies at.
    fragment: int = 0
    send_step: int = 0
    apply_step: int = 0
    # Under a time budget (``Work``): steps since its last round (its weight), in all; else 0.
    work: int = 0
    inner_steps: int = 0

    def set_settings(self, settings: Settings) -> None:
        encoded = encode_settings(settings)
        self.settings, self.settings_len = hash63(encoded), len(encoded)

    def tensor(self) -> Tensor:
        return torch.tensor(astuple(self), dtype=torch.int64)

    @classmethod
    def of(cls, values: Tensor) -> HeaderRow:
        return cls(*(int(v) for v in values.tolist()))


def island_hash(island_id: str) -> int:
    return hash63(island_id.encode())


def reference_index(rows: list[HeaderRow]) -> int:
    return next((i for i, r in enumerate(rows) if not r.healing), 0)


def swarm_settings_of(
    rows: list[HeaderRow], own: Settings, allgather: Callable[[Tensor], list[Tensor]]
) -> Settings | None:
    """The reference member's settings, exchanged (``allgather``: every member's tensor of one
    shape) only where the rows' hashes disagree, which every member sees alike; else ``None``."""
    index = reference_index(rows)
    reference = rows[index]
    if all(r.settings == reference.settings for r in rows):
        return None
    encoded = encode_settings(own)
    padded = torch.zeros(max(r.settings_len for r in rows), dtype=torch.uint8)
    padded[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    theirs = allgather(padded)[index][: reference.settings_len]
    decoded = json.loads(theirs.numpy().tobytes().decode())
    if not isinstance(decoded, dict):
        raise ValueError("a round header carried settings that are not a mapping")
    return decoded


def refusal(
    rows: list[HeaderRow],
    mine: HeaderRow,
    island_id: str,
    own_settings: Mapping[str, Any],
    swarm_settings: Mapping[str, Any] | None,
) -> MembershipError | None:
    """The error this island raises for the round's header (``mine`` is one of ``rows``),
    naming the cause and the fix; ``None`` when this island is not at fault."""
    name, reference = island_id, rows[reference_index(rows)]
    twins = [r for r in rows if r.island == mine.island and r.nonce != mine.nonce]
    if not mine.finite:
        return DivergedIslandError(
            f"island {name!r} leaves the swarm: its pseudo-gradient holds NaN or inf, so its "
            "training diverged (the other islands abandon this round and go on); lower the "
            "inner learning rate or clip gradients, then restart it."
        )
    if twins and min((r.joined_ns, r.nonce) for r in twins) < (mine.joined_ns, mine.nonce):
        return DuplicateIslandError(
            f"island_id {name!r} is already taken by a live island of the swarm; give this "
            "launch another island_id (each island needs its own)."
        )
    if mine.model != reference.model:
        return ModelMismatchError(
            f"island {name!r} was refused: its model (fingerprint {mine.model:x}) differs from "
            f"the swarm's ({reference.model:x}). Start it with the model the swarm trains."
        )
    if mine.settings == reference.settings:
        return None
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


def abandons(rows: list[HeaderRow], mine: HeaderRow) -> bool:
    """Whether ``mine``, not refused itself, abandons the round: a member is refused, or a
    later twin of ``mine`` is in it."""
    reference = rows[reference_index(rows)]
    return (
        any(r.island == mine.island and r.nonce != mine.nonce for r in rows)
        or any(r.model != reference.model or r.settings != reference.settings for r in rows)
        or not all(r.finite for r in rows)
    )


def opening_of(rows: list[HeaderRow], mine: HeaderRow) -> Opening:
    """This member's ``Opening`` from the round header's ``rows`` (``mine`` is among them)."""
    swarm = rows[reference_index(rows)]
    abandon = any(not r.healing and r.fragment != swarm.fragment for r in rows)
    adopt = mine.healing or mine.fragment != swarm.fragment
    place = RoundPlace(swarm.fragment, swarm.send_step, swarm.apply_step)
    return Opening(adopt=place if adopt else None, abandon=abandon)


def weighed(rows: list[HeaderRow], mine: HeaderRow, opening: Opening) -> Opening:
    """``opening`` with this member's scale and the swarm's most inner steps, from the work
    in the header's ``rows`` (a time-budgeted round): torchft divides the sum by the
    participants, so each scales its pseudo-gradient by ``n w_i / W``; one being healed has none.

    Raises:
        BadWorkError: a participant's work is not a whole number from 0 to its inner steps,
            naming it by its place in the quorum; every member reads the same rows.
    """
    participants = [(k, r) for k, r in enumerate(rows) if not r.healing]
    if not participants:
        return opening
    weights, swarm_steps = checked_work(
        [(float(r.work), float(r.inner_steps)) for _, r in participants],
        [f"the island at place {k} of the quorum (island_id hash {r.island:x})"
         for k, r in participants],
    )  # fmt: skip
    mine_at = [i for i, (_, r) in enumerate(participants) if r.nonce == mine.nonce]
    scale = scale_of(weights, mine_at[0]) if mine_at else 1.0
    return replace(opening, scale=scale, swarm_steps=swarm_steps)
