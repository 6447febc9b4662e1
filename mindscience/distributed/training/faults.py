"""Faults and recovery of ``msdist train`` that need no MindSpore: the fault-injection switch,
the newest checkpoint complete on every rank, ``--keep-last``, and the steps of a run that
restarted (pure Python).

Fault injection (off unless set)::

    MSDIST_FAULT=RANK:STEP:KIND[:ATTEMPT][,...]

makes global rank ``RANK`` fail at the start of the 1-based ``STEP`` (before it trains it),
in launch ``ATTEMPT`` of the run (0, the first, by default; ``*`` every launch), so a
restarted run does not fail again at the same place unless asked. Kinds:

* ``kill``: the rank SIGKILLs itself (a crash, a lost device);
* ``hang``: the rank sleeps for ever (a stuck collective): found by ``--timeout`` or by
  the other ranks' collective timing out;
* ``exit``: the rank exits with code 13 (a process that gives up);
* ``raise``: the rank raises :class:`InjectedFault` (an error in the training code);
* ``term``: the rank sends itself SIGTERM (a scheduler's preemption notice): every rank
  finishes the step, saves, and the run stops (``msdist train`` exits 3);
* ``save-kill``: the rank SIGKILLs itself while it writes the checkpoint of ``STEP``
  (with ``--async-save``, in the background writer);
* ``node``: the rank SIGKILLs itself and its node does not come back (simulated
  ``--loopback-nodes`` only: that node's agent stays away from the rendezvous).

    >>> parse_faults("1:3:kill, 0:2:exit:*")
    [Fault(rank=1, step=3, kind='kill', attempt=0), Fault(rank=0, step=2, kind='exit', attempt=None)]
    >>> fault_at(parse_faults("1:3:kill"), rank=1, step=3, attempt=0).kind
    'kill'
    >>> fault_at(parse_faults("1:3:kill"), rank=1, step=3, attempt=1) is None
    True
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from dataclasses import dataclass

from .options import STEP_DIR, TrainOptionError

FAULT_ENV = "MSDIST_FAULT"
# The launch (0, 1, ...) a rank belongs to: msdist train sets it for every rank it starts.
ATTEMPT_ENV = "MSDIST_ATTEMPT"
KINDS = ("kill", "hang", "exit", "raise", "term", "save-kill", "node")
# Where each kind fires: at the start of the step, or while the step's checkpoint is written.
STEP_KINDS = ("kill", "hang", "exit", "raise", "term", "node")
SAVE_KINDS = ("save-kill",)
FAULT_EXIT_CODE = 13

# msdist train's exit codes beyond 0 (done), 1 (failed) and 2 (bad input).
EXIT_STOPPED = 3          # stopped on a signal after every rank saved the same step
EXIT_INTERRUPTED = 130    # a second signal: stopped at once, nothing more saved


class InjectedFault(RuntimeError):
    """The error a ``raise`` fault raises in its rank."""


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``rank`` fails at 1-based ``step`` in launch ``attempt`` (None: every launch)."""

    rank: int
    step: int
    kind: str
    attempt: int | None = 0


def parse_faults(text: str | None) -> list:
    """The faults of ``MSDIST_FAULT`` (see the module doc); ``[]`` when unset or empty.

    Raises:
        TrainOptionError: an item that is not ``RANK:STEP:KIND[:ATTEMPT]``.
    """
    faults = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        fields = item.split(":")
        ok = len(fields) in (3, 4) and fields[0].isdigit() and fields[1].isdigit() and fields[2] in KINDS
        if ok and len(fields) == 4:
            ok = fields[3] == "*" or fields[3].isdigit()
        if not ok or int(fields[1]) < 1:
            raise TrainOptionError(
                f"{FAULT_ENV}={text!r}: item {item!r} is invalid: expected RANK:STEP:KIND[:ATTEMPT] with a "
                f"global rank, a 1-based step, KIND one of {', '.join(KINDS)} and ATTEMPT a launch number or "
                "* (default 0, the first launch), e.g. 1:3:kill.")
        attempt = 0 if len(fields) == 3 else (None if fields[3] == "*" else int(fields[3]))
        faults.append(Fault(int(fields[0]), int(fields[1]), fields[2], attempt))
    return faults


def check_faults(faults: list, world_size: int, last_step: int) -> None:
    """Refuse faults that can never fire in this run (a rank or step outside it).

    Raises:
        TrainOptionError: naming the fault and the range.
    """
    for f in faults:
        if f.rank >= world_size or f.step > last_step:
            raise TrainOptionError(
                f"{FAULT_ENV}: fault {f.rank}:{f.step}:{f.kind} never fires: the run has ranks 0..{world_size - 1} "
                f"and steps up to {last_step}. Name a rank and a step of this run.")


