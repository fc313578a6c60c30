"""Pipeline schedules: microbatches in flight, bubble fraction, and a slot timeline.

Bubble fractions are the idle share of a step (idle / (idle + work)):

- ``gpipe``, ``1f1b``: (p-1) / (m+p-1) (Huang et al. 2019; Narayanan et al. 2021);
- ``interleaved_1f1b``, ``looped_bfs`` with v chunks per rank: (p-1) / (v*m+p-1)
  (Narayanan et al. 2021; Lamy-Poirier 2023);
- ``zb_interleaved``: ZB-H1 (Qi et al. 2024): the bubble shrinks to
  (p-1)(T_F+T_B-T_W), T_B the input-gradient and T_W the weight-gradient time;
- ``zbv``: ZB-V (Qi et al. 2024): (p-1)(T_F+T_B-2T_W), two chunks per rank.

With T_F = 1 per chunk, the full backward is 2 of which the weight-gradient part
is ``w`` (the share of the forward FLOPs in weight matmuls: 1 for a pure-matmul
layer, less where attention has no weights), so T_B = 2 - w and T_W = w.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmforge.config.choices import Schedule
from llmforge.layout import ZERO_BUBBLE_SCHEDULES, Layout, stage_ids


def inflight_microbatches(layout: Layout, *, stage: int, microbatches: int) -> float:
    """Microbatches whose activations rank ``stage`` holds at its peak, in whole-stage units."""
    p, v, m = layout.pp, layout.pp_virtual_stages, microbatches
    if p == 1:
        return 1.0
    sched = layout.pp_schedule
    if sched in (Schedule.GPIPE, Schedule.LOOPED_BFS):
        return float(m)
    if sched == Schedule.ONE_F_ONE_B:
        return float(min(m, p - stage))
    if sched == Schedule.ZBV:
        return float(min(m, p))
    chunks = min(m * v, (v - 1) * p + 2 * (p - 1 - stage) + 1)  # Megatron/torch warm-up + one
    if sched == Schedule.ZB_INTERLEAVED:
        chunks = min(m * v, chunks + 1)  # a weight-gradient step deferred keeps one more input
    return chunks / v


def bubble_fraction(layout: Layout, microbatches: int, *, w: float = 1.0) -> float:
    """Idle share of the step for the layout's schedule (see the module docstring)."""
    p, v, m = layout.pp, layout.pp_virtual_stages, microbatches
    if p == 1:
        return 0.0
    if layout.pp_schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        return (p - 1) / (m + p - 1)
    if layout.pp_schedule in (Schedule.INTERLEAVED_1F1B, Schedule.LOOPED_BFS):
        return (p - 1) / (v * m + p - 1)
    per_chunk = 3.0  # T_F + T_B + T_W
    if layout.pp_schedule == Schedule.ZB_INTERLEAVED:
        idle = (p - 1) * (1 + (2 - w) - w) / per_chunk
    else:  # zbv
        idle = (p - 1) * max(0.0, 1 + (2 - w) - 2 * w) / per_chunk
    return idle / (v * m + idle)


@dataclass(frozen=True)
class Slot:
    """One action on one rank: kind F/B/W, microbatch, model chunk, start and length in time units."""

    kind: str
    microbatch: int
    chunk: int
    start: int
    length: int


#: (kind F/B/W, microbatch, chunk): one action of a schedule.
Action = tuple[str, int, int]
#: When each finished action ended.
Done = dict[Action, int]
#: Per rank: the (microbatch, chunk) of the weight gradients it deferred.
Deferred = dict[int, list[tuple[int, int]]]


