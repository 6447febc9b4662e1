"""Pipeline parallelism: schedules as data (pure) and the runtime that executes them.

``mindscience.distributed.pipeline.schedules`` imports no MindSpore (``msdist plan
--schedule`` uses it without a device); :func:`forward_backward` loads the runtime, and
MindSpore with it, on first use.
"""

import importlib

from .schedules import SCHEDULES, Schedule, ScheduleError, build, format_timeline, theoretical_bubble

__all__ = ["SCHEDULES", "Schedule", "ScheduleError", "build", "format_timeline",
           "theoretical_bubble", "forward_backward", "PipelineError"]

_RUNTIME = {"forward_backward", "PipelineError", "stage_parameters"}


def __getattr__(name):
    if name in _RUNTIME:
        return getattr(importlib.import_module(f"{__name__}.runtime"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
