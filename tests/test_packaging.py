"""The package as a user gets it: the wheel (with its configs), the public names, no cycles."""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib

from tests.cli_utils import ROOT, RUN_TIMEOUT_S, TINY, run_group, tree_env

# One packaging step (building the wheel, a venv, installing): seconds on an idle machine.
STEP_TIMEOUT_S = 60.0

PUBLIC = [
    "CollectiveTimeoutError",
    "DiskFullError",
    "HostMemoryCensus",
    "MembershipError",
    "NonFinitePseudoGradientError",
    "SwarmCheckpointError",
    "SwarmConfigError",
    "SwarmResume",
    "SwarmRoundError",
    "SwarmStrategy",
    "SyncWorkerError",
]


def test_public_names_are_the_classes_where_they_live() -> None:
    import lightning_swarm
    from lightning_swarm.callbacks import HostMemoryCensus, SwarmResume
    from lightning_swarm.errors import (
        CollectiveTimeoutError,
        DiskFullError,
        SwarmCheckpointError,
        SwarmConfigError,
    )
    from lightning_swarm.membership.errors import MembershipError
    from lightning_swarm.outer.errors import SyncWorkerError
    from lightning_swarm.strategy import SwarmStrategy
    from lightning_swarm.transport.errors import NonFinitePseudoGradientError, SwarmRoundError

    where = {
        "CollectiveTimeoutError": CollectiveTimeoutError,
        "DiskFullError": DiskFullError,
        "HostMemoryCensus": HostMemoryCensus,
        "MembershipError": MembershipError,
        "NonFinitePseudoGradientError": NonFinitePseudoGradientError,
        "SwarmCheckpointError": SwarmCheckpointError,
        "SwarmConfigError": SwarmConfigError,
        "SwarmResume": SwarmResume,
        "SwarmRoundError": SwarmRoundError,
        "SwarmStrategy": SwarmStrategy,
        "SyncWorkerError": SyncWorkerError,
    }
    assert set(PUBLIC) <= set(lightning_swarm.__all__)
    for name, cls in where.items():
        assert getattr(lightning_swarm, name) is cls
    for name in PUBLIC:
        assert issubclass(getattr(lightning_swarm, name), Exception) == name.endswith("Error")


# Errors a user never meets under their own name: each is a refinement of an exported error,
# caught by it and handled inside the package.
INTERNAL_ERRORS = {
    # SwarmCheckpointError subclasses; a resume that fails on any rank raises a plain
    # SwarmCheckpointError on every rank naming the cause, so users catch that.
    "lightning_swarm.resume.errors.RecordError",
    "lightning_swarm.resume.errors.IntegrityError",
}


