"""How long a round may take over this link, and what a round that cannot finish says.

``LinkRate`` keeps the rate of this rank's last round (from its opening agreement to its last
bucket), from which ``LinkTimeouts`` derives the next round's bound unless the user set one;
``LinkWatch.explained`` turns torch's timeouts and closed connections into errors that say what
happened and what to do.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_swarm.errors import PeerLostError, RoundTimeoutError, SwarmError
from lightning_swarm.transport.departures import departures_text

# A round's rate varies with what shares the link and with TCP backing off: a live round is cut
# only below a quarter of the last round's rate, while a hung peer is found in a few round-times.
FACTOR = 4.0
# Before any round measured the link: 10 Mbit/s, the slowest link measured (docs/wan.md).
ASSUMED_RATE_BPS = 1.25e6


@dataclass(frozen=True)
class LinkTimeouts:
    """Where a transport's collective timeout comes from: the ``option`` that sets it (named in
    messages), its default ``floor_s`` (a derived timeout is never under it) and the value the
    user set, ``explicit_s`` (``None``: derived per round)."""

    option: str
    floor_s: float
    explicit_s: float | None = None

    def for_round(self, payload_bytes: int, rate_bps: float | None) -> float:
        """``explicit_s`` when the user set it, else ``FACTOR`` times the payload's time at
        ``rate_bps`` bytes per second (``None``: ``ASSUMED_RATE_BPS``), at least ``floor_s``."""
        if self.explicit_s is not None:
            return float(self.explicit_s)
        rate = ASSUMED_RATE_BPS if rate_bps is None or rate_bps <= 0 else rate_bps
        return max(float(self.floor_s), FACTOR * payload_bytes / rate)

    @property
    def base_s(self) -> float:
        """The bound of what does not grow with a payload (set-ups, small messages)."""
        return float(self.floor_s if self.explicit_s is None else self.explicit_s)


def _mbit(rate_bps: float) -> str:
    return f"{rate_bps * 8 / 1e6:.3g} Mbit/s"


def is_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    # gloo: "Timed out waiting 5000ms for recv ..."; NCCL: "collective operation timeout".
    return "timed out" in text or "operation timeout" in text


_PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
)


def is_peer_loss(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and any(t in str(err).lower() for t in _PEER_GONE)


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def peer_lost_message(where: str, gone: str, cause: BaseException) -> str:
    """``PeerLostError``'s message: ``where`` this rank was, ``gone`` who went away."""
    return (
        f"{where}: {gone} went away: its connection closed under a collective (its process "
        f"died or its link dropped; {first_line(cause)}).{departures_text()} A static run "
        "cannot continue without "
        "it. Restart the fit from the last checkpoint (ckpt_path=last), after finding why it "
        "stopped in that island's log; to train on through islands that die, use elastic "
        "islands (membership='torchft', docs/elastic.md)."
    )


class LinkRate:
    """The rate this rank's rounds crossed the link at. A round among fewer than two of
    ``num_islands`` measures nothing; the owner updates it when the group changes."""

    def __init__(self, *, num_islands: int) -> None:
        self.num_islands = num_islands
        self.rate_bps: float | None = None
        self.round_index = 0
        self.payload_bytes = 0
        self._started: float | None = None
        self._arrived: float | None = None

    def begin(self, round_index: int, names: Mapping[str, torch.Size]) -> None:
        self.finished()  # a round the engine streamed ends without ``agree``
        self.round_index = round_index
        self.payload_bytes = 4 * sum(int(torch.Size(s).numel()) for s in names.values())

    def started(self) -> None:
        self._started, self._arrived = time.perf_counter(), None

    def arrived(self) -> None:
        self._arrived = time.perf_counter()

    def discard(self) -> None:
        """The round failed part-way: it measures nothing."""
        self._started = self._arrived = None

    def finished(self) -> None:
        """The round is over (``agree``, or the next ``begin``): keep its rate."""
        started, arrived = self._started, self._arrived
        self._started = self._arrived = None
        if started is None or arrived is None or self.payload_bytes == 0:
            return
        if self.num_islands > 1 and arrived > started:
            self.rate_bps = self.payload_bytes / (arrived - started)


