"""Streaming DiLoCo fragments (arXiv 2501.18512): which parameters sync together, and when.

A *layer* is a name up to its first numeric part (``blocks.3.attn.weight`` -> ``blocks.3``), else
its module. Fragment ``f`` sends after step ``s`` when ``(s - f * H / F) % H == 0``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_swarm.errors import SwarmConfigError

LAYOUTS = ("strided", "sequential")

FragmentLayout = str | Sequence[Sequence[str]]


def layer_of(name: str) -> str:
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return ".".join(parts[:-1]) if len(parts) > 1 else name


def build_fragments(
    names: Sequence[str], num_fragments: int, layout: FragmentLayout = "strided"
) -> list[list[str]]:
    """Split trained parameter names (one order on every rank) into ``num_fragments`` non-empty
    lists, each in the order of ``names``, that hold every name once. ``layout``: ``"strided"``
    (layer ``i`` in fragment ``i mod F``), ``"sequential"`` (contiguous chunks, earlier ones at
    most one larger) or F lists of module names. Raises ``ValueError`` saying how to fix it."""
    check_positive_int("num_fragments", num_fragments, "1 syncs the whole model at once")
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique; got duplicates in the trained set")
    if not names:
        raise ValueError("no trained parameters to split into fragments")
    checked = as_layout(layout, num_fragments)
    if isinstance(checked, str):
        return _by_layers(names, num_fragments, checked)
    return _explicit(names, checked)


def as_layout(layout: object, num_fragments: int) -> str | list[list[str]]:
    """Check a layout's form (the names it covers are known only at setup): returns the name,
    or ``num_fragments`` plain lists of module names (a bare string is a list of one)."""
    if isinstance(layout, str):
        if layout not in LAYOUTS:
            raise SwarmConfigError(
                f"fragment_layout={layout!r} is not known; use one of {list(LAYOUTS)} or a "
                "list of num_fragments lists of module names."
            )
        return layout
    try:
        groups = [[e] if isinstance(e, str) else list(e) for e in layout]  # type: ignore[attr-defined]
    except TypeError:
        groups = []
    if groups and all(isinstance(n, str) for g in groups for n in g):
        if len(groups) != num_fragments:
            raise SwarmConfigError(
                f"fragment_layout lists {len(groups)} fragment(s) but num_fragments="
                f"{num_fragments}; give exactly one list of module names per fragment."
            )
        return groups
    raise SwarmConfigError(
        f"fragment_layout must be 'strided', 'sequential' or a list of lists of module names "
        f"(one list per fragment), got {layout!r}; e.g. [['blocks.0', 'blocks.2'], ['blocks.1']]."
    )


def _by_layers(names: Sequence[str], num_fragments: int, layout: str) -> list[list[str]]:
    layers: dict[str, int] = {}
    for name in names:
        layers.setdefault(layer_of(name), len(layers))
    num_layers = len(layers)
    if num_layers < num_fragments:
        raise SwarmConfigError(
            f"num_fragments={num_fragments} but the model has only {num_layers} layer(s) "
            f"({', '.join(list(layers)[:8])}{', ...' if num_layers > 8 else ''}), so a fragment "
            f"would be empty; set num_fragments <= {num_layers}, or pass fragment_layout as "
            "explicit lists of module names."
        )
    base, extra = divmod(num_layers, num_fragments)
    fragment_of_layer = (
        [i % num_fragments for i in range(num_layers)]
        if layout == "strided"
        else [f for f in range(num_fragments) for _ in range(base + (f < extra))]
    )
    fragments: list[list[str]] = [[] for _ in range(num_fragments)]
    for name in names:
        fragments[fragment_of_layer[layers[layer_of(name)]]].append(name)
    return fragments


def _explicit(names: Sequence[str], groups: list[list[str]]) -> list[list[str]]:
    owner: dict[str, int] = {}
    for f, modules in enumerate(groups):
        if not modules:
            raise SwarmConfigError(
                f"fragment_layout[{f}] is empty; every fragment needs at least one module name."
            )
        for module in modules:
            matched = [n for n in names if n == module or n.startswith(module + ".")]
            if not matched:
                raise SwarmConfigError(
                    f"fragment_layout[{f}] names {module!r}, which matches no trained parameter; "
                    f"use module names such as {names[0].rsplit('.', 1)[0]!r}."
                )
            for name in matched:
                if name in owner and owner[name] != f:
                    raise SwarmConfigError(
                        f"parameter {name!r} is in fragment_layout[{owner[name]}] and "
                        f"fragment_layout[{f}]; each parameter must be in exactly one fragment."
                    )
                owner[name] = f
    missing = [n for n in names if n not in owner]
    if missing:
        raise SwarmConfigError(
            f"fragment_layout leaves {len(missing)} trained parameter(s) out, e.g. "
            f"{missing[:3]}; add their modules to one of the fragments."
        )
    return [[n for n in names if owner[n] == f] for f in range(len(groups))]


def check_fragments(fragments: Sequence[Sequence[str]] | None, names: list[str]) -> list[list[str]]:
    """Fragments given as lists of parameter names (``None``: one of everything), in the order
    of ``names``; ``ValueError`` for an empty fragment or a name unknown, repeated or left out."""
    if fragments is None:
        return [names]
    owner: dict[str, int] = {}
    for index, fragment in enumerate(fragments):
        if not fragment:
            raise ValueError(f"fragment {index} is empty; every fragment needs a parameter.")
        for name in fragment:
            if name not in names or name in owner:
                problem = "is not a trained parameter" if name not in names else "is repeated"
                raise ValueError(
                    f"fragment {index}: {name!r} {problem}; each trained parameter must be in "
                    "exactly one fragment (build them with build_fragments)."
                )
            owner[name] = index
    missing = [n for n in names if n not in owner]
    if missing:
        raise ValueError(
            f"the fragments leave {len(missing)} trained parameter(s) out, e.g. {missing[:3]}; "
            "each trained parameter must be in exactly one fragment."
        )
    return [[n for n in names if owner[n] == index] for index in range(len(fragments))]


@dataclass(frozen=True, kw_only=True)
class FragmentSchedule:
    """When each fragment sends and applies: every ``sync_every`` (H) inner steps, staggered by
    H / ``num_fragments``, applied ``sync_delay`` steps later with ``local <- (1 - merge_alpha) *
    global + merge_alpha * local``."""

    sync_every: int
    num_fragments: int = 1
    sync_delay: int = 0
    merge_alpha: float = 0.0

    def __post_init__(self) -> None:
        check_positive_int("sync_every", self.sync_every, "e.g. sync_every=100 (DiLoCo's H)")
        check_positive_int("num_fragments", self.num_fragments, "1 syncs the whole model at once")
        if self.sync_every % self.num_fragments:
            raise SwarmConfigError(
                f"sync_every={self.sync_every} is not divisible by num_fragments="
                f"{self.num_fragments}; fragments are staggered by sync_every / num_fragments "
                "inner steps, so choose a sync_every that is a multiple of num_fragments."
            )
        interval = self.interval
        if (
            isinstance(self.sync_delay, bool)
            or not isinstance(self.sync_delay, int)
            or not 0 <= self.sync_delay < interval
        ):
            raise SwarmConfigError(
                f"sync_delay={self.sync_delay!r} must be an integer with 0 <= sync_delay < "
                f"sync_every / num_fragments = {interval}, so a fragment is applied before the "
                "next one is sent; lower sync_delay or num_fragments."
            )
        alpha = self.merge_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise SwarmConfigError(
                f"merge_alpha={alpha!r} must lie in [0, 1]: 0 takes the global parameters on "
                "arrival (DiLoCo), 1 keeps the local ones."
            )

    @property
    def interval(self) -> int:
        return self.sync_every // self.num_fragments

    def sends_at(self, step: int) -> int | None:
        """The fragment that sends after inner step ``step`` (1-based), or None."""
        _check_step(step)
        return None if step % self.interval else (step % self.sync_every) // self.interval

    def applies_at(self, step: int) -> int | None:
        """The fragment whose averaged result is applied after inner step ``step``, or None."""
        _check_step(step)
        send = step - self.sync_delay
        return self.sends_at(send) if send >= 1 else None

    def in_flight(self, step: int, *, sent_after: int = 0) -> int | None:
        """The fragment sent at or before ``step`` and applied after it (what a checkpoint taken
        after ``step`` must carry); rounds sent at or before ``sent_after`` were applied early."""
        _check_step(step)
        for sent in range(max(1, sent_after + 1, step - self.sync_delay + 1), step + 1):
            fragment = self.sends_at(sent)
            if fragment is not None and sent + self.sync_delay > step:
                return fragment
        return None


def check_positive_int(option: str, value: object, hint: str) -> None:
    """The package's one positive-integer rule: ``ValueError`` naming ``option`` and ``hint``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SwarmConfigError(f"{option} must be a positive integer, got {value!r}; {hint}.")


def _check_step(step: int) -> None:
    if step < 1:
        raise ValueError(f"steps count completed inner steps from 1, got {step}")
