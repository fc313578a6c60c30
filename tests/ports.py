"""Free loopback ports for tests that start their own rendezvous or server."""

from __future__ import annotations

import os
import random
import socket


def _worker_ports() -> range:
    """This test worker's own slice of ports below the kernel's ephemeral range: the system never
    hands these to an outgoing connection (gloo opens many), and no other pytest-xdist worker
    picks from the same slice, so a port found free stays free until the test binds it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    start = 15000 + 1000 * (int(worker) % 16 if worker.isdigit() else 0)
    return range(start, start + 1000)


def pick_free_port() -> int:
    """A TCP port on loopback that nothing listens on right now, from this worker's slice."""
    ports = list(_worker_ports())
    random.shuffle(ports)
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports[0]}-{ports[-1]}")