class LinkWatch(LinkRate):
    """A static transport's link rate, the timeout it sets on ``group`` (one rank per island;
    ``None``: the world) and its errors; ``timeouts=None`` leaves the group's own timeout."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        num_islands: int,
        timeouts: LinkTimeouts | None = None,
    ) -> None:
        super().__init__(num_islands=num_islands)
        self.group = group
        self.timeouts = timeouts
        self.timeout_s: float | None = None if timeouts is None else timeouts.explicit_s

    def open(self, round_index: int, names: Mapping[str, torch.Size]) -> None:
        """Round ``round_index`` over float32 tensors of ``names`` begins: bound the group's
        collectives by its timeout before any of them runs."""
        self.begin(round_index, names)
        t = self.timeouts
        if t is None or t.explicit_s is not None or self.num_islands <= 1:
            return
        timeout = t.for_round(self.payload_bytes, self.rate_bps)
        if timeout != self.timeout_s and set_group_timeout(self.group, timeout):
            self.timeout_s = timeout

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """Raise ``RoundTimeoutError`` for a collective's timeout and ``PeerLostError`` for a
        peer's closed connection; every other error passes unchanged."""
        try:
            yield
        except RuntimeError as err:
            if isinstance(err, SwarmError):
                raise
            if is_timeout(err):
                raise RoundTimeoutError(self.timeout_message(err)) from err
            if is_peer_loss(err):
                raise PeerLostError(self.peer_lost_message(err)) from err
            raise

    def _where(self) -> tuple[int | None, str]:
        """This rank's island (``None`` without torch.distributed), and how messages place it."""
        if not (dist.is_available() and dist.is_initialized()):
            return None, f"round {self.round_index}"
        island = dist.get_rank(self.group)
        return island, f"rank {dist.get_rank()}, island {island}, round {self.round_index}"

    def timeout_message(self, cause: BaseException) -> str:
        t = self.timeouts
        option = "timeout_s" if t is None else t.option
        timeout = "the process group's timeout"
        if self.timeout_s is not None:
            timeout = f"{option}={self.timeout_s:g} s"
        if self.rate_bps is None:
            rate = (
                f"no round had measured the link yet (a derived first-round timeout assumes "
                f"{_mbit(ASSUMED_RATE_BPS)})"
            )
        else:
            rate = (
                f"the last round measured {self.rate_bps / 1e6:.3g} MB/s ({_mbit(self.rate_bps)}), "
                f"so this payload needs about {self.payload_bytes / self.rate_bps:.3g} s"
            )
        if t is None:
            how = "the group's own"
        elif t.explicit_s is None:
            how = f"derived: {FACTOR:g}x the payload's time, at least {t.floor_s:g} s"
        else:
            how = "set explicitly"
        return (
            f"{self._where()[1]}: a collective of its "
            f"{self.payload_bytes:,}-byte payload waited {timeout} ({how}) and gave up "
            f"({first_line(cause)}); {rate}. A peer stopped or hung, or the link slowed below "
            f"what the timeout allows: look for the island whose log ends earliest; if the link "
            f"is just slow, set {option} above the payload's time at the link's rate."
        )

    def peer_lost_message(self, cause: BaseException) -> str:
        island, where = self._where()
        if island is not None and self.num_islands == 2:
            ranks = dist.get_process_group_ranks(self.group) if self.group is not None else [0, 1]
            gone = f"island {1 - island} (global rank {ranks[1 - island]})"
        else:
            others = [i for i in range(self.num_islands) if i != island]
            gone = f"one of islands {others} (the peer whose address torch names)"
        return peer_lost_message(where, gone, cause)


# torch's private names this package uses, here only (``set_backend_timeout``); elastic
# membership checks them up front with torchft's (``membership/torchft_private.py``).
TORCH_PRIVATE_NAMES: tuple[tuple[str, str, str], ...] = (
    ("torch.distributed", "ProcessGroup", "_get_backend"),
    ("torch.distributed", "ProcessGroupGloo", "_set_default_timeout"),
)


def set_backend_timeout(
    group: dist.ProcessGroup, timeout: datetime.timedelta, device: torch.device
) -> None:
    """Bound ``group``'s later collectives on ``device`` by ``timeout`` through torch's private
    ``ProcessGroup._get_backend`` and ``_set_default_timeout`` of its backend: torch takes a
    group's timeout at construction, and no public call changes it. If they change, a derived
    round timeout is not applied and an elastic group keeps its (shorter) connect timeout.

    Raises:
        AttributeError: this torch lacks one of those names.
    """
    backend = group._get_backend(device)
    backend._set_default_timeout(timeout)


def set_group_timeout(group: dist.ProcessGroup | None, timeout_s: float) -> bool:
    """Bound ``group``'s (``None``: the world's) later collectives by ``timeout_s`` with
    ``set_backend_timeout``; whether it could."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None
    device = torch.device("cuda" if dist.get_backend(pg) == "nccl" else "cpu")
    try:
        set_backend_timeout(pg, datetime.timedelta(seconds=timeout_s), device)
    except (AttributeError, RuntimeError):
        return False
    return True
