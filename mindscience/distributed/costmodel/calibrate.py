"""Cluster values measured by ``msdist verify`` instead of presets: ``--calibrate report.json``.

A verify report (its JSON) holds a compute probe (``compute: {"tflops", "dtype",
"shape"}``, the slowest rank's dense matmul rate) and bandwidth rows (op, group, size,
``busbw_gbps``, ``latency_us``, ``crosses_nodes``). :func:`calibrate` turns them into the
cost model's cluster values:

* ``peak_tflops x compute_efficiency`` = the measured matmul TFLOP/s: the efficiency is
  ``measured / peak`` (the peak stays the MFU denominator); a device faster than the
  configured peak raises the peak to the measurement (efficiency 1);
* ``intra_node_gbps`` / ``inter_node_gbps``: the median, over the (op, group) rows inside a
  node / across nodes, of the bus bandwidth of the bytes beyond the smallest size
  (:func:`slope_busbw`, alpha-beta: the step model adds each call's latency on its own);
  the median busbw of the largest sizes when no row grew with the size;
* ``intra_node_latency_us`` / ``inter_node_latency_us``: the median of the same rows'
  ``latency_us`` (the time of the smallest size);
* ``collective_latency_us``: inside a node, per op and group size, the median
  ``latency_us`` of the groups that ran it (:func:`latency_table`), so that a call costs
  the latency of its own op and group size.

What the report lacks (say no group crossed nodes) stays as configured, and
:func:`cluster_sources` says where every value came from.

A ``msdist train`` report (``measured.step_time_s`` beside ``predicted.step_time_s``) is
accepted too (:func:`calibrate_from_training`): the compute rate it implies is the
predicted one scaled by ``predicted / measured`` step time, i.e. the whole difference
is put on the compute; the bandwidths stay as configured.

Example:
    >>> from mindscience.distributed.costmodel.spec import ClusterSpec
    >>> report = {"compute": {"tflops": 0.15, "dtype": "float32", "shape": [1024, 1024, 1024]},
    ...           "bandwidth": [{"op": "all_reduce", "group": "tp", "bytes": 1024, "busbw_gbps": 0.01,
    ...                          "latency_us": 900.0, "crosses_nodes": False},
    ...                         {"op": "all_reduce", "group": "tp", "bytes": 262144, "busbw_gbps": 0.4,
    ...                          "latency_us": 900.0, "crosses_nodes": False}]}
    >>> cluster, sources = calibrate(ClusterSpec(device="cpu"), report, "report.json")
    >>> (cluster.peak_tflops, cluster.compute_efficiency, cluster.intra_node_gbps, cluster.intra_node_latency_us)
    (0.15, 1.0, 0.4, 900.0)
    >>> sources["inter_node_gbps"], sources["intra_node_gbps"]
    ('preset cpu', 'report.json: median busbw of 1 intra-node row(s)')
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from statistics import median

from .devices import PRESET_KEYS
from .errors import ModelError, ModelFileError
from .spec import LATENCY_OPS, ClusterSpec, is_finite_number

SOURCE_KEYS = (*PRESET_KEYS, "compute_efficiency")


def cluster_sources(cluster: ClusterSpec, explicit=()) -> dict:
    """``{key: where its value came from}``: ``"cluster section"``, ``"preset NAME"`` or ``"default"``.

    ``explicit`` names the keys the file's ``cluster:`` section (or an option) set
    (:attr:`~.spec.Workload.cluster_keys`).
    """
    sources = {}
    for key in SOURCE_KEYS:
        if key in explicit:
            sources[key] = "cluster section"
        elif cluster.device is not None and key != "compute_efficiency":
            sources[key] = f"preset {cluster.device}"
        else:
            sources[key] = "default"
    return sources


def read_report(path: str | os.PathLike) -> dict:
    """Load a ``msdist verify --format json`` report.

    Raises:
        ModelFileError: a missing file, not JSON, or neither a ``compute`` nor a
            ``bandwidth`` section.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            report = json.load(fh)
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file: pass the JSON report of `msdist verify --format json "
                             "-o report.json`.", path) from None
    except (OSError, ValueError) as err:
        raise ModelFileError(f"{path}: not a JSON verify report ({err}): pass the file `msdist verify "
                             "-o report.json` wrote.", path) from None
    if is_training_report(report):
        return report
    if not isinstance(report, dict) or not (report.get("compute") or report.get("bandwidth")):
        raise ModelFileError(f"{path}: holds neither 'compute' nor 'bandwidth' results nor a training run's "
                             "'measured' and 'predicted' step times: pass the JSON report of `msdist verify "
                             "--format json -o report.json` or of `msdist train`.", path)
    return report


