"""Pipeline schedules as data: each stage's ordered actions, validated and simulated.

Pure Python (no MindSpore), so ``msdist plan --schedule`` shows a schedule's timeline and
bubble without a device, and the runtime (:mod:`.runtime`) only executes the lists made here.

A schedule for ``p`` pipeline ranks, ``m`` micro-batches and ``v`` model chunks per rank
(``v > 1`` only for ``"interleaved"``) is, per rank, a list of *steps*:

* a compute step, one action ``F{j}`` / ``B{j}`` (forward / backward of micro-batch j;
  ``F{j}.{c}`` on chunk c > 0 of an interleaved rank);
* a transfer step with the neighbour: ``SEND_F{j}``, ``RECV_F{j}``, ``SEND_B{j}``,
  ``RECV_B{j}`` (the chunk suffix names this rank's chunk that produces or consumes it),
  or two of them joined by ``+`` (``SEND_F3+RECV_B1``), one exchange that moves a tensor
  each way at once, as Megatron's ``send_forward_recv_backward``.

Model stage ``g`` (of ``p * v``) lives on rank ``g % p`` as its chunk ``g // p``
(Megatron's interleaved assignment; ``v = 1`` is the plain pipeline).

Compute orders:

* ``gpipe``: every forward, then every backward (stage i holds m micro-batches' activations);
* ``1f1b``: ``min(p - i - 1, m)`` warm-up forwards on stage i, then one forward and one
  backward in turn, then the remaining backwards (stage i holds at most ``p - i``);
* ``interleaved`` (Narayanan et al. 2021, sec. 2.2): virtual micro-batch k is micro-batch
  ``(k // (p v)) p + k % p`` on chunk ``(k % (p v)) // p`` (backwards: the chunks in
  reverse); warm-up ``min(2 (p - i - 1) + (v - 1) p, m v)``; needs ``m % p == 0``.

Transfers: the blocking pair transfers of :mod:`mindscience.distributed.p2p` are
rendezvous between two ranks, so every transfer is placed at one point of a single global
order of all events (sorted by the time the ideal, dependency-only simulation gives them);
each rank runs its events in that order. The lowest pending event can always run, so the
lists cannot deadlock; :func:`simulate` replays them as blocking rendezvous and proves it,
and :func:`validate` checks that every send has its receive and every input arrives before
its compute. Time unit: one forward of one chunk; a backward lasts 2 (transfers 0).

Example, ``build("1f1b", 2, 4)``::

    stage 0: F0 SEND_F0 F1 SEND_F1+RECV_B0 B0 SEND_F2 ...
    stage 1: RECV_F0 F0 B0 SEND_B0 ...
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = [
    "SCHEDULES", "FORWARD_UNITS", "BACKWARD_UNITS", "Action", "Schedule", "ScheduleError",
    "build", "compute_order", "parse_action", "validate", "simulate", "theoretical_bubble",
    "format_timeline",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved")
FORWARD_UNITS = 1
BACKWARD_UNITS = 2
COMPUTE = ("F", "B")
TRANSFERS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


class ScheduleError(ValueError):
    """A schedule's parameters are invalid, or its action lists cannot run."""


@dataclass(frozen=True)
class Action:
    """One action of a stage. ``peer``: the pp rank a transfer goes to or comes from."""

    kind: str
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __str__(self) -> str:
        suffix = f".{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch}{suffix}"


_ACTION_RE = re.compile(r"^(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)(?:\.(\d+))?$")


def parse_action(text: str) -> Action:
    """``"F3"`` -> ``Action("F", 3)``; ``"RECV_B2.1"`` -> ``Action("RECV_B", 2, 1)``."""
    match = _ACTION_RE.match(text.strip())
    if not match:
        raise ScheduleError(
            f"action {text!r} is invalid: expected F<j>, B<j>, SEND_F<j>, RECV_F<j>, SEND_B<j> "
            "or RECV_B<j>, optionally followed by .<chunk>")
    return Action(match.group(1), int(match.group(2)), int(match.group(3) or 0))


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ScheduleError(f"{name}={value!r} is invalid: expected an integer >= {low}.")


