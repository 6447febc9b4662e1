"""How many backend collectives this process has launched (pure Python).

Eager kernels count every backend call (a composition counts its inner calls); checks
use the count to prove that size-1 groups and argument errors never reach the backend.
Compiled kernels cannot count at run time and do not.
"""

_CALL_COUNT = 0


def count() -> None:
    """Record one backend collective call."""
    global _CALL_COUNT
    _CALL_COUNT += 1


def call_count() -> int:
    """How many backend collectives this process has launched so far (eager mode)."""
    return _CALL_COUNT
