"""The job's progress across nodes: each node's launcher publishes its ranks' progress (once a
second) in torch.distributed.elastic's rendezvous store, the TCPStore that the c10d rendezvous
serves at ``cluster.rdzv_endpoint``, under a prefix of its own; a launcher that finds a hang
names every rank of the job in its message and announces the hang there, and the others then
dump and stop their ranks too (``llmforge.processes.watch.RankMonitor``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmforge.processes.progress import Progress

_PUBLISH_S = 1.0
_RETRY_S = 5.0


@dataclass(frozen=True)
class Notice:
    """A hang announced by a node: for which attempt, where the dumps go, and who found it."""

    attempt: int
    dest: Path
    node: str


class NodeBoard:
    """This node's view in the store, and the others' (``store``: a ready one and ``node``: its name, for tests)."""

    def __init__(self, *, endpoint: str | None, run_id: str, store: Any = None, node: str = "") -> None:
        self.endpoint, self.prefix = endpoint, f"llmforge/{run_id}/"
        self.node = node or f"{socket.gethostname()}:{os.getpid()}"
        self._store, self._next_try, self._published = store, 0.0, 0.0
        self._joined = False

    def publish(self, progress: dict[int, Progress]) -> None:
        """This node's ranks, at most once a second."""
        store = self._connected()
        if store is None or time.monotonic() - self._published < _PUBLISH_S:
            return
        self._published = time.monotonic()
        view = {"at": time.time(), "ranks": [asdict(p) for p in progress.values()]}
        with contextlib.suppress(Exception):
            if not self._joined:
                store.append(self.prefix + "nodes", self.node + ",")
                self._joined = True
            store.set(self.prefix + "node/" + self.node, json.dumps(view))

    def others(self) -> dict[int, Progress]:
        """The other nodes' ranks as last published, their ages grown by the time since."""
        store = self._connected()
        out: dict[int, Progress] = {}
        if store is None:
            return out
        with contextlib.suppress(Exception):
            nodes = [n for n in store.get(self.prefix + "nodes").decode().split(",") if n and n != self.node]
            for node in nodes:
                view = json.loads(store.get(self.prefix + "node/" + node))
                late = max(0.0, time.time() - view["at"])
                for fields in view["ranks"]:
                    p = Progress(**{**fields, "age_s": fields["age_s"] + late})
                    out[p.rank] = p
        return out

    def announce(self, *, attempt: int, dest: Path) -> None:
        store = self._connected()
        with contextlib.suppress(Exception):
            if store is not None:
                store.set(self.prefix + "hang", json.dumps({"attempt": attempt, "dest": str(dest), "node": self.node}))

    def announced(self) -> Notice | None:
        """The hang another node announced, if any."""
        store = self._connected()
        with contextlib.suppress(Exception):
            if store is not None and store.check([self.prefix + "hang"]):
                notice = json.loads(store.get(self.prefix + "hang"))
                if notice["node"] != self.node:
                    return Notice(attempt=int(notice["attempt"]), dest=Path(notice["dest"]), node=notice["node"])
        return None

    def _connected(self) -> Any:
        """The store, connected on first use (the agent serves it once torchrun starts); None until then."""
        if self._store is not None or self.endpoint is None or time.monotonic() < self._next_try:
            return self._store
        self._next_try = time.monotonic() + _RETRY_S
        host, _, port = self.endpoint.rpartition(":")
        with contextlib.suppress(Exception):
            from datetime import timedelta

            from torch.distributed import TCPStore

            self._store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=2), wait_for_workers=False)
        return self._store