def is_training_report(report) -> bool:
    """A ``msdist train`` report: ``measured`` and ``predicted`` objects (see :func:`calibrate_from_training`)."""
    return isinstance(report, dict) and isinstance(report.get("measured"), dict) \
        and isinstance(report.get("predicted"), dict)


TRAIN_HINT = "pass the JSON report `msdist train` wrote"


def check_training_report(report: dict, source: str) -> None:
    """Check what :func:`calibrate_from_training` reads; the first bad field raises.

    ``measured.step_time_s`` and ``predicted.step_time_s`` must be finite numbers > 0;
    ``cluster`` (optional) an object whose ``peak_tflops`` and ``compute_efficiency`` are
    finite numbers > 0; ``steps`` (optional) a list.

    Raises:
        ModelFileError: naming ``source`` and the field, e.g. ``measured.step_time_s``.
    """
    def bad(field: str, value, expected: str):
        shown = "missing" if value is _MISSING else f"{value!r} ({type(value).__name__})"
        raise ModelFileError(f"{source}: {field} is {shown}: expected {expected}; {TRAIN_HINT}.", source, field)

    for part in ("measured", "predicted"):
        value = report[part].get("step_time_s", _MISSING)
        if not is_finite_number(value) or value <= 0:
            bad(f"{part}.step_time_s", value, "a step time, a finite number of seconds > 0")
    cluster = report.get("cluster")
    if cluster is not None:
        if not isinstance(cluster, dict):
            bad("cluster", cluster, "an object {peak_tflops, compute_efficiency, ...}")
        for key in ("peak_tflops", "compute_efficiency"):
            value = cluster.get(key, _MISSING)
            if not is_finite_number(value) or value <= 0:
                bad(f"cluster.{key}", value, "a finite number > 0")
    steps = report.get("steps")
    if steps is not None and not isinstance(steps, list):
        bad("steps", steps, "a list of step rows")


def calibrate_from_training(cluster: ClusterSpec, report: dict, source: str,
                            sources: dict | None = None) -> tuple[ClusterSpec, dict]:
    """``cluster`` with the compute rate a training run implies, and the updated ``sources``.

    ``ratio = measured.step_time_s / predicted.step_time_s``; the predicted compute time
    scaled by it gives the rate ``predicted rate / ratio``. The predicted rate is
    ``peak_tflops * compute_efficiency`` of the report's ``cluster`` (what the run's
    estimate used), else of ``cluster`` (the run was predicted with these values). The
    peak stays (the MFU denominator) and the efficiency becomes ``rate / peak``; a rate
    above the peak raises the peak (efficiency 1). Bandwidths and latencies stay.

    Example: predicted 2 s, measured 4 s on a 1 TFLOP/s x 0.5 cluster: 0.25 TFLOP/s.

        >>> run = {"measured": {"step_time_s": 4.0}, "predicted": {"step_time_s": 2.0}}
        >>> c, src = calibrate_from_training(ClusterSpec(peak_tflops=1, compute_efficiency=0.5), run, "r.json")
        >>> c.compute_efficiency, src["compute_efficiency"]
        (0.25, 'r.json: training run, measured/predicted step 4/2 s: 0.25 TFLOP/s / peak')

    Raises:
        ModelFileError: a malformed report (:func:`check_training_report`).
    """
    check_training_report(report, source)
    sources = dict(sources or cluster_sources(cluster))
    used = report.get("cluster") or cluster.__dict__
    predicted_rate = used["peak_tflops"] * used["compute_efficiency"]
    measured, predicted = report["measured"]["step_time_s"], report["predicted"]["step_time_s"]
    rate = predicted_rate * predicted / measured
    what = f"{source}: training run, measured/predicted step {measured:.4g}/{predicted:.4g} s: {rate:.4g} TFLOP/s"
    if rate <= cluster.peak_tflops:
        values = {"compute_efficiency": rate / cluster.peak_tflops}
        sources["compute_efficiency"] = f"{what} / peak"
    else:
        values = {"peak_tflops": float(rate), "compute_efficiency": 1.0}
        sources["peak_tflops"] = f"{what} (above the configured peak)"
        sources["compute_efficiency"] = f"{what}: 1 of the measured peak"
    try:
        return replace(cluster, **values), sources
    except ModelError as err:
        raise ModelFileError(f"{source}: {err}", source) from None


