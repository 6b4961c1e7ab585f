"""Issue 22, item 3: CLI values that used to fail after launch (or never) are refused first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import hydra
import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from lightning_swarm import SwarmStrategy
from lightning_swarm.cli.app import CONF_DIR, build
from lightning_swarm.demo.gpt import GPT


@pytest.fixture
def compose(tmp_path: Path) -> Iterator:
    def _compose(*overrides: str) -> DictConfig:
        paths = [f"hydra.runtime.output_dir={tmp_path}"]
        cfg = hydra.compose("train", overrides=[*paths, *overrides], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield _compose


def _root_cause(err: BaseException) -> BaseException:
    while err.__cause__ is not None:
        err = err.__cause__
    return err


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("strategy.outer_optimizer.lr=-1", "strategy.outer_optimizer.lr"),
        ("strategy.outer_optimizer.momentum=-0.5", "strategy.outer_optimizer.momentum"),
    ],
)
def test_bad_outer_optimizer_value_is_named_before_launch(compose, override: str, key: str) -> None:
    cfg = compose(override)
    with pytest.raises(ValueError, match=key) as info:
        build(cfg)
    assert "Invalid" in str(info.value)  # torch's own reason is kept


def test_bad_outer_optimizer_value_is_named_by_the_api() -> None:
    import functools

    import torch

    with pytest.raises(ValueError, match=r"outer_optimizer\.lr=-1"):
        SwarmStrategy(outer_optimizer=functools.partial(torch.optim.SGD, lr=-1))


def test_unknown_outer_optimizer_keyword_is_named() -> None:
    import functools

    import torch

    with pytest.raises(ValueError, match=r"outer_optimizer.momentun=0.9 is refused"):
        SwarmStrategy(outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentun=0.9))


def test_missing_checkpoint_is_refused_before_launch(compose, tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent.ckpt"
    cfg = compose(f"ckpt_path={missing}")
    with pytest.raises(ValueError, match=r"ckpt_path=.*nonexistent\.ckpt does not exist"):
        build(cfg)


def test_checkpoint_folder_is_refused_before_launch(compose, tmp_path: Path) -> None:
    cfg = compose(f"ckpt_path={tmp_path}")
    with pytest.raises(ValueError, match="is a folder"):
        build(cfg)


@pytest.mark.parametrize("name", ["n_layer", "n_head", "n_embd", "block_size"])
@pytest.mark.parametrize("value", [0, -1])
def test_demo_model_refuses_non_positive_sizes(name: str, value: int) -> None:
    sizes = {"vocab_size": 256, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 8}
    sizes[name] = value
    with pytest.raises(ValueError, match=rf"model\.{name}={value} must be a positive integer"):
        GPT(**sizes)


def test_cli_refuses_a_gpt_without_blocks(compose) -> None:
    cfg = compose("model.n_layer=-1")
    with pytest.raises(Exception, match=r"model\.n_layer=-1 must be a positive integer"):
        build(cfg)


def test_an_unreachable_lighthouse_is_reported_before_anything_starts(compose) -> None:
    from lightning_swarm import LighthouseUnreachableError
    from tests.dist_utils import free_port

    address = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    cfg = compose(
        "strategy.membership=torchft", f"strategy.lighthouse={address}", "strategy.island_id=a"
    )
    with pytest.raises(LighthouseUnreachableError) as info:
        build(cfg)
    message = str(info.value)
    assert message.startswith(f"strategy.lighthouse={address}: nothing accepted a connection")
    assert "Start the lighthouse first (`swarm-lighthouse --min-islands N --port P`" in message
    assert "The run stopped before training." in message


def test_a_lighthouse_that_listens_passes_the_check() -> None:
    import socket

    from lightning_swarm import LighthouseUnreachableError, SwarmConfig
    from lightning_swarm.cli.preflight import check_lighthouse

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        config = SwarmConfig(
            membership="torchft", lighthouse=f"http://127.0.0.1:{port}", island_id="a"
        )
        check_lighthouse(config)  # raises if the connect failed
    with pytest.raises(LighthouseUnreachableError, match="names no host and port"):
        check_lighthouse(SwarmConfig(membership="torchft", lighthouse="lighthouse", island_id="a"))
