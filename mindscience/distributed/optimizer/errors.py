"""The distributed optimizer's one error type (no MindSpore import).

Every check that depends only on the arguments runs on every rank before any
collective, so a bad argument stops all ranks in step instead of leaving some of them
waiting in a collective.
"""

from __future__ import annotations

__all__ = ["DistributedOptimizerError"]


class DistributedOptimizerError(ValueError, TypeError):
    """Bad arguments to :class:`DistributedOptimizer` or to its call.

    A ValueError (a value out of range, groups that disagree, a gradient of the wrong
    shape) and a TypeError (a gradient of the wrong dtype, a non-number), so that code
    catching either built-in catches it. The message names the value, what was expected
    and the fix.
    """