REPORT_HINT = "pass the JSON report `msdist verify --format json -o report.json` wrote"
ROW_KEYS = "op, group, bytes, busbw_gbps, latency_us, crosses_nodes"
_MISSING = object()  # a key absent from the report (None is a value)


def check_report(report, source: str) -> None:
    """Check the parts of a verify report :func:`calibrate` reads; the first bad field raises.

    ``compute`` (optional) must be an object whose ``tflops`` is a finite number > 0;
    ``bandwidth`` (optional) a list of objects with ``op`` and ``group`` (strings),
    ``bytes`` (an integer > 0), ``busbw_gbps`` (a finite number >= 0) and optionally
    ``latency_us`` (a finite number >= 0) and ``crosses_nodes`` (true or false).

    Raises:
        ModelFileError: naming ``source`` and the field, e.g. ``bandwidth[0].busbw_gbps``.
    """
    def bad(field: str, value, expected: str):
        shown = "missing" if value is _MISSING else f"{value!r} ({type(value).__name__})"
        raise ModelFileError(f"{source}: {field} is {shown}: expected {expected}; {REPORT_HINT}.", source, field)

    if not isinstance(report, dict):
        bad("the report", report, "a JSON object with 'compute' and/or 'bandwidth'")
    compute = report.get("compute")
    if compute is not None:
        if not isinstance(compute, dict):
            bad("compute", compute, "an object {tflops, dtype, shape}")
        tflops = compute.get("tflops", _MISSING)
        if not is_finite_number(tflops) or tflops <= 0:
            bad("compute.tflops", tflops, "the measured matmul rate, a finite number of TFLOP/s > 0")
    rows = report.get("bandwidth")
    if rows is None:
        return
    if not isinstance(rows, list):
        bad("bandwidth", rows, f"a list of rows {{{ROW_KEYS}}}")
    for i, row in enumerate(rows):
        where = f"bandwidth[{i}]"
        if not isinstance(row, dict):
            bad(where, row, f"an object {{{ROW_KEYS}}}")
        for key in ("op", "group"):
            if not isinstance(row.get(key, _MISSING), str):
                bad(f"{where}.{key}", row.get(key, _MISSING), "a string (an op such as all_reduce, a group such as tp)")
        size = row.get("bytes", _MISSING)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            bad(f"{where}.bytes", size, "the message size, an integer number of bytes > 0")
        busbw = row.get("busbw_gbps", _MISSING)
        if not is_finite_number(busbw) or busbw < 0:
            bad(f"{where}.busbw_gbps", busbw, "a bus bandwidth, a finite number of GB/s >= 0")
        latency = row.get("latency_us")
        if latency is not None and (not is_finite_number(latency) or latency < 0):
            bad(f"{where}.latency_us", latency, "the smallest size's time, a finite number of microseconds >= 0")
        crosses = row.get("crosses_nodes")
        if crosses is not None and not isinstance(crosses, bool):
            bad(f"{where}.crosses_nodes", crosses, "true or false")


def _largest_rows(rows: list[dict]) -> list[dict]:
    largest: dict[tuple, dict] = {}
    for row in rows:
        key = (row.get("op"), row.get("group"))
        if key not in largest or row.get("bytes", 0) > largest[key].get("bytes", 0):
            largest[key] = row
    return list(largest.values())


def _smallest_rows(rows: list[dict]) -> dict:
    smallest: dict[tuple, dict] = {}
    for row in rows:
        key = (row.get("op"), row.get("group"))
        if key not in smallest or row.get("bytes", 0) < smallest[key].get("bytes", 0):
            smallest[key] = row
    return smallest


def slope_busbw(large: dict, small: dict | None) -> float | None:
    """The bus bandwidth of the bytes beyond the smallest size: alpha-beta's ``1/beta``.

    ``busbw = factor * bytes / time`` (nccl-tests), so the same factor over the growth
    from the smallest to the largest size, ``factor * (B - b) / (T - t)``, prices the bytes
    without the call's fixed latency, which the step model adds once per call. None when
    the rows lack the times, or the larger size was not slower (a latency-bound sweep).

        Twice the time for 201,024 bytes as for 1,024 (an all-reduce of 2 ranks, factor 1):
        the largest size reads 1.005 MB/s, the 200,000 bytes beyond the first 2 MB/s.

        >>> slope_busbw({"bytes": 201024, "busbw_gbps": 0.00100512, "time_us": 200000.0},
        ...             {"bytes": 1024, "latency_us": 100000.0})
        0.002
    """
    if small is None or small is large or large.get("time_us") is None or small.get("latency_us") is None:
        return None
    grown_s = (large["time_us"] - small["latency_us"]) * 1e-6
    if grown_s <= 0:
        return None
    factor = large["busbw_gbps"] * 1e9 * large["time_us"] * 1e-6 / large["bytes"]
    return round(factor * (large["bytes"] - small["bytes"]) / grown_s / 1e9, 12)


