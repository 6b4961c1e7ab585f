"""``swarm-lighthouse``: torchft's ``LighthouseServer``, where elastic islands meet.

Keep ``--join-timeout-ms`` above one round's time: a shorter one forms quorums without live
islands (``docs/elastic.md``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="swarm-lighthouse", description="Serve the lighthouse of elastic islands."
    )
    parser.add_argument("--min-islands", type=int, default=2)
    parser.add_argument("--port", type=int, default=29510)
    parser.add_argument("--bind", default="[::]", help="address to bind (default all)")
    parser.add_argument("--join-timeout-ms", type=int, default=60_000)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5_000)
    parser.add_argument("--quorum-tick-ms", type=int, default=100)
    args = parser.parse_args(argv)
    for name in ("min_islands", "join_timeout_ms", "heartbeat_timeout_ms", "quorum_tick_ms"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.port < 65536:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        sys.exit("swarm-lighthouse needs torchft: pip install 'lightning-swarm[elastic]'")
    try:
        server = LighthouseServer(
            bind=f"{args.bind}:{args.port}",
            min_replicas=args.min_islands,
            join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        )
    except RuntimeError as err:
        sys.exit(f"swarm-lighthouse could not bind {args.bind}:{args.port}: {err}")
    print(f"lighthouse at {server.address()} (min islands {args.min_islands})", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
