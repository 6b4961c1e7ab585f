"""The membership layer's pure parts: the heal wire format, layouts, options, the lighthouse CLI."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lightning_swarm.config import SwarmConfig
from lightning_swarm.membership import check_membership
from lightning_swarm.membership.config import ElasticConfig, elastic_options
from lightning_swarm.membership.lighthouse import parse_args
from lightning_swarm.membership.model_fingerprint import (
    describe_difference,
    fingerprint,
    model_layout,
)
from lightning_swarm.membership.state_wire import decode_tree, encode_tree


def test_outer_state_round_trips_bitwise_without_pickle() -> None:
    anchors = {"w": torch.randn(3, 4), "b": torch.randn(4).to(torch.bfloat16)}
    opt = torch.optim.Adam(list(anchors.values())[:1], lr=1e-3, betas=(0.9, 0.95))
    anchors["w"].grad = torch.randn(3, 4)
    opt.step()
    tree = {"outer": [{"anchors": anchors, "outer_optimizer": opt.state_dict(), "inner_steps": 9}]}
    header, tensors = encode_tree(tree)
    json.loads(header)  # the header is plain JSON
    received = [t.clone() for t in tensors]  # what recv fills in
    back = decode_tree(header, received)["outer"][0]
    assert back["inner_steps"] == 9
    for name, t in anchors.items():
        assert back["anchors"][name].dtype == t.dtype and back["anchors"][name].equal(t)
    state = back["outer_optimizer"]
    assert state["param_groups"][0]["betas"] == (0.9, 0.95)  # tuples stay tuples
    assert state["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    torch.optim.Adam([anchors["w"]]).load_state_dict(state)  # a valid optimizer state


def test_bad_heal_payloads_are_refused() -> None:
    header, _ = encode_tree({"x": torch.ones(2)})
    with pytest.raises(ValueError, match="names 1 tensors, 0 arrived"):
        decode_tree(header, [])
    with pytest.raises(ValueError, match="arrived with 4 B"):
        decode_tree(header, [torch.zeros(4, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="not valid JSON"):
        decode_tree(b"\x80garbage", [])
    with pytest.raises(ValueError, match="unknown node kind"):
        decode_tree(b'{"P": "os.system"}', [])
    with pytest.raises(TypeError, match="only tensors, numbers, strings"):
        encode_tree({"f": object()})


def test_layout_differences_are_named() -> None:
    small = model_layout({"a": torch.zeros(2, 3), "b": torch.zeros(3)})
    other = model_layout({"a": torch.zeros(2, 4), "c": torch.zeros(3)})
    assert fingerprint(small) != fingerprint(other)
    assert fingerprint(small) == fingerprint(dict(reversed(small.items())))
    text = describe_difference(small, other)
    assert "a is (2, 3) float32 here but (2, 4) float32 in the swarm" in text
    assert "b exists only here" in text and "c exists only in the swarm" in text


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lighthouse": ""}, "needs lighthouse="),
        ({"island_id": ""}, "island_id must be a non-empty name"),
        ({"island_id": "a:b"}, "without ':'"),
        ({"min_islands": 0}, "min_islands must be >= 1"),
        ({"min_islands": 1.5}, "min_islands must be an integer"),
        ({"quorum_timeout_s": 0}, "quorum_timeout_s must be a positive number"),
        ({"round_timeout_s": "5"}, "round_timeout_s must be a positive number"),
    ],
)
def test_elastic_options_are_checked(options: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"lighthouse": "http://h:1", "island_id": "a"}
    with pytest.raises(ValueError, match=message):
        ElasticConfig(**{**base, **options})  # type: ignore[arg-type]


def test_membership_names_and_lighthouse_arguments() -> None:
    assert check_membership("torchft") == "torchft"
    with pytest.raises(ValueError, match=r"membership must be one of \['static', 'torchft'\]"):
        check_membership("elastic")
    args = parse_args(["--min-islands", "3", "--port", "0"])
    assert (args.min_islands, args.port) == (3, 0)
    with pytest.raises(SystemExit):
        parse_args(["--min-islands", "0"])


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"lighthouse": "http://127.0.0.1:1"}, "lighthouse='http://127.0.0.1:1'"),
        ({"island_id": "a"}, "island_id='a'"),
    ],
)
def test_torchft_options_without_torchft_membership_are_refused(
    options: dict[str, str], named: str
) -> None:
    """A launch that names a lighthouse or an island but keeps membership='static' would train
    alone, silently; it is refused, naming the option and `membership`."""
    config = SwarmConfig(**options)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="membership='torchft'") as caught:
        elastic_options(config)
    assert named in str(caught.value) and "membership='static'" in str(caught.value)
    from lightning_swarm import SwarmStrategy

    with pytest.raises(ValueError, match=re.escape(named)):
        SwarmStrategy(**options)  # type: ignore[arg-type]