def latency_table(rows: list[dict]) -> tuple:
    """``(op, group_size, us)`` triples: per op and group size, the median ``latency_us`` of the
    groups that ran it (the sweep's smallest size), ``sendrecv`` named ``send_recv`` as the
    traffic rows name it. Rows without ``group_size`` or ``latency_us`` are left out."""
    seen: dict[tuple, list] = {}
    for row in rows:
        n, latency = row.get("group_size"), row.get("latency_us")
        if isinstance(n, int) and n >= 2 and latency:
            op = "send_recv" if row["op"] == "sendrecv" else row["op"]
            seen.setdefault((op, n), []).append(latency)
    return tuple((op, n, float(median(v))) for (op, n), v in sorted(seen.items()) if op in LATENCY_OPS)


def calibrate(cluster: ClusterSpec, report: dict, source: str,
              sources: dict | None = None) -> tuple[ClusterSpec, dict]:
    """``cluster`` with the values ``report`` measured, and the updated ``sources``.

    Args:
        cluster: The configured cluster.
        report: A verify report (see the module docstring).
        source: The report's name, for the sources.
        sources: :func:`cluster_sources` of ``cluster`` (default: computed without a
            file section).

    Returns:
        ``(calibrated ClusterSpec, {key: source})``.

    Raises:
        ModelFileError: a malformed report (:func:`check_report`), naming ``source``.
    """
    if is_training_report(report):
        return calibrate_from_training(cluster, report, source, sources)
    check_report(report, source)
    sources = dict(sources or cluster_sources(cluster))
    values = {}
    compute = report.get("compute") or {}
    tflops = compute.get("tflops")
    if tflops is not None:
        what = f"{source}: compute.matmul {tflops:.4g} TFLOP/s ({compute.get('dtype', '?')})"
        if tflops <= cluster.peak_tflops:
            values["compute_efficiency"] = tflops / cluster.peak_tflops
            sources["compute_efficiency"] = f"{what} / peak"
        else:
            values["peak_tflops"], values["compute_efficiency"] = float(tflops), 1.0
            sources["peak_tflops"] = f"{what} (above the configured peak)"
            sources["compute_efficiency"] = f"{what}: 1 of the measured peak"
    # Eager rows only: an expert group's compiled all-to-all (mode "jit") repeats an op and group.
    rows = [r for r in report.get("bandwidth") or [] if r.get("busbw_gbps", 0) > 0
            and (r.get("mode") or "pynative") == "pynative"]
    smallest = _smallest_rows(rows)
    for crosses, where in ((False, "intra"), (True, "inter")):
        picked = [r for r in _largest_rows(rows) if bool(r.get("crosses_nodes")) == crosses]
        if not picked:
            continue
        label = f"{where}-node row(s)"
        slopes = [b for b in (slope_busbw(r, smallest.get((r["op"], r["group"]))) for r in picked) if b]
        if slopes:
            values[f"{where}_node_gbps"] = median(slopes)
            sources[f"{where}_node_gbps"] = (f"{source}: median busbw of {len(slopes)} {label} above the "
                                             "smallest size (alpha-beta)")
        else:
            values[f"{where}_node_gbps"] = median(r["busbw_gbps"] for r in picked)
            sources[f"{where}_node_gbps"] = f"{source}: median busbw of {len(picked)} {label}"
        latencies = [r["latency_us"] for r in picked if r.get("latency_us")]
        if latencies:
            values[f"{where}_node_latency_us"] = median(latencies)
            sources[f"{where}_node_latency_us"] = f"{source}: median latency of {len(latencies)} {label}"
        if not crosses:
            table = latency_table(picked)
            if table:
                values["collective_latency_us"] = table
                sources["collective_latency_us"] = (f"{source}: median latency per op and group size of "
                                                    f"{len(picked)} {label}")
    try:
        return replace(cluster, **values), sources
    except ModelError as err:  # a measured value the cluster cannot take: say where it came from
        raise ModelFileError(f"{source}: {err}", source) from None