def _order(schedule: str, p: int, v: int, m: int, rank: int) -> list[Action]:
    """The (kind, microbatch, local chunk index) sequence a rank executes."""
    if schedule == Schedule.GPIPE:
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule == Schedule.LOOPED_BFS:
        return [("F", i, c) for c in range(v) for i in range(m)] + [("B", i, c) for c in reversed(range(v)) for i in range(m)]
    if schedule == Schedule.ONE_F_ONE_B:
        return _one_f_one_b([("F", i, 0) for i in range(m)], [("B", i, 0) for i in range(m)], min(m, p - 1 - rank))
    fwd = [("F", (k // (p * v)) * p + k % p, (k // p) % v) for k in range(m * v)]
    bwd = [("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v) for k in range(m * v)]
    return _one_f_one_b(fwd, bwd, min(m * v, (v - 1) * p + 2 * (p - 1 - rank)))


def _one_f_one_b(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    out = list(fwd[:warmup])
    f, b = warmup, 0
    while f < len(fwd) or b < len(bwd):
        if f < len(fwd):
            out.append(fwd[f])
            f += 1
        if b < len(bwd):
            out.append(bwd[b])
            b += 1
    return out


def simulate(layout: Layout, microbatches: int) -> dict[int, list[Slot]]:
    """Run the schedule with unit forward time per chunk (backward 2, or B 1 + W 1 for zero-bubble)."""
    p, v, m, sched = layout.pp, layout.pp_virtual_stages, microbatches, layout.pp_schedule
    if sched == Schedule.ZBV:
        return _simulate_greedy(p, m)
    nchunks = p * v
    split = sched in ZERO_BUBBLE_SCHEDULES
    orders = {r: _order(sched, p, v, m, r) for r in range(p)}
    local = {r: stage_ids(pp_rank=r, pp=p, virtual=v, schedule=sched) for r in range(p)}
    done: Done = {}
    slots: dict[int, list[Slot]] = {r: [] for r in range(p)}
    pending_w: Deferred = {r: [] for r in range(p)}
    clock, pos = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            progress |= _advance(r, orders, local, done, slots, clock, pos, pending_w, split=split, nchunks=nchunks)
    for r in range(p):
        for mb, chunk in pending_w[r]:
            slots[r].append(Slot("W", mb, chunk, clock[r], 1))
            clock[r] += 1
    return slots


def _ready_time(kind: str, mb: int, chunk: int, done: Done, nchunks: int) -> int | None:
    if kind == "F":
        return 0 if chunk == 0 else done.get(("F", mb, chunk - 1))
    after = done.get(("F", mb, chunk))
    nxt = after if chunk == nchunks - 1 else done.get(("B", mb, chunk + 1))
    return None if after is None or nxt is None else max(after, nxt)


def _advance(
    r: int,
    orders: dict[int, list[Action]],
    local: dict[int, list[int]],
    done: Done,
    slots: dict[int, list[Slot]],
    clock: list[int],
    pos: list[int],
    pending_w: Deferred,
    *,
    split: bool,
    nchunks: int,
) -> bool:
    if pos[r] >= len(orders[r]):
        return False
    kind, mb, idx = orders[r][pos[r]]
    chunk = local[r][idx]
    ready = _ready_time(kind, mb, chunk, done, nchunks)
    if ready is None:
        return False
    while split and pending_w[r] and clock[r] < ready:  # fill the wait with deferred weight gradients
        wmb, wchunk = pending_w[r].pop(0)
        slots[r].append(Slot("W", wmb, wchunk, clock[r], 1))
        clock[r] += 1
    length = 1 if kind == "F" or split else 2
    start = max(clock[r], ready)
    slots[r].append(Slot(kind, mb, chunk, start, length))
    clock[r] = start + length
    done[(kind, mb, chunk)] = clock[r]
    if split and kind == "B":
        pending_w[r].append((mb, chunk))
    pos[r] += 1
    return True


def simulated_bubble(slots: dict[int, list[Slot]]) -> float:
    """Idle share of the simulated step (busy time over ranks x makespan)."""
    end = max(s.start + s.length for row in slots.values() for s in row)
    busy = sum(s.length for row in slots.values() for s in row)
    return 1 - busy / (end * len(slots))


def _simulate_greedy(p: int, m: int) -> dict[int, list[Slot]]:
    """ZB-V: two chunks per rank in a V; each free rank runs a ready B first, then a ready F
    while it holds fewer than 2p chunk activations, else a deferred W, else idles one unit."""
    nchunks = 2 * p
    done: Done = {}
    local = {r: tuple(stage_ids(pp_rank=r, pp=p, virtual=2, schedule=Schedule.ZBV)) for r in range(p)}
    slots: dict[int, list[Slot]] = {r: [] for r in range(p)}
    pending_w: Deferred = {r: [] for r in range(p)}
    held, busy_until = [0] * p, [0] * p
    next_f = {c: 0 for c in range(nchunks)}
    next_b = {c: 0 for c in range(nchunks)}
    t, total = 0, 3 * nchunks * m
    while sum(len(x) for x in slots.values()) < total:
        for r in range(p):
            if busy_until[r] > t:
                continue
            action = _pick(r, t, local, done, next_f, next_b, held, pending_w, p=p, m=m)
            if action is None:
                continue
            kind, mb, chunk = action
            slots[r].append(Slot(kind, mb, chunk, t, 1))
            busy_until[r] = t + 1
            if kind != "W":
                done[(kind, mb, chunk)] = t + 1
        t += 1
    return slots


def _pick(
    r: int,
    t: int,
    local: dict[int, tuple[int, ...]],
    done: Done,
    next_f: dict[int, int],
    next_b: dict[int, int],
    held: list[int],
    pending_w: Deferred,
    *,
    p: int,
    m: int,
) -> Action | None:
    nchunks = 2 * p
    for chunk in sorted(local[r], reverse=True):  # backward: later chunks first
        mb = next_b[chunk]
        if mb < m:
            ready = _ready_time("B", mb, chunk, done, nchunks)
            if ready is not None and ready <= t:
                next_b[chunk] += 1
                held[r] -= 1
                pending_w[r].append((mb, chunk))
                return ("B", mb, chunk)
    for chunk in sorted(local[r], reverse=True):
        mb = next_f[chunk]
        if mb < m and held[r] < 2 * p:
            ready = _ready_time("F", mb, chunk, done, nchunks)
            if ready is not None and ready <= t:
                next_f[chunk] += 1
                held[r] += 1
                return ("F", mb, chunk)
    if pending_w[r]:
        mb, chunk = pending_w[r].pop(0)
        return ("W", mb, chunk)
    return None
