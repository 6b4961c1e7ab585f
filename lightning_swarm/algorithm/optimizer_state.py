"""Outer optimizer state by parameter name: merge shards and select a share (re-sharding).

A torch optimizer keys its state by position, so a sharded state means something only with its
names. ``merge_by_name`` joins shards over the concatenated names; ``select_by_name`` cuts out
given names in their order. Tensors are not copied (mapped ones stay file-backed). Single-group
optimizers only; hyper-parameters come from the first shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _single_group(state: Mapping[str, Any], what: str) -> dict[str, Any]:
    groups = state["param_groups"]
    if len(groups) != 1:
        raise ValueError(
            f"{what} has {len(groups)} param groups; only an outer optimizer over one group of "
            "anchors can be re-sharded. Resume with the island_size and shard_outer the "
            "checkpoint was written with."
        )
    return dict(groups[0])


def merge_by_name(
    shards: Sequence[tuple[Sequence[str], Mapping[str, Any]]],
) -> tuple[list[str], dict[str, Any]]:
    """One optimizer state over the names of every shard, in shard order."""
    names: list[str] = []
    merged: dict[Any, Any] = {}
    group: dict[str, Any] | None = None
    for shard_names, state in shards:
        head = _single_group(state, "a saved outer optimizer shard")
        group = head if group is None else group
        for position, name in enumerate(shard_names):
            if position in state["state"]:
                merged[len(names)] = state["state"][position]
            names.append(name)
    assert group is not None, "merge_by_name needs at least one shard"
    group["params"] = list(range(len(names)))
    return names, {"state": merged, "param_groups": [group]}


def select_by_name(
    state: Mapping[str, Any], names: Sequence[str], wanted: Sequence[str]
) -> dict[str, Any]:
    """The state of ``wanted`` (a subset of ``names``, the order ``state`` was saved in)."""
    if list(names) == list(wanted):
        return dict(state)
    group = _single_group(state, "the saved outer optimizer")
    index = {name: i for i, name in enumerate(names)}
    missing = [n for n in wanted if n not in index]
    if missing:
        raise ValueError(f"the saved outer optimizer state lacks parameter(s) {missing[:5]}")
    selected = {
        j: state["state"][index[n]] for j, n in enumerate(wanted) if index[n] in state["state"]
    }
    group["params"] = list(range(len(wanted)))
    return {"state": selected, "param_groups": [group]}
