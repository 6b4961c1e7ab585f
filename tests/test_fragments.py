"""Fragment layouts and the Streaming DiLoCo schedule."""

from __future__ import annotations

import pytest

from lightning_swarm.algorithm.fragments import FragmentSchedule, build_fragments, layer_of

GPT_NAMES = [
    "transformer.wte.weight",
    "transformer.wpe.weight",
    *[f"transformer.h.{i}.{p}" for i in range(4) for p in ("attn.weight", "mlp.weight")],
    "transformer.ln_f.weight",
    "lm_head.weight",
]


def test_layer_of() -> None:
    assert layer_of("blocks.3.attn.weight") == "blocks.3"
    assert layer_of("transformer.h.11.mlp.c_fc.bias") == "transformer.h.11"
    assert layer_of("transformer.wte.weight") == "transformer.wte"
    assert layer_of("0.weight") == "0"
    assert layer_of("scale") == "scale"
    assert layer_of("conv1.weight") == "conv1"


def test_strided_layout() -> None:
    # layers: wte 0, wpe 1, h.0 2, h.1 3, h.2 4, h.3 5, ln_f 6, lm_head 7
    fragments = build_fragments(GPT_NAMES, 3)
    assert fragments == [
        [
            "transformer.wte.weight",
            "transformer.h.1.attn.weight",
            "transformer.h.1.mlp.weight",
            "transformer.ln_f.weight",
        ],
        [
            "transformer.wpe.weight",
            "transformer.h.2.attn.weight",
            "transformer.h.2.mlp.weight",
            "lm_head.weight",
        ],
        [
            "transformer.h.0.attn.weight",
            "transformer.h.0.mlp.weight",
            "transformer.h.3.attn.weight",
            "transformer.h.3.mlp.weight",
        ],
    ]


def test_sequential_layout() -> None:
    fragments = build_fragments(GPT_NAMES, 3, "sequential")
    # 8 layers into 3 chunks: 3, 3, 2
    assert [sorted({layer_of(n) for n in f}) for f in fragments] == [
        ["transformer.h.0", "transformer.wpe", "transformer.wte"],
        ["transformer.h.1", "transformer.h.2", "transformer.h.3"],
        ["lm_head", "transformer.ln_f"],
    ]


@pytest.mark.parametrize("layout", ["strided", "sequential"])
@pytest.mark.parametrize("num_fragments", [1, 2, 5, 8])
def test_layouts_cover_every_name_once(layout: str, num_fragments: int) -> None:
    fragments = build_fragments(GPT_NAMES, num_fragments, layout)
    assert len(fragments) == num_fragments and all(fragments)
    flat = [n for f in fragments for n in f]
    assert sorted(flat) == sorted(GPT_NAMES)
    # a layer never straddles two fragments
    for f in fragments:
        for other in fragments:
            if other is not f:
                assert not {layer_of(n) for n in f} & {layer_of(n) for n in other}


def test_explicit_layout() -> None:
    layout = [
        ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1"],
        ["transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"],
    ]
    fragments = build_fragments(GPT_NAMES, 2, layout)
    assert fragments[0] == GPT_NAMES[:6]
    assert fragments[1] == GPT_NAMES[6:]
    # a parent module covers its children; a bare string is a one-module fragment
    assert build_fragments(GPT_NAMES, 2, ["transformer", "lm_head"])[1] == ["lm_head.weight"]


def test_explicit_prefix_matches_whole_components_only() -> None:
    names = ["h.1.weight", "h.10.weight"]
    assert build_fragments(names, 2, [["h.1"], ["h.10"]]) == [["h.1.weight"], ["h.10.weight"]]


def test_too_many_fragments_raises() -> None:
    with pytest.raises(
        ValueError,
        match=r"num_fragments=9 but the model has only 8 layer\(s\).*"
        r"set num_fragments <= 8",
    ):
        build_fragments(GPT_NAMES, 9)


