"""What ``msdist plan`` shows of a pipeline (pure: no MindSpore).

* :func:`schedule_data`: the schedule of the layout's pipeline, as the plan JSON's
  ``"schedule"`` value (per-stage actions, timeline, makespan, bubble, peak in flight);
* :func:`embedding_groups`: Megatron's embedding groups, the first and the last stage of
  every pipeline group, over which tied parameters (a shared embedding) are summed.

Example, 8 ranks tp2 x dp2 x pp2 (order tp-cp-dp-pp): pipeline groups (0, 4), (1, 5),
(2, 6), (3, 7); with pp = 2 every embedding group is the pipeline group itself.
"""

from __future__ import annotations

from .schedules import build


def embedding_groups(layout) -> list:
    """``[[first, last], ...]`` per pipeline group; ``[]`` when pp == 1."""
    if layout.pp == 1:
        return []
    return [[g[0], g[-1]] for g in layout.groups("pp")]


def embedding_ranks(pp_ranks) -> tuple:
    """The embedding group of one pipeline group: its first and last stage."""
    pp_ranks = tuple(pp_ranks)
    if len(pp_ranks) == 1:
        return pp_ranks
    return (pp_ranks[0], pp_ranks[-1])


def schedule_data(stages: int, schedule: str = "1f1b", microbatches: int = 8,
                  virtual_stages: int = 1) -> dict:
    """The plan JSON's ``"schedule"``: :meth:`Schedule.to_dict` of the built schedule."""
    return build(schedule, stages, microbatches, virtual_stages).to_dict()
