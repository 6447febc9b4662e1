"""Shared test fixtures.

* Tests marked ``multiprocess`` (real msrun jobs) are skipped where msrun cannot run:
  no msrun next to the interpreter or on PATH, or not Linux. Deselect them on purpose
  with ``-m "not multiprocess"``.
* ``assert_no_leftovers(result)`` fails when any process of a finished harness job is
  still alive.
"""

import sys

import pytest


def _msrun_missing_reason():
    if not sys.platform.startswith("linux"):
        return f"msrun jobs need Linux (/proc), this is {sys.platform}"
    from mindscience.distributed.harness.launcher import LaunchError, find_msrun

    try:
        find_msrun()
    except LaunchError as exc:
        return str(exc)
    return None


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if "multiprocess" in item.keywords]
    reason = _msrun_missing_reason() if marked else None
    if reason:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def assert_no_leftovers():
    """Return a function that asserts no process of a harness job is alive any more.

    It looks for the job's id and for its scheduler port (``MS_SCHED_PORT``) in every
    process's environment, as the launcher's own cleanup does.
    """
    from mindscience.distributed.harness import job_processes

    def check(result):
        left = {**job_processes(job_id=result.job_id), **job_processes(port=result.master_port)}
        assert not left, f"processes of the job outlived it: {sorted(left)} (logs in {result.log_dir})"

    return check