def fault_at(faults: list, *, rank: int, step: int, attempt: int, kinds=STEP_KINDS) -> Fault | None:
    """The fault of ``rank`` at 1-based ``step`` in launch ``attempt`` among ``kinds``, or None."""
    for f in faults:
        if f.rank == rank and f.step == step and f.kind in kinds and f.attempt in (None, attempt):
            return f
    return None


def env_faults() -> tuple:
    """``(faults, attempt)`` of this process's environment (a rank's)."""
    return parse_faults(os.environ.get(FAULT_ENV)), int(os.environ.get(ATTEMPT_ENV) or 0)


def fire(fault: Fault) -> None:
    """Make this process fail as ``fault`` says (``term`` returns: the handler takes it from there).

    Writes one line with the wall-clock time to stderr first (the rank's log), from which
    ``bench/bench_faults.py`` times the detection."""
    import sys

    sys.stderr.write(f"msdist fault: {fault.rank}:{fault.step}:{fault.kind} fires at {time.time():.3f}\n")
    sys.stderr.flush()
    if fault.kind in ("kill", "save-kill", "node"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "hang":
        while True:
            time.sleep(3600)
    elif fault.kind == "exit":
        os._exit(FAULT_EXIT_CODE)
    elif fault.kind == "raise":
        raise InjectedFault(f"{FAULT_ENV}: injected fault {fault.rank}:{fault.step}:raise")
    elif fault.kind == "term":
        os.kill(os.getpid(), signal.SIGTERM)


# ----------------------------------------------------------------------------- checkpoints of a --save folder
def complete_steps(save: str | None) -> list:
    """``[(step, directory)]`` of the complete checkpoints in a ``--save`` folder, oldest first.

    A checkpoint is complete once its manifest exists: the manifest is written last,
    after every rank's file and part (``checkpoint.writer``), so a ``step_<k>`` listed
    here is complete on every rank; a save that crashed left only ``step_<k>.partial``.
    """
    from ..checkpoint.manifest import has_manifest

    if not save or not os.path.isdir(save):
        return []
    found = [(int(m.group(1)), os.path.join(save, name)) for name in os.listdir(save)
             if (m := STEP_DIR.match(name)) and has_manifest(os.path.join(save, name))]
    return sorted(found)


def newest_complete(save: str | None, at_most: int | None = None) -> tuple | None:
    """``(step, directory)`` of the newest complete checkpoint (of step <= ``at_most``), or None."""
    found = [s for s in complete_steps(save) if at_most is None or s[0] <= at_most]
    return found[-1] if found else None


def to_delete(steps: list, keep: int, protect=()) -> list:
    """The steps ``--keep-last keep`` removes: all but the newest ``keep`` complete ones,
    never one of ``protect`` (the one being written).

        >>> to_delete([2, 4, 6, 8], 2), to_delete([2, 4], 0), to_delete([2, 4, 6], 1, protect=[4])
        ([2, 4], [], [2])
    """
    if keep <= 0:
        return []
    ordered = sorted(steps)
    return [s for s in ordered[:-keep] if s not in protect]


def keep_last(save: str, keep: int, protect=()) -> list:
    """Remove the complete checkpoints of ``save`` older than the newest ``keep``; returns them."""
    removed = []
    by_step = dict(complete_steps(save))
    for step in to_delete(list(by_step), keep, protect):
        # Renamed first: a crash mid-removal leaves a name no reader takes for a checkpoint.
        doomed = by_step[step] + ".deleting"
        os.replace(by_step[step], doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(by_step[step])
    return removed


def leftovers(save: str | None) -> list:
    """Temporary entries a crashed save leaves in a ``--save`` folder (``.partial``, ``.old``, ``.deleting``)."""
    if not save or not os.path.isdir(save):
        return []
    return sorted(os.path.join(save, n) for n in os.listdir(save)
                  if n.startswith("step_") and n.endswith((".partial", ".old", ".deleting")))


def clean_leftovers(save: str | None) -> list:
    """Remove :func:`leftovers` (between launches: no rank is writing). A complete
    ``.partial`` whose ``step_<k>`` is missing is moved into place instead (see
    ``checkpoint.writer``: the fallback rename's crash window)."""
    from ..checkpoint.manifest import has_manifest

    removed = []
    for path in leftovers(save):
        base = path.rsplit(".", 1)[0]
        if path.endswith((".partial", ".old")) and not os.path.lexists(base) and has_manifest(path):
            os.replace(path, base)
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


# ----------------------------------------------------------------------------- steps of a restarted run
def kept_steps(attempt_rows: list, next_first_step: int | None) -> list:
    """The rows of one launch that the run keeps: those up to the step the next launch
    resumed from (all of them for the last launch, ``next_first_step`` None).

        >>> kept_steps([(1, 5.0, 0.5), (2, 4.9, 0.4), (3, 4.8, 0.4)], 2)
        [(1, 5.0, 0.5), (2, 4.9, 0.4)]
    """
    return [row for row in attempt_rows if next_first_step is None or row[0] <= next_first_step]