def test_explicit_layout_errors() -> None:
    with pytest.raises(ValueError, match=r"lists 1 fragment\(s\) but num_fragments=2"):
        build_fragments(GPT_NAMES, 2, [["transformer"]])
    with pytest.raises(ValueError, match=r"fragment_layout\[1\] is empty"):
        build_fragments(GPT_NAMES, 2, [["transformer", "lm_head"], []])
    with pytest.raises(ValueError, match=r"'transformer.h.9', which matches no trained parameter"):
        build_fragments(GPT_NAMES, 2, [["transformer"], ["lm_head", "transformer.h.9"]])
    with pytest.raises(
        ValueError,
        match=r"'transformer.h.0.attn.weight' is in fragment_layout\[0\]"
        r" and fragment_layout\[1\]",
    ):
        build_fragments(GPT_NAMES, 2, [["transformer"], ["lm_head", "transformer.h.0"]])
    with pytest.raises(ValueError, match=r"leaves 1 trained parameter\(s\) out.*'lm_head.weight'"):
        build_fragments(
            GPT_NAMES,
            2,
            [["transformer.h"], ["transformer.wte", "transformer.wpe", "transformer.ln_f"]],
        )


def test_layout_name_errors() -> None:
    with pytest.raises(ValueError, match=r"fragment_layout='random' is not known"):
        build_fragments(GPT_NAMES, 2, "random")
    with pytest.raises(ValueError, match="num_fragments must be a positive integer"):
        build_fragments(GPT_NAMES, 0)
    with pytest.raises(ValueError, match="must be unique"):
        build_fragments(["a.w", "a.w"], 1)
    with pytest.raises(ValueError, match="no trained parameters"):
        build_fragments([], 1)


def test_one_fragment_no_delay_is_plain_diloco() -> None:
    schedule = FragmentSchedule(sync_every=5)
    sends = [s for s in range(1, 31) if schedule.sends_at(s) is not None]
    # OuterSync syncs when inner_steps % sync_every == 0, inner_steps counted after the step
    assert sends == [s for s in range(1, 31) if s % 5 == 0]
    assert all(schedule.applies_at(s) == schedule.sends_at(s) for s in range(1, 31))
    assert all(schedule.in_flight(s) is None for s in range(1, 31))


def test_staggered_schedule() -> None:
    schedule = FragmentSchedule(sync_every=12, num_fragments=4, sync_delay=2)
    assert schedule.interval == 3
    sends = {s: schedule.sends_at(s) for s in range(1, 31) if schedule.sends_at(s) is not None}
    assert sends == {3: 1, 6: 2, 9: 3, 12: 0, 15: 1, 18: 2, 21: 3, 24: 0, 27: 1, 30: 2}
    applies = {
        s: schedule.applies_at(s) for s in range(1, 31) if schedule.applies_at(s) is not None
    }
    assert applies == {s + 2: f for s, f in sends.items() if s + 2 <= 30}
    assert [schedule.in_flight(s) for s in range(1, 9)] == [None, None, 1, 1, None, 2, 2, None]


def test_at_most_one_fragment_in_flight() -> None:
    schedule = FragmentSchedule(sync_every=8, num_fragments=4, sync_delay=1)
    in_flight = set()
    for step in range(1, 50):
        sent, applied = schedule.sends_at(step), schedule.applies_at(step)
        assert sent is None or applied is None  # delay > 0: never both at one step
        if sent is not None:
            assert not in_flight
            in_flight.add(sent)
        if applied is not None:
            in_flight.remove(applied)


def test_schedule_validation() -> None:
    with pytest.raises(ValueError, match="sync_every=10 is not divisible by num_fragments=4"):
        FragmentSchedule(sync_every=10, num_fragments=4)
    with pytest.raises(ValueError, match=r"0 <= sync_delay < sync_every / num_fragments = 3"):
        FragmentSchedule(sync_every=12, num_fragments=4, sync_delay=3)
    with pytest.raises(ValueError, match="sync_delay=-1"):
        FragmentSchedule(sync_every=12, sync_delay=-1)
    with pytest.raises(ValueError, match=r"merge_alpha=1.5 must lie in \[0, 1\]"):
        FragmentSchedule(sync_every=12, merge_alpha=1.5)
    with pytest.raises(ValueError, match=r"merge_alpha=-0.1 must lie in \[0, 1\]"):
        FragmentSchedule(sync_every=12, merge_alpha=-0.1)
    with pytest.raises(ValueError, match="sync_every must be a positive integer"):
        FragmentSchedule(sync_every=0)
    with pytest.raises(ValueError, match="num_fragments must be a positive integer"):
        FragmentSchedule(sync_every=4, num_fragments=0)
    with pytest.raises(ValueError, match="steps count completed inner steps from 1"):
        FragmentSchedule(sync_every=4).sends_at(0)
    FragmentSchedule(sync_every=12, num_fragments=4, sync_delay=2, merge_alpha=1.0)
