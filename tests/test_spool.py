"""The swarm spool: file format, permissions, leases, cleanup races and failure handling."""

from __future__ import annotations

import errno
import gc
import multiprocessing
import os
import re
import socket
import stat
import tempfile
import threading
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lightning_swarm.transport.aggregator.spool import Spool, filesystem_type
from lightning_swarm.transport.errors import SpoolError
from lightning_swarm.transport.payload import PayloadMap, byte_view, pack_chunk, unpack_chunk

WAIT_S = 20.0  # bound on every event wait: a hang fails the test instead of blocking the suite


def _payload(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(13, 9, generator=g),
        "layer.bias": torch.randn(13, generator=g),
        "scale": torch.randn((), generator=g),
        "half": torch.randn(6, generator=g).to(torch.bfloat16),
    }


def _write(spool: Spool, round_id: int, island: int, tensors: dict[str, torch.Tensor], chunk=40):
    layout = PayloadMap.from_tensors(tensors)
    views = [byte_view(t) for t in tensors.values()]
    buf = torch.empty(chunk, dtype=torch.uint8)
    with spool.writer(round_id, island, layout) as w:
        for k in range(layout.num_chunks(chunk)):
            n = pack_chunk(views, layout, k, chunk, buf)
            w.write(k * chunk, buf[:n])
        return w.commit()


# -- layout -------------------------------------------------------------------------------------
def test_chunks_cover_the_stream_exactly_and_unpack_is_the_inverse() -> None:
    tensors = _payload()
    layout = PayloadMap.from_tensors(tensors)
    views = [byte_view(t) for t in tensors.values()]
    for chunk in (1, 3, 40, 64, layout.data_bytes, layout.data_bytes + 5):
        out = {k: torch.zeros_like(v) for k, v in tensors.items()}
        targets = [byte_view(t) for t in out.values()]
        buf = torch.empty(chunk, dtype=torch.uint8)
        total = 0
        for k in range(layout.num_chunks(chunk)):
            n = pack_chunk(views, layout, k, chunk, buf)
            total += n
            unpack_chunk(buf[:n], layout, k, chunk, targets)
        assert total == layout.data_bytes
        assert all(torch.equal(out[k], tensors[k]) for k in tensors)


def test_description_round_trip_and_differences() -> None:
    layout = PayloadMap.from_tensors(_payload())
    assert PayloadMap.from_json(layout.to_json()) == layout
    other = dict(_payload())
    other["layer.bias"] = torch.zeros(14)
    assert "'layer.bias' is [14]" in str(layout.difference(PayloadMap.from_tensors(other)))
    del other["scale"]
    assert "missing ['scale']" in str(layout.difference(PayloadMap.from_tensors(other)))
    with pytest.raises(ValueError, match="not valid JSON"):
        PayloadMap.from_json(b"{nope")
    with pytest.raises(ValueError, match="malformed payload description entry"):
        PayloadMap.from_json(b'[["w", [-1], "F32"]]')
    with pytest.raises(ValueError, match="not contiguous"):
        PayloadMap.from_tensors({"t": torch.zeros(4, 4).t()})
    with pytest.raises(ValueError, match="cannot send"):
        PayloadMap.from_tensors({"c": torch.zeros(2, dtype=torch.complex64)})


# -- file format and permissions -------------------------------------------------------------
def test_file_is_byte_exact_safetensors_with_private_permissions(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    tensors = _payload(1)
    layout = PayloadMap.from_tensors(tensors)
    path = _write(spool, 3, 2, tensors)
    assert stat.S_IMODE(os.stat(spool.root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    header = layout.safetensors_header({"round": "3", "island": "2"})
    raw = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())
    assert path.read_bytes() == header + raw
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], t.reshape(-1)) for k, t in tensors.items())
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"round": "3", "island": "2"}
    assert spool.disk_bytes == len(header) + layout.data_bytes == spool.peak_disk_bytes
    spool.close()


