"""Multi-process worker harness: spawn N ranks once, run named checks, collect per-rank JSON.

Used by the test suite and by ``msdist verify``. Importing this package (and
``launcher``) does not import MindSpore; only the ranks do.

    from mindscience.distributed.harness import launch, merge_records
    result = launch({"checks": ["basic.ping", "basic.allreduce"]}, world_size=2, timeout=120)
    result.ok, result.failures, merge_records(result)

Layout: ``launcher`` (parent side: ``launch``, merging records) over ``msrun_command``,
``processes`` (``/proc`` discovery and cleanup) and ``monitor``; ``worker``
(rank side: the script msrun runs), ``registry`` (``@check``), ``checks/`` (the checks).
"""

from .launcher import (
    IDENTITY_KEYS,
    LaunchError,
    LaunchResult,
    build_msrun_command,
    check_port_free,
    find_free_port,
    find_msrun,
    job_processes,
    kill_processes,
    launch,
    launch_local_multinode,
    merge_records,
    msrun_starts_scheduler,
    normalize_spec,
    start_scheduler,
    stop_job,
)
from .registry import CHECK_MODULES, CheckContext, check, get_check, registered_checks

__all__ = [
    "CHECK_MODULES",
    "IDENTITY_KEYS",
    "CheckContext",
    "LaunchError",
    "LaunchResult",
    "build_msrun_command",
    "check",
    "check_port_free",
    "find_free_port",
    "find_msrun",
    "get_check",
    "job_processes",
    "kill_processes",
    "launch",
    "launch_local_multinode",
    "merge_records",
    "msrun_starts_scheduler",
    "normalize_spec",
    "registered_checks",
    "start_scheduler",
    "stop_job",
]