def _check_args(name, p, m, v):
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule {name!r} is unknown: expected one of {', '.join(SCHEDULES)}.")
    _check_int("pipeline stages", p, 1)
    _check_int("microbatches", m, 1)
    _check_int("virtual stages", v, 1)
    if name != "interleaved" and v != 1:
        raise ScheduleError(
            f"virtual stages {v} need the interleaved schedule: {name!r} runs one model chunk "
            "per rank (use --schedule interleaved, or --virtual-stages 1).")
    if name == "interleaved" and m % p:
        raise ScheduleError(
            f"the interleaved schedule needs the micro-batches to be a multiple of the pipeline "
            f"stages: m={m} is not divisible by p={p}; use m={-(-m // p) * p}.")


def compute_order(name: str, p: int, m: int, v: int, rank: int) -> list:
    """Rank ``rank``'s forwards and backwards in order: ``[("F", j, chunk), ...]``."""
    _check_args(name, p, m, v)
    if name == "gpipe":
        return [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)]
    if name == "1f1b":
        warm = min(p - rank - 1, m)
        order = [("F", j, 0) for j in range(warm)]
        for k in range(m - warm):
            order += [("F", warm + k, 0), ("B", k, 0)]
        return order + [("B", j, 0) for j in range(m - warm, m)]
    total = m * v

    def micro(k):
        return (k // (p * v)) * p + k % p

    def chunk(k, forward):
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    warm = min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = [("F", micro(k), chunk(k, True)) for k in range(warm)]
    for k in range(total - warm):
        order += [("F", micro(warm + k), chunk(warm + k, True)), ("B", micro(k), chunk(k, False))]
    return order + [("B", micro(k), chunk(k, False)) for k in range(total - warm, total)]


def _ideal_times(p, m, v, orders):
    """Start/end of every compute with unbounded buffers: ``{(kind, j, g): (start, end)}``."""
    stages = p * v
    times = {}
    free = [0] * p
    pos = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, j, c = orders[r][pos[r]]
                g = c * p + r
                if kind == "F":
                    dep = None if g == 0 else ("F", j, g - 1)
                else:
                    dep = ("F", j, g) if g == stages - 1 else ("B", j, g + 1)
                same = ("F", j, g) if kind == "B" else None
                if (dep is not None and dep not in times) or (same is not None and same not in times):
                    break
                start = max(free[r], times[dep][1] if dep else 0)
                end = start + (FORWARD_UNITS if kind == "F" else BACKWARD_UNITS)
                times[(kind, j, g)] = (start, end)
                free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]] for r in range(p) if pos[r] < len(orders[r])}
            raise ScheduleError(f"the compute order cannot run: every stage waits ({stuck})")
    return times


@dataclass(frozen=True)
class _Transfer:
    kind: str  # "F" (activation to the next stage) or "B" (gradient to the previous)
    microbatch: int
    src: int
    src_chunk: int
    dst: int
    dst_chunk: int