def test_reader_copies_element_ranges_into_caller_tensors(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    tensors = _payload(2)
    layout = PayloadMap.from_tensors(tensors)
    _write(spool, 0, 1, tensors)
    with spool.reader(0, 1, layout, remap_bytes=8) as reader:
        out = torch.empty(50)
        reader.read_into(layout.specs[0], 30, out)
        assert torch.equal(out, tensors["layer.weight"].reshape(-1)[30:80])
        half = torch.empty(6, dtype=torch.bfloat16)
        reader.read_into(layout.specs[3], 0, half)
        assert torch.equal(half, tensors["half"])
    with pytest.raises(SpoolError, match="reader of .* is closed"):
        reader.read_into(layout.specs[3], 0, half)
    spool.close()


def test_round_cleanup_close_and_finalizer_remove_everything(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    _write(spool, 0, 1, _payload())
    _write(spool, 1, 1, _payload())
    spool.release_round(0)
    assert [p.name for p in spool.files()] == ["round000001-island0001.safetensors"]
    with pytest.raises(SpoolError, match="round 0 is already cleaned up"):
        spool.writer(0, 2, PayloadMap.from_tensors(_payload()))
    root = spool.root
    spool.close()
    spool.close()  # idempotent
    assert not root.exists() and spool.disk_bytes == 0
    forgotten = Spool(tmp_path)
    _write(forgotten, 0, 1, _payload())
    root = forgotten.root
    del forgotten
    gc.collect()
    assert not root.exists(), "the finalizer must remove a spool nobody closed"


# -- environment checks ----------------------------------------------------------------------
def test_filesystem_type_uses_the_longest_mount_prefix() -> None:
    mounts = (
        "/dev/vda / ext4 rw 0 0\ntmpfs /scratch tmpfs rw 0 0\n/dev/sdb /scratch/disk xfs rw 0 0\n"
    )
    assert filesystem_type("/scratch/run", mounts) == "tmpfs"
    assert filesystem_type("/scratch/disk/run", mounts) == "xfs"
    assert filesystem_type("/scratchy", mounts) == "ext4"


@pytest.mark.skipif(filesystem_type("/dev/shm") != "tmpfs", reason="/dev/shm is not tmpfs here")
def test_spool_on_tmpfs_warns() -> None:
    with pytest.warns(RuntimeWarning, match=r"on tmpfs, which lives in RAM.*set spool_dir"):
        spool = Spool("/dev/shm")
    spool.close()


def test_unwritable_spool_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(SpoolError, match=r"cannot create the spool under spool_dir=.*writable"):
        Spool(blocker / "spool")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_spool_dir_is_a_clear_error(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(SpoolError, match="cannot create the spool under spool_dir"):
        Spool(locked)


NOBODY = 65534  # the conventional unprivileged uid/gid; needs no passwd entry


def _spool_as_unprivileged_user(base: str, out: Connection) -> None:
    """Forked child: drop root (if held) so directory permissions apply, then try the spool."""
    try:
        if os.geteuid() == 0:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        Spool(base)
        out.send("no error: the spool was created")
    except SpoolError as err:
        out.send(str(err))
    except OSError as err:
        out.send(f"could not drop privileges: {err}")
    finally:
        out.close()


def test_read_only_spool_dir_is_a_clear_error_even_as_root() -> None:
    """The same path as above where CI runs it (as root): a child that gave up root meets a
    directory it may not write, exactly like an ordinary user does."""
    context = multiprocessing.get_context("fork")
    # Outside pytest's tmp_path, whose parents are private to root: nobody must reach ``locked``.
    with tempfile.TemporaryDirectory(prefix="spool-perm-") as parent:
        os.chmod(parent, 0o755)
        locked = Path(parent) / "locked"
        locked.mkdir(mode=0o555)
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_spool_as_unprivileged_user, args=(str(locked), send))
        child.start()
        send.close()
        message = receive.recv() if receive.poll(WAIT_S) else "the child did not answer"
        child.join(WAIT_S)
        assert list(locked.iterdir()) == [], "a failed spool left something behind"
    assert child.exitcode == 0
    assert re.fullmatch(
        rf"cannot create the spool under spool_dir='{re.escape(str(locked))}' \(Permission "
        r"denied\); point spool_dir at a writable local directory, or leave it unset to use TMPDIR",
        message,
    ), message


# -- failures leave no partial file ----------------------------------------------------------
def _failing_write(after_calls: int, code: int):
    calls = {"n": 0}

    def write_at(fd: int, data: memoryview, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] > after_calls:
            raise OSError(code, os.strerror(code))
        return os.pwrite(fd, data, offset)

    return write_at


def test_disk_full_while_writing_removes_the_file(tmp_path: Path) -> None:
    spool = Spool(tmp_path, write_at=_failing_write(3, errno.ENOSPC))
    with pytest.raises(SpoolError, match=r"out of disk space \(ENOSPC\).*free space"):
        _write(spool, 0, 1, _payload())
    assert spool.files() == [] and spool.disk_bytes == 0
    spool.close()


def test_disk_full_at_preallocation_removes_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = Spool(tmp_path)

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(SpoolError, match=r"ENOSPC.*creating round000000-island0001"):
        spool.writer(0, 1, PayloadMap.from_tensors(_payload()))
    assert spool.files() == [] and spool.disk_bytes == 0
    spool.close()


def test_permission_lost_while_writing_is_a_clear_error(tmp_path: Path) -> None:
    spool = Spool(tmp_path, write_at=_failing_write(1, errno.EACCES))
    with pytest.raises(SpoolError, match="is not writable .*set spool_dir to a writable"):
        _write(spool, 0, 1, _payload())
    assert spool.files() == []
    spool.close()


def test_short_writes_are_completed(tmp_path: Path) -> None:
    def tiny_writes(fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data[:5], offset)

    spool = Spool(tmp_path, write_at=tiny_writes)
    tensors = _payload(4)
    path = _write(spool, 0, 1, tensors)
    assert all(torch.equal(load_file(path)[k], t.reshape(-1)) for k, t in tensors.items())
    spool.close()


def test_incomplete_or_out_of_range_writes_publish_nothing(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    layout = PayloadMap.from_tensors(_payload())
    writer = spool.writer(0, 1, layout)
    writer.write(0, torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(SpoolError, match=f"incomplete: 10 of {layout.data_bytes} payload bytes"):
        writer.commit()
    writer = spool.writer(0, 2, layout)
    with pytest.raises(SpoolError, match="lies outside the"):
        writer.write(layout.data_bytes - 2, torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(SpoolError, match="no committed spool file"):
        spool.reader(0, 2, layout)
    assert spool.files() == []
    spool.close()


def test_truncated_and_corrupt_files_are_refused(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    tensors = _payload()
    layout = PayloadMap.from_tensors(tensors)
    path = _write(spool, 0, 1, tensors)
    size = path.stat().st_size
    os.truncate(path, size - 4)
    with pytest.raises(SpoolError, match=rf"is truncated: {size - 4} of {size} bytes"):
        spool.reader(0, 1, layout)
    os.truncate(path, 20)
    with pytest.raises(SpoolError, match="is truncated inside its header"):
        spool.reader(0, 1, layout)
    path = _write(spool, 0, 2, tensors)
    blob = bytearray(path.read_bytes())
    blob[blob.index(b"layer.bias")] ^= 0x20  # 'l' -> 'L': a flipped bit in the header
    path.write_bytes(bytes(blob))
    with pytest.raises(SpoolError, match="is corrupt: its header does not describe"):
        spool.reader(0, 2, layout)
    path = _write(spool, 0, 3, tensors)
    with open(path, "ab") as f:
        f.write(b"junk")
    with pytest.raises(SpoolError, match="corrupt \\(longer than its layout\\)"):
        spool.reader(0, 3, layout)
    spool.release_round(0)
    assert spool.files() == []
    spool.close()


# -- leases ----------------------------------------------------------------------------------
def test_cleanup_deadline_defers_deletion_of_a_file_in_use(tmp_path: Path) -> None:
    spool = Spool(tmp_path, cleanup_timeout_s=0.01)
    tensors = _payload()
    layout = PayloadMap.from_tensors(tensors)
    path = _write(spool, 0, 1, tensors)
    reader = spool.reader(0, 1, layout)
    with pytest.warns(RuntimeWarning, match=r"1 file\(s\) are still in use"):
        spool.release_round(0)
    assert path.exists(), "a leased file must survive the deadline"
    out = torch.empty(13)
    reader.read_into(layout.specs[1], 0, out)
    assert torch.equal(out, tensors["layer.bias"])
    reader.close()
    assert not path.exists() and spool.disk_bytes == 0
    reader2 = None
    path = _write(spool, 1, 1, tensors)
    reader2 = spool.reader(1, 1, layout)
    with pytest.warns(RuntimeWarning, match="still in use"):
        spool.close()
    assert path.exists() and spool.root.exists()
    reader2.close()
    assert not spool.root.exists(), "the last release after close removes the root"


class _RaceRound:
    """One round of the race: ``islands`` writers and as many readers on a shared spool."""

    def __init__(self, spool: Spool, round_id: int, islands: int, outcomes: Counter[str]):
        self.spool, self.round_id, self.outcomes = spool, round_id, outcomes
        self.payloads = {i: _payload(seed=round_id * 10 + i) for i in range(islands)}
        self.layout = PayloadMap.from_tensors(self.payloads[0])
        self.leased = [threading.Event() for _ in range(islands)]
        self.committed = [threading.Event() for _ in range(islands)]
        self.reading = [threading.Event() for _ in range(islands)]
        self.done = [threading.Event() for _ in range(islands)]
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()

    def note(self, key: str) -> None:
        with self.lock:
            self.outcomes[key] += 1

    def write(self, i: int) -> None:
        try:
            views = [byte_view(t) for t in self.payloads[i].values()]
            buf = torch.empty(16, dtype=torch.uint8)
            writer = self.spool.writer(self.round_id, i, self.layout)
            self.leased[i].set()
            for k in range(self.layout.num_chunks(16)):
                n = pack_chunk(views, self.layout, k, 16, buf)
                writer.write(k * 16, buf[:n])
            writer.commit()
            self.note("written")
        except BaseException as err:
            self.errors.append(err)
        finally:
            self.leased[i].set()
            self.committed[i].set()

    def read(self, i: int) -> None:
        try:
            assert self.committed[i].wait(WAIT_S)
            try:
                reader = self.spool.reader(self.round_id, i, self.layout, remap_bytes=64)
            except SpoolError as err:
                assert "already cleaned up" in str(err), err
                self.note("read_refused")
                return
            finally:
                self.reading[i].set()
            with reader:
                for spec in self.layout.specs:
                    out = torch.empty(spec.numel, dtype=spec.dtype)
                    for s in range(0, spec.numel, 8):
                        reader.read_into(spec, s, out[s : s + 8])
                    expected = self.payloads[i][spec.name].reshape(-1)
                    assert torch.equal(out, expected), "a read returned wrong bytes"
            self.note("read")
        except BaseException as err:
            self.errors.append(err)
        finally:
            self.reading[i].set()
            self.done[i].set()


def test_cleanup_racing_with_writes_and_reads(tmp_path: Path) -> None:
    """Many rounds of 3 writers + 3 readers, with cleanup started mid-write, mid-read or after.

    Invariants: an operation that got its lease completes with the right bytes (no lost
    contribution, never FileNotFoundError); one that did not is refused with a SpoolError at
    acquisition; no file survives.
    """
    spool = Spool(tmp_path, cleanup_timeout_s=WAIT_S)
    islands, iterations = 3, 90
    outcomes: Counter[str] = Counter()
    errors: list[BaseException] = []
    for r in range(iterations):
        race = _RaceRound(spool, r, islands, outcomes)
        threads = [threading.Thread(target=race.write, args=(i,)) for i in range(islands)]
        threads += [threading.Thread(target=race.read, args=(i,)) for i in range(islands)]
        for t in threads:
            t.start()
        # mode 0: cleanup while writes are in flight; 1: while reads are; 2: after everything
        gate = (race.leased, race.reading, race.done)[r % 3]
        assert all(e.wait(WAIT_S) for e in gate)
        spool.release_round(r)
        for t in threads:
            t.join(WAIT_S)
            assert not t.is_alive()
        errors += race.errors
        assert not [p for p in spool.files() if p.name.startswith(f"round{r:06d}")]
    assert not errors, errors[:3]
    assert outcomes["written"] == islands * iterations, "a leased write was lost"
    assert outcomes["read"] + outcomes["read_refused"] == islands * iterations
    assert outcomes["read"] >= islands * iterations * 2 // 3
    assert spool.cleanup_waits > 0, "the race was never exercised"
    assert spool.files() == [] and spool.disk_bytes == 0
    spool.close()


# -- roots left by killed runs ----------------------------------------------------------------
def _dead_pid() -> int:
    child = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    child.start()
    child.join()
    assert child.pid is not None
    return child.pid


def test_a_new_spool_sweeps_roots_of_dead_runs_of_this_user_only(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead = _dead_pid()
    roots = {
        "dead, this host": f"lightning_swarm-{dead}@{host}-abcd1234",
        "dead, no host (older name)": f"lightning_swarm-{dead}-efgh5678",
        "dead, other host": f"lightning_swarm-{dead}@elsewhere-ijkl9012",
        "live": f"lightning_swarm-{os.getppid()}@{host}-mnop3456",
        "not a root": f"lightning_swarm-{dead}@{host}-toolongsuffix",
        "another user's": f"lightning_swarm-{dead}@{host}-qrst7890",
    }
    for name in roots.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "round000000-island0001.safetensors").write_bytes(b"x")
    other_user = os.geteuid() == 0
    if other_user:
        os.chown(tmp_path / roots["another user's"], NOBODY, NOBODY)
    spool = Spool(tmp_path)
    left = {p.name for p in tmp_path.iterdir()} - {spool.root.name}
    assert sorted(p.name for p in spool.swept) == sorted(
        [roots["dead, this host"], roots["dead, no host (older name)"]]
        + ([] if other_user else [roots["another user's"]])
    )
    kept = {"dead, other host", "live", "not a root"} | (
        {"another user's"} if other_user else set()
    )
    assert left == {roots[k] for k in kept}
    assert re.fullmatch(
        rf"lightning_swarm-{os.getpid()}@{re.escape(host)}-\w{{8}}", spool.root.name
    )
    spool.close()


def test_spool_dir_expands_the_home_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    spool = Spool("~/spools")
    assert spool.root.parent == tmp_path / "spools"
    assert not (tmp_path / "~").exists()
    spool.close()
