"""`cgturn metrics --listen HOST:PORT` (or `--once`): Prometheus exposition of turns and kills.

Serves `/metrics` over HTTP until SIGINT/SIGTERM (exit 0). Port 0 picks a free port; the address
actually bound is printed on the first line of stdout. `--once` prints one exposition to stdout
instead (for node_exporter's textfile collector). Read-only: it never recovers or kills.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from . import common


def register(sub) -> None:
    p = sub.add_parser("metrics", help="serve Prometheus metrics (turns, usage, kills from the audit log)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--listen", type=listen_address, metavar="HOST:PORT",
                       help="address to serve /metrics on, e.g. 127.0.0.1:9464 or [::1]:9464")
    where.add_argument("--once", action="store_true", help="print the exposition once and exit")
    p.set_defaults(handler=run)


def listen_address(text: str) -> tuple[str, int]:
    """Parse HOST:PORT (IPv6 hosts in brackets) into (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise argparse.ArgumentTypeError(f"put an IPv6 host in brackets: {text!r}")
    if not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port 0-65535, got {text!r}")
    return host, int(port)


def run(args) -> int:
    from prometheus_client import generate_latest, start_http_server

    from ..metrics import make_registry

    manager = common.make_manager(args)
    lock = threading.Lock()  # scrapes run in server threads; one manager call at a time

    def list_turns():
        with lock:
            return manager.turns(detail=True)  # usage and pressure of every turn, for the governance series

    try:
        registry = make_registry(list_turns, manager.state_dir)
        if args.once:
            sys.stdout.write(generate_latest(registry).decode())
            return common.EXIT_OK
        host, port = args.listen
        try:
            server, _thread = start_http_server(port, addr=host, registry=registry)
        except OSError as err:
            print(f"cgturn: cannot listen on {host}:{port}: {err.strerror or err}", file=sys.stderr)
            return common.EXIT_FAILED
        bound = server.server_address
        addr = str(bound[0])  # an AF_INET or AF_INET6 address: always a str
        shown = f"[{addr}]" if ":" in addr else addr
        print(f"serving metrics on http://{shown}:{bound[1]}/metrics", flush=True)
        _wait_for_stop()
        server.shutdown()
        server.server_close()
        return common.EXIT_OK
    finally:
        manager.close()


def _wait_for_stop() -> None:
    """Block until SIGINT or SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(3600):
        pass
