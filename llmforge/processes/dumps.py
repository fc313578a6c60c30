"""What a rank leaves behind when its launcher finds the job hung: every thread's Python stack
(``faulthandler`` on SIGUSR1, written from the signal handler, so even a rank stuck in C code or
holding the GIL answers) and torch's flight recorder (the last collectives of every process
group, with their state: ``torch._C._distributed_c10d._dump_fr_trace``, the dump NCCL writes on
a timeout, here on request and on gloo too), read by ``python -m torch.distributed.flight_recorder.fr_trace``.

The launcher asks by writing ``dump-request`` (holding the destination folder) into the error
folder and sending SIGUSR1; each rank's watch thread (``llmforge.processes.watch``) answers the
request with the flight recorder dump.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
from dataclasses import dataclass
from pathlib import Path

DUMP_SIGNAL = signal.SIGUSR1
REQUEST = "dump-request"
FLIGHT_RECORDER = "flight_recorder"
#: Entries each process group's flight recorder keeps (torch's TORCH_FR_BUFFER_SIZE; 0 = off).
FR_ENTRIES = "2000"


def stack_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"stack-rank{rank}.txt"


def flight_recorder_env(*, cuda: bool, timeout_dump: Path | None) -> dict[str, str]:
    """Environment for the ranks: the flight recorder on (gloo and NCCL); under NCCL also its
    own dump when a collective times out, into ``timeout_dump`` (a file prefix). (torch 2.13 reads
    TORCH_FR_* and warns that the older TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated.)"""
    env = {"TORCH_FR_BUFFER_SIZE": FR_ENTRIES}
    if cuda and timeout_dump is not None:
        env |= {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": str(timeout_dump)}
    return env


class RankDumps:
    """This rank's side: the stack file armed on SIGUSR1, and answers to dump requests."""

    def __init__(self, folder: Path, *, rank: int) -> None:
        self.folder, self.rank = Path(folder), rank
        self._stacks = open(stack_path(self.folder, rank), "w")  # noqa: SIM115 - held open for the signal handler
        faulthandler.register(DUMP_SIGNAL, file=self._stacks, all_threads=True, chain=False)
        self._answered = ""

    def answer(self) -> None:
        """Write the flight recorder dump into the requested folder, once per request."""
        with contextlib.suppress(OSError):
            wanted = (self.folder / REQUEST).read_text().strip()
            if wanted and wanted != self._answered:
                self._answered = wanted
                write_flight_recorder(Path(wanted) / FLIGHT_RECORDER, rank=self.rank)


def write_flight_recorder(folder: Path, *, rank: int) -> Path | None:
    """This process's flight recorder as ``folder/rank_R`` (the analyser's one file per rank), or None
    when torch records nothing (no process group, or the recorder off)."""
    try:
        import torch
        import torch._C._distributed_c10d as c10d_c
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        # NCCL keeps its own recorder (CUDA builds); gloo's and the others' is the generic one
        nccl = torch.cuda.is_available() and torch.cuda.is_initialized() and hasattr(c10d_c, "_dump_nccl_trace")
        dump = c10d_c._dump_nccl_trace if nccl else c10d_c._dump_fr_trace
        data = _with_groups(dump(True, True, False))
    except Exception:  # noqa: BLE001 - a dump is best effort: the stacks and the message still go out
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank_{rank}"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def _with_groups(data: bytes) -> bytes:
    """The dump with its process groups described (name, description, global ranks) where torch left
    that out (gloo groups): the analyser matches every rank's collectives by them."""
    import pickle

    import torch.distributed.distributed_c10d as c10d

    dump = pickle.loads(data)
    config = dump.get("pg_config") or {}
    for group, name in c10d._world.pg_names.items():
        if name not in config:
            ranks = sorted(c10d._world.pg_group_ranks.get(group, {}))
            config[name] = {"name": name, "desc": getattr(group, "group_desc", ""), "ranks": str(ranks)}
    dump["pg_config"] = {k: v for k, v in config.items() if k}
    return pickle.dumps(dump)


@dataclass(frozen=True)
class InFlight:
    """What one rank's flight recorder says of a process group: its newest collective issued and
    completed, and the name of the oldest one under way."""

    group: str
    issued: int
    completed: int
    name: str


def in_flight(path: Path) -> list[InFlight]:
    """Per process group of a flight recorder dump, its collectives issued and completed (none if unreadable)."""
    import pickle

    out = []
    with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError, AttributeError):
        dump = pickle.loads(path.read_bytes())
        names = {(e["process_group"][0], e["collective_seq_id"]): e["profiling_name"] for e in dump["entries"]}
        for group, status in dump["pg_status"].items():
            issued, completed = int(status["last_enqueued_collective"]), int(status["last_completed_collective"])
            out.append(InFlight(group, issued, completed, names.get((group, completed + 1), "")))
    return out