def _events(p, m, v, orders, times, placement):
    """Every compute and transfer, in the one global order all ranks follow."""
    stages = p * v
    events = []
    for r in range(p):
        for kind, j, c in orders[r]:
            start, _ = times[(kind, j, c * p + r)]
            events.append(((start, 1, r, kind, j, c), ("compute", r, Action(kind, j, c))))
    for (kind, j, g), (start, end) in times.items():
        nxt = g + 1 if kind == "F" else g - 1
        if nxt < 0 or nxt >= stages or (kind == "F" and g == stages - 1):
            continue
        src, dst = g % p, nxt % p
        if src == dst:
            continue  # p == 1: the next model stage is on the same rank
        t = _Transfer(kind, j, src, g // p, dst, nxt // p)
        consumer_start = times[(kind, j, nxt)][0]
        when = consumer_start if placement == "consumer" else end
        events.append(((when, 0, dst, kind, j, g), ("transfer", None, t)))
    events.sort(key=lambda e: e[0])
    return [e[1] for e in events]


def _rank_steps(p, events):
    """Per rank, its events in the global order; transfers as lists of _Transfer."""
    steps = [[] for _ in range(p)]
    for what, r, item in events:
        if what == "compute":
            steps[r].append(item)
        else:
            shared = [item]  # one object on both ranks: _merge_exchanges finds it by id
            steps[item.src].append(shared)
            steps[item.dst].append(shared)
    return steps


def _merge_exchanges(steps):
    """Join two transfers that are adjacent on BOTH ranks, between the same two ranks,
    going opposite ways, into one exchange (one collective instead of two)."""
    def position(r):
        return {id(s): i for i, s in enumerate(steps[r]) if isinstance(s, list)}

    changed = True
    while changed:
        changed = False
        for r in range(len(steps)):
            lst = steps[r]
            for i in range(len(lst) - 1):
                a, b = lst[i], lst[i + 1]
                if not (isinstance(a, list) and isinstance(b, list) and len(a) == 1 and len(b) == 1):
                    continue
                ta, tb = a[0], b[0]
                if {ta.src, ta.dst} != {tb.src, tb.dst} or ta.src == tb.src:
                    continue
                other = ta.dst if ta.src == r else ta.src
                pos = position(other)
                ia, ib = pos.get(id(a)), pos.get(id(b))
                if ia is None or ib is None or ib != ia + 1:
                    continue
                merged = [ta, tb]
                lst[i:i + 2] = [merged]
                olst = steps[other]
                olst[ia:ia + 2] = [merged]
                changed = True
                break
            if changed:
                break
    return steps


def _as_actions(r, step):
    if isinstance(step, Action):
        return (step,)
    out = []
    for t in step:
        if t.src == r:
            out.append(Action("SEND_" + t.kind, t.microbatch, t.src_chunk, t.dst))
        else:
            out.append(Action("RECV_" + t.kind, t.microbatch, t.dst_chunk, t.src))
    return tuple(out)


@dataclass
class Schedule:
    """A built schedule: per-rank steps (tuples of :class:`Action`) and its simulation."""

    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    steps: list
    timeline: list = field(default_factory=list)
    makespan: int = 0
    peak_in_flight: list = field(default_factory=list)

    def actions(self) -> list:
        """Per stage, the step strings the runtime runs: ``[["F0", "SEND_F0", ...], ...]``."""
        return [["+".join(str(a) for a in step) for step in rank] for rank in self.steps]

    def idle_fraction(self) -> list:
        """Per stage, the share of the makespan it computes nothing."""
        out = []
        for rank in self.timeline:
            busy = sum(e["end"] - e["start"] for e in rank)
            out.append((self.makespan - busy) / self.makespan if self.makespan else 0.0)
        return out

    @property
    def bubble_fraction(self) -> float:
        """Idle time over ``p x makespan`` (all stages together)."""
        fr = self.idle_fraction()
        return sum(fr) / len(fr) if fr else 0.0

    @property
    def bubble_ratio(self) -> float:
        """Idle over compute time, the quantity ``(p - 1) / (v m)`` models."""
        f = self.bubble_fraction
        return f / (1 - f) if f < 1 else float("inf")

    def to_dict(self) -> dict:
        """The plan JSON's ``"schedule"`` value."""
        return {
            "schedule": self.name, "stages": self.stages, "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages, "actions": self.actions(),
            "timeline": self.timeline, "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction, "bubble_ratio": self.bubble_ratio,
            "idle_fraction": self.idle_fraction(),
            "theoretical_bubble_ratio": theoretical_bubble(self.stages, self.microbatches,
                                                           self.virtual_stages),
            "peak_in_flight": self.peak_in_flight,
        }


def theoretical_bubble(p: int, m: int, v: int = 1) -> float:
    """Narayanan et al.'s bubble over compute time: ``(p - 1) / (v m)``."""
    return (p - 1) / (v * m)


def simulate(schedule: Schedule) -> Schedule:
    """Replay the steps with blocking rendezvous transfers (zero duration); fill in the
    timeline, makespan and peak activations in flight.

    Raises:
        ScheduleError: a rank would wait forever (names every waiting step), or a compute
            runs before its input arrived.
    """
    p = schedule.stages
    steps = schedule.steps
    pos = [0] * p
    clock = [0] * p
    have = [set() for _ in range(p)]  # ("F"/"B", microbatch, chunk) inputs present
    alive = [0] * p
    peak = [0] * p
    timeline = [[] for _ in range(p)]
    stages = p * schedule.virtual_stages
    done = 0
    total = sum(len(s) for s in steps)
    while done < total:
        progressed = False
        for r in range(p):
            while pos[r] < len(steps[r]):
                step = steps[r][pos[r]]
                if len(step) == 1 and step[0].kind in COMPUTE:
                    a = step[0]
                    g = a.chunk * p + r
                    _check_input(schedule, r, a, g, stages, have)
                    dur = FORWARD_UNITS if a.kind == "F" else BACKWARD_UNITS
                    timeline[r].append({"kind": a.kind, "microbatch": a.microbatch,
                                        "chunk": a.chunk, "start": clock[r],
                                        "end": clock[r] + dur})
                    clock[r] += dur
                    alive[r] += 1 if a.kind == "F" else -1
                    peak[r] = max(peak[r], alive[r])
                    _produce(r, a, g, p, stages, have)
                else:
                    peer = step[0].peer
                    if pos[peer] >= len(steps[peer]) or not _complementary(
                            p, r, step, peer, steps[peer][pos[peer]]):
                        break
                    for a in step:
                        if a.kind.startswith("SEND"):
                            key = (a.kind[-1], a.microbatch, a.chunk, "out")
                            if key not in have[r]:
                                raise ScheduleError(
                                    f"stage {r} sends {a} before computing it ({schedule.name})")
                    for a in steps[peer][pos[peer]]:
                        if a.kind.startswith("RECV"):
                            have[peer].add((a.kind[-1], a.microbatch, a.chunk, "in"))
                    for a in step:
                        if a.kind.startswith("RECV"):
                            have[r].add((a.kind[-1], a.microbatch, a.chunk, "in"))
                    t = max(clock[r], clock[peer])
                    clock[r] = clock[peer] = t
                    pos[peer] += 1
                    done += 1
                pos[r] += 1
                done += 1
                progressed = True
        if not progressed:
            waiting = {f"stage {r}": "+".join(map(str, steps[r][pos[r]]))
                       for r in range(p) if pos[r] < len(steps[r])}
            raise ScheduleError(f"{schedule.name}: the stages wait for each other forever: {waiting}")
    schedule.timeline = timeline
    schedule.makespan = max(clock) if clock else 0
    schedule.peak_in_flight = peak
    return schedule


def _check_input(schedule, r, a, g, stages, have):
    if a.kind == "F":
        need = None if g == 0 else ("F", a.microbatch, a.chunk, "in")
    else:
        if ("F", a.microbatch, a.chunk, "done") not in have[r]:
            raise ScheduleError(f"stage {r} runs {a} before its forward ({schedule.name})")
        need = None if g == stages - 1 else ("B", a.microbatch, a.chunk, "in")
    if need is not None and need not in have[r]:
        raise ScheduleError(f"stage {r} runs {a} before its input arrived ({schedule.name})")


def _produce(r, a, g, p, stages, have):
    have[r].add((a.kind, a.microbatch, a.chunk, "done"))
    have[r].add((a.kind, a.microbatch, a.chunk, "out"))
    # p == 1: the next model stage is this rank's next chunk; its input is here already.
    nxt = g + 1 if a.kind == "F" else g - 1
    if 0 <= nxt < stages and nxt % p == r:
        have[r].add((a.kind, a.microbatch, nxt // p, "in"))


def _transfer_id(p, r, a):
    """``(F/B, micro-batch, sending model stage)`` of a transfer action on rank r."""
    g = a.chunk * p + r
    if a.kind.startswith("SEND"):
        return a.kind[-1], a.microbatch, g
    return a.kind[-1], a.microbatch, g - 1 if a.kind == "RECV_F" else g + 1


def _complementary(p, r, step, peer, other) -> bool:
    """``other`` (the peer's current step) is the other end of exactly these transfers."""
    if len(step) != len(other) or any(a.kind in COMPUTE for a in other):
        return False
    if any(a.peer != r for a in other):
        return False
    mine = sorted((a.kind[:4], _transfer_id(p, r, a)) for a in step)
    flip = {"SEND": "RECV", "RECV": "SEND"}
    theirs = sorted((flip[a.kind[:4]], _transfer_id(p, peer, a)) for a in other)
    return mine == theirs


def validate(schedule: Schedule) -> Schedule:
    """Check that each model stage runs F and B of every micro-batch exactly once on its
    rank, that every SEND has its RECV, and (by :func:`simulate`) that it runs to the end.
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    sends, recvs = {}, {}
    for r, rank in enumerate(schedule.steps):
        seen = [(a.kind, a.microbatch, a.chunk) for step in rank for a in step if a.kind in COMPUTE]
        want = sorted((k, j, c) for k in COMPUTE for j in range(m) for c in range(v))
        if sorted(seen) != want:
            raise ScheduleError(
                f"stage {r} does not run every forward and backward exactly once "
                f"({len(seen)} computes, expected {len(want)})")
        for step in rank:
            for a in step:
                if a.kind.startswith("SEND"):
                    sends[(r, a.peer, a.kind[-1], a.microbatch)] = sends.get(
                        (r, a.peer, a.kind[-1], a.microbatch), 0) + 1
                elif a.kind.startswith("RECV"):
                    recvs[(a.peer, r, a.kind[-1], a.microbatch)] = recvs.get(
                        (a.peer, r, a.kind[-1], a.microbatch), 0) + 1
    if sends != recvs:
        unmatched = sorted(set(sends.items()) ^ set(recvs.items()))[:4]
        raise ScheduleError(f"{schedule.name}: sends and receives do not match: {unmatched}")
    return simulate(schedule)


def build(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The validated, simulated schedule ``name`` for ``stages`` pp ranks.

    Raises:
        ScheduleError: unknown name, sizes < 1, ``virtual_stages > 1`` outside
            "interleaved", or ``microbatches % stages`` for "interleaved".
    """
    p, m, v = stages, microbatches, virtual_stages
    _check_args(name, p, m, v)
    orders = [compute_order(name, p, m, v, r) for r in range(p)]
    times = _ideal_times(p, m, v, orders)
    best = None
    for placement in ("consumer", "producer"):
        steps = _merge_exchanges(_rank_steps(p, _events(p, m, v, orders, times, placement)))
        sched = Schedule(name, p, m, v, [[_as_actions(r, s) for s in rank]
                                         for r, rank in enumerate(steps)])
        validate(sched)
        if best is None or sched.makespan < best.makespan:
            best = sched
    return best


def format_timeline(schedule: Schedule) -> list:
    """One text line per stage, one column per time unit (``.`` = idle)::

        stage 0 | F0 F1 F2 F3 B0 B0 ...
    """
    width = max([len(str(Action(e["kind"], e["microbatch"], e["chunk"])))
                 for rank in schedule.timeline for e in rank] + [2])
    lines = []
    for r, rank in enumerate(schedule.timeline):
        cells = ["." * 1] * schedule.makespan
        for e in rank:
            label = str(Action(e["kind"], e["microbatch"], e["chunk"]))
            for t in range(e["start"], e["end"]):
                cells[t] = label
        lines.append(f"stage {r} | " + " ".join(c.ljust(width) for c in cells).rstrip())
    return lines