def _defined_errors() -> list[type[BaseException]]:
    """Every exception class defined in the package (all modules imported)."""
    import importlib
    import inspect
    import pkgutil

    import lightning_swarm

    defined = []
    for info in pkgutil.walk_packages(lightning_swarm.__path__, "lightning_swarm."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and issubclass(cls, BaseException):
                defined.append(cls)
    assert len(defined) >= 20  # the walk found the package's errors
    return defined


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def test_every_error_the_package_defines_has_the_one_root() -> None:
    import lightning_swarm
    from lightning_swarm.errors import SwarmError

    orphans = [_qualname(c) for c in _defined_errors() if not issubclass(c, SwarmError)]
    assert not orphans, f"errors outside the SwarmError root: {orphans}"
    assert lightning_swarm.SwarmError is SwarmError
    # Callers that catch the builtin bases keep working.
    assert issubclass(lightning_swarm.SwarmCheckpointError, ValueError)
    assert issubclass(lightning_swarm.SwarmConfigError, ValueError)
    assert issubclass(lightning_swarm.SwarmConfigTypeError, TypeError)
    assert issubclass(lightning_swarm.SwarmRoundError, RuntimeError)
    assert issubclass(lightning_swarm.DiskFullError, OSError)


def test_errors_are_declared_in_errors_modules() -> None:
    # One place per layer: the package's errors.py or the layer's own.
    elsewhere = [
        _qualname(c) for c in _defined_errors() if c.__module__.rpartition(".")[2] != "errors"
    ]
    assert not elsewhere, f"declare these in an errors.py: {elsewhere}"


def test_every_error_is_exported_or_listed_as_internal() -> None:
    import lightning_swarm

    defined = {_qualname(c): c for c in _defined_errors()}
    assert set(defined) >= INTERNAL_ERRORS, "INTERNAL_ERRORS names a class that does not exist"
    exported = {getattr(lightning_swarm, name) for name in lightning_swarm.__all__}
    missing = [q for q, c in defined.items() if c not in exported and q not in INTERNAL_ERRORS]
    assert not missing, f"export these from lightning_swarm or list them as internal: {missing}"
    internal_but_exported = [q for q in INTERNAL_ERRORS if defined[q] in exported]
    assert not internal_but_exported, f"internal errors exported: {internal_but_exported}"


def test_a_bad_option_is_a_swarm_error_and_a_value_error() -> None:
    import lightning_swarm

    with pytest.raises(lightning_swarm.SwarmConfigError) as info:
        lightning_swarm.SwarmStrategy(sync_every=0)
    assert isinstance(info.value, lightning_swarm.SwarmError)
    assert isinstance(info.value, ValueError)
    assert str(info.value) == (
        "sync_every must be a positive integer, got 0; e.g. sync_every=100 (DiLoCo's H)."
    )
    with pytest.raises(lightning_swarm.SwarmConfigTypeError) as type_info:
        lightning_swarm.SwarmConfig(swarm=[1])  # type: ignore[arg-type]
    assert isinstance(type_info.value, TypeError)
    assert str(type_info.value) == (
        "swarm must be a dict such as {'offload': False} or an instance of "
        "SwarmTransportConfig, got list."
    )


@pytest.mark.parametrize(
    "first",
    ["lightning_swarm.callbacks.census", "lightning_swarm.callbacks.resume"],
)
def test_public_import_after_any_first_import(first: str) -> None:
    # A fresh interpreter: which module is imported first decides whether a cycle bites.
    code = f"import {first}\nfrom lightning_swarm import {', '.join(PUBLIC)}\nprint('ok')"
    done = run_group([sys.executable, "-c", code], env=tree_env(), timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_checkout_reads_the_top_level_conf_and_lists_every_package() -> None:
    from lightning_swarm.cli.app import CONF_DIR

    assert CONF_DIR == ROOT / "conf"
    assert not (ROOT / "lightning_swarm" / "conf").exists()  # one copy only
    with open(ROOT / "pyproject.toml", "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "lightning_swarm").rglob("__init__.py")
    }
    assert found | {"lightning_swarm.conf"} == listed


def shipped_text(wheel: Path, name: str) -> str:
    """The text of one file inside ``wheel``."""
    return zipfile.ZipFile(wheel).read(name).decode()


def _build_wheel(tmp_path: Path) -> Path:
    """Build the wheel offline from a copy of what it is built from (the checkout stays clean)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("lightning_swarm", "conf"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    run_group(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(dist), str(src)],
        check=True, timeout=STEP_TIMEOUT_S,
    )  # fmt: skip
    (wheel,) = dist.glob("lightning_swarm-*.whl")
    return wheel


def _fresh_venv(tmp_path: Path) -> Path:
    """A new virtual environment that sees this interpreter's packages through a .pth file
    (plain path lines: the .pth files in there, such as an editable install of this checkout,
    are not run), so installing needs no network."""
    venv = tmp_path / "venv"
    run_group(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        check=True, timeout=STEP_TIMEOUT_S,
    )  # fmt: skip
    python = venv / "bin" / "python"
    site = run_group(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, timeout=STEP_TIMEOUT_S,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "outer_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


# Its five short steps (build, venv, its site folder, install, import) and the swarm-train run.
@pytest.mark.timeout(5 * STEP_TIMEOUT_S + RUN_TIMEOUT_S + 30)
def test_wheel_installs_offline_and_swarm_train_runs_outside_the_checkout(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "lightning_swarm/py.typed" in names
    # The license pyproject.toml names ships in the wheel's metadata, its text whole.
    (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert shipped_text(wheel, license_file) == (ROOT / "LICENSE").read_text()
    # conf/ (the one copy, at the top of the checkout) ships whole, byte for byte.
    shipped = zipfile.ZipFile(wheel)
    yaml = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "conf").rglob("*.yaml"))
    assert "conf/strategy/swarm.yaml" in yaml
    for name in yaml:
        assert shipped.read(f"lightning_swarm/{name}") == (ROOT / name).read_bytes(), name
    assert not any(n.startswith("conf/") for n in names)  # only inside the package

    venv = _fresh_venv(tmp_path)
    python = venv / "bin" / "python"
    # Without PYTHONPATH: a checkout on it (PYTHONPATH=. from the repository root) with a
    # lightning_swarm.egg-info left by an earlier build made pip take the wheel as installed.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run_group(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "-q", str(wheel)],
        env=env, check=True, timeout=STEP_TIMEOUT_S,
    )  # fmt: skip
    user = tmp_path / "elsewhere"  # a folder of a user's own, not the repository
    user.mkdir()
    where = run_group(
        [str(python), "-c", "import lightning_swarm; print(lightning_swarm.__file__)"],
        cwd=user, env=env, check=True, timeout=STEP_TIMEOUT_S,
    ).stdout.strip()  # fmt: skip
    assert Path(where).is_relative_to(venv), where  # the wheel's copy, not the checkout's

    done = run_group(
        [str(venv / "bin" / "swarm-train"), *TINY, "trainer.max_steps=2",
         "trainer.val_check_interval=2", "strategy.sync_every=1", "hydra.run.dir=run"],
        cwd=user, env=env, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "inner steps                              2" in done.stdout
    assert "outer steps                              2" in done.stdout
    assert (user / "run" / "summary.json").is_file()


def test_errors_raised_on_purpose_outside_option_checks_are_swarm_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The refusals that come later than ``SwarmConfig`` (at setup, at a step, on resume, from
    the environment) are ``SwarmError``s too, each keeping its builtin base."""
    import types

    import torch

    import lightning_swarm
    from lightning_swarm.outer.params import ParameterWatch
    from lightning_swarm.outer.sync import _build_outer_optimizer
    from lightning_swarm.resume.files import MMAP_ENV, resolve_mmap

    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    watch = ParameterWatch([optimizer], {"w": frozen})
    frozen.requires_grad_(True)
    with pytest.raises(lightning_swarm.SwarmConfigError, match="frozen_params='sync'") as thawed:
        watch.check(optimizer)
    assert isinstance(thawed.value, ValueError)

    monkeypatch.setenv(MMAP_ENV, "maybe")
    with pytest.raises(lightning_swarm.SwarmConfigError, match="set it to 0"):
        resolve_mmap(True)

    with pytest.raises(lightning_swarm.SwarmConfigTypeError, match="torch.optim.Optimizer") as bad:
        _build_outer_optimizer(lambda params: object(), {"w": torch.zeros(2)})  # type: ignore[arg-type, return-value]
    assert isinstance(bad.value, TypeError)

    trainer = types.SimpleNamespace(strategy=object())
    with pytest.raises(lightning_swarm.SwarmConfigTypeError, match="SwarmResume needs"):
        lightning_swarm.SwarmResume().setup(trainer, None, "fit")  # type: ignore[arg-type]
