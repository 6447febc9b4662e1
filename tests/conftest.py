"""Shared test fixtures.

* Tests marked ``multiprocess`` (real msrun jobs) are skipped where msrun cannot run:
  no msrun next to the interpreter or on PATH, or not Linux. Deselect them on purpose
  with ``-m "not multiprocess"``.
* ``assert_no_leftovers(result)`` fails when any process of a finished harness job is
  still alive.
* The multiprocess job families (``tests/_<name>_job.py``) share one launch per world
  size: after collection, ``_jobs.select`` learns which test files have multiprocess
  tests selected, and the first family used launches the checks of all of them
  (see ``_jobs.py``). ``MSDIST_SHARED_LAUNCH=0`` gives every family its own launch
  (the behaviour before; to time a family alone or to rule the sharing out).
"""

import glob
import importlib
import os
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


def _limit_kernel_threads():
    """MindSpore's CPU kernel pool in this process: the machine's cores (``MSDIST_CPU_THREADS``
    overrides it, 0 keeps MindSpore's default of 25), set before the first kernel runs; and
    synchronous PyNative, as the harness's CPU ranks run it (``MSDIST_PYNATIVE_SYNC=0``
    keeps the asynchronous default; see harness/worker.py ``_synchronous_pynative``)."""
    if "mindspore" not in sys.modules:  # no collected test imports it: nothing to set
        return
    import mindspore as ms

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = int(os.environ.get("MSDIST_CPU_THREADS") or cores or 1)
    if threads > 0:
        ms.device_context.cpu.op_tuning.threads_num(threads)
    if os.environ.get("MSDIST_PYNATIVE_SYNC", "1") != "0" and ms.get_context("device_target") == "CPU":
        ms.set_context(pynative_synchronize=True)


def pytest_collection_finish(session):
    _limit_kernel_threads()
    files = {item.path.name for item in session.items
             if "multiprocess" in item.keywords and not item.get_closest_marker("skip")}
    if not files or os.environ.get("MSDIST_SHARED_LAUNCH") == "0":
        return
    import _jobs

    # Every family registers itself when its job module is imported; some test files
    # import theirs only inside a fixture, so import them all now (they are small and
    # import no MindSpore).
    for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "_*_job.py"))):
        importlib.import_module(os.path.basename(path)[:-3])
    _jobs.select(files)


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
