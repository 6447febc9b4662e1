"""Pure logic of ``msdist verify``: what the ranks run, and the report made of their results.

No MindSpore import: the parent process only launches and reads JSON.
"""

from __future__ import annotations

from mindscience.distributed.topology import Layout

CORRECTNESS = "correctness"
BANDWIDTH = "bandwidth"
CHECK_KINDS = (CORRECTNESS, BANDWIDTH)
DTYPES = ("float32", "float16", "bfloat16")
BANDWIDTH_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
BANDWIDTH_GROUPS = ("tp", "cp", "dp", "pp", "dp-cp", "world")
# Expert groups of a layout with split experts: all-to-all rows only (token dispatch), in
# PyNative and ms.jit as far as --mode asks for them.
A2A_GROUPS = ("ep", "etp-ep")
A2A_MODES = ("pynative", "jit")
MAPPING_GROUPS = ("tp", "cp", "dp", "pp", "dp-cp")
MODES = ("pynative", "jit", "graph")
DEFAULT_MODES = ("pynative", "jit")
ROW_KEY = ("check", "group", "mode", "split")


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: 2(n-1)/n for all-reduce, (n-1)/n otherwise."""
    if n <= 1:
        return 0.0
    if op == "sendrecv":
        return 1.0  # nccl-tests sendrecv_perf: busbw = algbw
    return 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def parse_checks(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in CHECK_KINDS]
    if bad or not kinds:
        raise ValueError(
            f"--checks {text!r} is invalid: expected a comma-separated subset of "
            f"{', '.join(CHECK_KINDS)}, e.g. 'correctness,bandwidth'."
        )
    return kinds


def parse_modes(text: str) -> tuple[str, ...]:
    """``"pynative,jit"`` -> ``("pynative", "jit")``; each of :data:`MODES` at most once."""
    modes = tuple(dict.fromkeys(m.strip().lower() for m in str(text).split(",") if m.strip()))
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(
            f"--mode {text!r} is invalid: expected a comma-separated subset of "
            f"{', '.join(MODES)}, e.g. 'pynative,jit'."
        )
    return modes


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """nccl-tests' -b/-e/-f: min, min*factor, ... up to max (inclusive)."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(
            f"--min-bytes {min_bytes} / --max-bytes {max_bytes} are invalid: expected "
            "1 <= min-bytes <= max-bytes."
        )
    if factor < 2:
        raise ValueError(f"--factor {factor} is invalid: expected an integer >= 2.")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def parse_bytes(text: str) -> int:
    """``"64K"``, ``"1M"``, ``"1048576"`` -> bytes (powers of 1024)."""
    units = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
    raw = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = raw, ""
    if raw and raw[-1] in "KMG":
        number, unit = raw[:-1], raw[-1]
    try:
        value = int(float(number) * units[unit])
    except (ValueError, KeyError):
        raise ValueError(f"size {text!r} is invalid: expected bytes such as 1024, 64K or 16M.") from None
    if value < 1:
        raise ValueError(f"size {text!r} is invalid: expected at least 1 byte.")
    return value


def build_spec(
    layout: Layout,
    kinds=CHECK_KINDS,
    sizes=(1024, 262144),
    iters: int = 3,
    warmup: int = 1,
    dtype: str = "float32",
    fault: dict | None = None,
    modes=DEFAULT_MODES,
) -> dict:
    """The worker spec: named checks each rank runs, in order.

    ``modes`` are the execution modes of the correctness battery: every mapping runs in
    each (PyNative, ``ms.jit``, GRAPH_MODE), the layers against the dense layer in
    PyNative and, for compiled modes, against PyNative too (``layers.modes``).
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is invalid: expected one of {', '.join(DTYPES)}.")
    if iters < 1 or warmup < 0:
        raise ValueError(f"--iters {iters} / --warmup {warmup} are invalid: expected iters >= 1, warmup >= 0.")
    active = [k for k in MAPPING_GROUPS if layout.size(k) > 1]
    checks = [{"name": "layout.init", "params": {}}]
    if fault:
        checks.append({"name": fault["name"], "params": fault["params"]})
    if CORRECTNESS in kinds:
        modes = list(modes)
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise ValueError(f"modes {modes!r} are invalid: expected a subset of {', '.join(MODES)}.")
        # One 3-D shape exercises both the first and the last dim; sized per group.
        checks.append(
            {"name": "mappings.all", "params": {"groups": active, "dtypes": [dtype],
                                                "shapes": [["G", 3, "2G"]], "modes": modes}}
        )
        # Each sequence mapping once more on an uneven sequence (S = 2G + 1).
        checks.append(
            {"name": "mappings.all", "params": {"groups": active, "dtypes": [dtype],
                                                "shapes": [["G", 3, "2G"]], "modes": modes,
                                                "split_sizes": "auto"}}
        )
        if layout.tp > 1:
            # Every bias x gather/input_is_parallel x sequence-parallel configuration;
            # skip_bias_add only reorders the same numbers and is left to the test suite.
            checks.append({"name": "layers.dense_equivalence", "params": {"skip_bias_add": False}})
            compiled = [m for m in modes if m != "pynative"]
            if compiled:
                checks.append({"name": "layers.modes", "params": {"modes": compiled}})
        checks.extend(parallel_layer_checks(layout, dtype, modes))
        checks.extend(moe_checks(layout, modes))
        if layout.pp > 1:
            checks.extend(pipeline_checks(dtype, modes))
    if BANDWIDTH in kinds:
        # The compute probe rides with the bandwidth sweep: both feed --calibrate.
        checks.append({"name": "compute.matmul", "params": {"dtype": dtype}})
        checks.append(
            {
                "name": "bandwidth.sweep",
                "params": {
                    "groups": list(BANDWIDTH_GROUPS),
                    "ops": list(BANDWIDTH_OPS),
                    "sizes": list(sizes),
                    "iters": iters,
                    "warmup": warmup,
                    "dtype": dtype,
                    **_a2a_params(layout, modes),
                },
            }
        )
        if layout.pp > 1:
            checks.append({"name": "bandwidth.sendrecv", "params": {
                "sizes": list(sizes), "iters": iters, "warmup": warmup, "dtype": dtype}})
    return {"layout": {k: v for k, v in layout.to_dict().items()}, "checks": checks}


def _a2a_params(layout: Layout, modes) -> dict:
    """The sweep's expert all-to-all rows: on ep and etp-ep when the experts are split
    (ep > 1 or etp != tp; otherwise their groups are dense ones, already swept)."""
    if not layout.has_experts_split:
        return {}
    a2a_modes = [m for m in modes if m in A2A_MODES] or ["pynative"]
    return {"a2a_groups": list(A2A_GROUPS), "a2a_modes": a2a_modes}


def parallel_layer_checks(layout: Layout, dtype: str, modes) -> list:
    """The vocabulary-parallel embedding and cross-entropy and the RNG tracker on the tp
    group (tp > 1); the three context-parallel attentions on the cp group (cp > 1): each
    method causal, GQA, uneven in the run's dtype and in each of its modes (compiled as one
    graph per mode), and the zigzag ring in PyNative (the test suite runs the whole matrix;
    this is the layout's health check)."""
    checks = []
    compiled = [m for m in modes if m != "pynative"]
    if layout.tp > 1:
        checks += [
            {"name": "vocab.embedding", "params": {"modes": list(modes), "dtypes": [dtype]}},
            {"name": "vocab.cross_entropy", "params": {"modes": list(modes), "dtypes": [dtype]}},
            {"name": "vocab.errors", "params": {}},
            {"name": "random.tracker", "params": {}},
        ]
    if layout.cp > 1:
        if "pynative" in modes:
            checks.append({"name": "attention.methods", "params": {"cases": "verify",
                                                                   "dtypes": [dtype]}})
        if compiled:
            checks.append({"name": "attention.methods", "params": {"modes": compiled,
                                                                   "cases": "verify_compiled",
                                                                   "dtypes": [dtype]}})
        checks.append({"name": "attention.errors", "params": {}})
    return checks


def moe_checks(layout: Layout, modes) -> list:
    """The ``moe`` family on a layout with ep > 1 (PyNative and jit; GRAPH_MODE runs as
    jit): the uneven all-to-all over ep and the dispatch round trip, and the MoE layer
    (forward, backward, expert gradients reduced over edp) against the one-rank layer,
    dropless and with a capacity factor."""
    if getattr(layout, "ep", 1) <= 1:
        return []
    moe_modes = [m for m in ("pynative", "jit") if m in modes or (m == "jit" and "graph" in modes)]
    return [
        {"name": "moe.dispatch", "params": {"modes": moe_modes}},
        {"name": "moe.layer", "params": {"modes": moe_modes, "cases": [
            {"name": "dropless", "aux_loss_coeff": 0.01, "z_loss_coeff": 0.001},
            {"name": "capacity", "capacity_factor": 1.0, "modes": ["pynative"]}]}},
    ]


def pipeline_checks(dtype: str, modes) -> list:
    """What verify runs on a layout with pp > 1: ring_shift on the pp group both ways
    (``dtype`` and bfloat16, each mode), Megatron's six calls between every neighbouring
    pair (both directions), and one 1F1B step of a toy stage against the dense model."""
    dtypes = list(dict.fromkeys([dtype, "bfloat16"]))
    return [
        {"name": "p2p.ring", "params": {"groups": ["pp"], "offsets": [1, -1], "dtypes": dtypes,
                                        "modes": list(modes)}},
        {"name": "p2p.pipeline", "params": {"dtypes": dtypes}},
        {"name": "pipeline.step", "params": {"schedules": ["1f1b"], "modes": list(modes)}},
    ]


def _records(ranks: dict):
    for rank, result in sorted(ranks.items()):
        if not result:
            continue
        for record in result.get("records", []):
            yield int(rank), record


def correctness_rows(ranks: dict) -> list[dict]:
    """check x group x mode (x even/uneven split) rows: passed on every rank (and every
    dtype/shape), worst error."""
    from mindscience.distributed.harness.launcher import merge_records

    # Records of checks that have no execution mode (groups, layouts) ran eagerly.
    without_bandwidth = {
        rank: {"records": [{**r, "mode": r.get("mode") or "pynative"}
                           for r in (state or {}).get("records", []) if r.get("check") != "bandwidth"]}
        for rank, state in ranks.items()
    }
    return merge_records(without_bandwidth, key=ROW_KEY)


def group_crosses_nodes(layout: Layout | None, label: str) -> bool:
    """Whether a bandwidth group (``"tp"``, ``"cp=dp-cp"``, ``"world"``) spans nodes."""
    if layout is None:
        return False
    key = label.split("=")[0]
    if key.startswith("pp:"):  # a neighbour pair of the sendrecv rows: "pp:<a>-<b>"
        a, b = (int(r) for r in key[3:].split("-"))
        return layout.node_of(a) != layout.node_of(b)
    if key == "world":
        return layout.num_nodes > 1
    return layout.crossing_group_count(key) > 0


def compute_summary(ranks: dict) -> dict | None:
    """``{"tflops" (slowest rank), "tflops_per_rank", "dtype", "shape"}`` of the compute probe, or None."""
    found = {rank: r for rank, r in _records(ranks) if r.get("check") == "compute.matmul" and "tflops" in r}
    if not found:
        return None
    first = next(iter(found.values()))
    return {"tflops": min(r["tflops"] for r in found.values()),
            "tflops_per_rank": {str(rank): r["tflops"] for rank, r in sorted(found.items())},
            "dtype": first["dtype"], "shape": first["shape"]}


def bandwidth_rows(ranks: dict, layout: Layout | None = None) -> list[dict]:
    """op x group x size (x mode) rows: slowest rank's time, algbw, busbw, total wrong
    elements, and per op, group and mode ``latency_us`` (the smallest size's time) and
    ``crosses_nodes``. ``mode`` is ``pynative`` except the expert groups' compiled
    all-to-all rows (``jit``)."""
    rows: dict[tuple, dict] = {}
    for _, record in _records(ranks):
        if record.get("check") != "bandwidth":
            continue
        mode = record.get("mode") or "pynative"
        key = (record["op"], record["group"], record["bytes"], record["dtype"], mode)
        row = rows.get(key)
        if row is None:
            rows[key] = row = {
                "op": record["op"],
                "mode": mode,
                "group": record["group"],
                "group_size": record["group_size"],
                "bytes": record["bytes"],
                "dtype": record["dtype"],
                "time_us": 0.0,
                "wrong": 0,
                "composed": bool(record.get("composed")),
            }
        row["time_us"] = max(row["time_us"], float(record["time_us"]))
        row["wrong"] += int(record.get("wrong", 0))
    smallest: dict[tuple, dict] = {}
    for row in rows.values():
        seconds = row["time_us"] * 1e-6
        row["algbw_gbps"] = row["bytes"] / seconds / 1e9 if seconds > 0 else 0.0
        row["busbw_gbps"] = row["algbw_gbps"] * bus_factor(row["op"], row["group_size"])
        row["crosses_nodes"] = group_crosses_nodes(layout, row["group"])
        key = (row["op"], row["group"], row["dtype"], row["mode"])
        if key not in smallest or row["bytes"] < smallest[key]["bytes"]:
            smallest[key] = row
    for row in rows.values():
        row["latency_us"] = smallest[(row["op"], row["group"], row["dtype"], row["mode"])]["time_us"]
    return list(rows.values())


def busbw_misses(rows: list[dict], min_busbw: float | None) -> list[dict]:
    """Rows at the largest measured size of each op/group whose busbw is below the bar."""
    if not min_busbw:
        return []
    largest: dict[tuple, dict] = {}
    for row in rows:
        key = (row["op"], row["group"], row.get("mode"))
        if key not in largest or row["bytes"] > largest[key]["bytes"]:
            largest[key] = row
    return [r for r in largest.values() if r["busbw_gbps"] < min_busbw]


def build_report(
    layout: Layout,
    ranks: dict,
    failures: list[dict],
    min_busbw: float | None = None,
    duration_s: float | None = None,
) -> dict:
    """The verify report (the JSON printed with --format json).

    ``ok`` needs every rank to have finished all its checks, every value to be right,
    no failed rank and (with ``min_busbw``) every largest-size busbw above the bar.
    """
    correctness = correctness_rows(ranks)
    bandwidth = bandwidth_rows(ranks, layout)
    misses = busbw_misses(bandwidth, min_busbw)
    finished = [r for r in range(layout.world_size) if (ranks.get(r) or {}).get("status") == "done"]
    ok = (
        not failures
        and len(finished) == layout.world_size
        and all(r["passed"] for r in correctness)
        and all(r["wrong"] == 0 for r in bandwidth)
        and not misses
    )
    return {
        "ok": ok,
        "layout": layout.to_dict(),
        "ranks": layout.world_size,
        "duration_s": duration_s,
        "correctness": correctness,
        "compute": compute_summary(ranks),
        "bandwidth": bandwidth,
        "busbw_misses": misses,
        "sendrecv_slowest": slowest_pair(bandwidth),
        "summary": summary_rows(correctness),
        "failures": list(failures),
    }


def slowest_pair(rows: list[dict]) -> dict | None:
    """The neighbour pair with the lowest sendrecv busbw at the largest size, or None."""
    pairs = [r for r in rows if r["op"] == "sendrecv"]
    if not pairs:
        return None
    top = max(r["bytes"] for r in pairs)
    worst = min((r for r in pairs if r["bytes"] == top), key=lambda r: r["busbw_gbps"])
    return {"group": worst["group"], "bytes": worst["bytes"], "busbw_gbps": worst["busbw_gbps"],
            "time_us": worst["time_us"], "crosses_nodes": worst["crosses_nodes"]}


def check_family(check: str) -> str:
    """``"mapping.copy_to_all"`` -> ``"mapping"``; ``"p2p.error.shape_sender"`` -> ``"p2p"``."""
    return check.split(".")[0]


def summary_rows(correctness: list[dict]) -> list[dict]:
    """One row per family of checks and mode: rows passed / failed, the worst error."""
    out: dict = {}
    for row in correctness:
        key = (check_family(row["check"]), row.get("mode") or "pynative")
        s = out.setdefault(key, {"family": key[0], "mode": key[1], "passed": 0, "failed": 0,
                                 "max_error": None})
        s["passed" if row["passed"] else "failed"] += 1
        err = row.get("max_error")
        if err is not None and (s["max_error"] is None or err > s["max_error"]):
            s["max_error"] = err
    return list(out.values())


# ------------------------------------------------------------------ a saved report (--from-report)
_NUMBER, _INTEGER, _BOOL, _TEXT = "a number", "an integer", "true or false", "a string"
_LIST, _OBJECT = "a list", "an object"
# What the human view and --plot read of a report: key -> expected kind. Rows of the lists
# are objects with the keys of REPORT_ROWS; optional sections are checked when present.
REPORT_KEYS = {"ok": _BOOL, "layout": _OBJECT, "ranks": _INTEGER, "correctness": _LIST, "bandwidth": _LIST,
               "failures": _LIST}
REPORT_LAYOUT = {"tp": _INTEGER, "cp": _INTEGER, "dp": _INTEGER, "pp": _INTEGER, "order": _TEXT, "backend": _TEXT}
REPORT_ROWS = {
    "correctness": {"check": _TEXT, "group": _TEXT, "passed": _BOOL},
    "bandwidth": {"op": _TEXT, "group": _TEXT, "group_size": _INTEGER, "bytes": _INTEGER, "dtype": _TEXT,
                  "time_us": _NUMBER, "algbw_gbps": _NUMBER, "busbw_gbps": _NUMBER, "wrong": _INTEGER,
                  "composed": _BOOL},
    "failures": {"rank": _INTEGER, "reason": _TEXT},
    "summary": {"family": _TEXT, "mode": _TEXT, "passed": _INTEGER, "failed": _INTEGER},
    "busbw_misses": {"op": _TEXT, "group": _TEXT, "bytes": _INTEGER, "busbw_gbps": _NUMBER},
}
REPORT_OPTIONAL = {"compute": {"tflops": _NUMBER, "dtype": _TEXT, "shape": _LIST},
                   "sendrecv_slowest": {"group": _TEXT, "bytes": _INTEGER, "busbw_gbps": _NUMBER}}


def _is(value, kind: str) -> bool:
    if kind == _BOOL:
        return isinstance(value, bool)
    if isinstance(value, bool):  # JSON true is not a number here
        return False
    return isinstance(value, {_NUMBER: (int, float), _INTEGER: int, _TEXT: str, _LIST: list, _OBJECT: dict}[kind])


def check_report(report, source: str) -> None:
    """Check that ``report`` holds what ``msdist verify`` prints and plots of a report.

    Raises:
        ValueError: one line naming ``source`` and the first missing or mistyped key
            (``failures``, ``layout.tp``, ``bandwidth[3].busbw_gbps``).
    """
    wrote = "the JSON `msdist verify --output FILE` wrote"
    if not isinstance(report, dict) or not set(REPORT_KEYS) & set(report):
        raise ValueError(f"{source}: not a msdist verify report: expected {wrote}, with keys "
                         f"{', '.join(REPORT_KEYS)}.")

    def need(mapping: dict, schema: dict, where: str) -> None:
        for key, kind in schema.items():
            name = f"{where}{key}"
            if key not in mapping:
                raise ValueError(f"{source}: key {name!r} is missing: expected {kind}; pass {wrote} "
                                 f"(a report needs {', '.join(schema)}{' in ' + where[:-1] if where else ''}).")
            if not _is(mapping[key], kind):
                raise ValueError(f"{source}: key {name!r} is {mapping[key]!r}: expected {kind}; pass {wrote}.")

    need(report, REPORT_KEYS, "")
    need(report["layout"], REPORT_LAYOUT, "layout.")
    for section, schema in REPORT_ROWS.items():
        rows = report.get(section)
        if rows is None and section not in REPORT_KEYS:
            continue
        if not isinstance(rows, list):
            raise ValueError(f"{source}: key {section!r} is {rows!r}: expected {_LIST}; pass {wrote}.")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ValueError(f"{source}: key '{section}[{i}]' is {row!r}: expected {_OBJECT}; pass {wrote}.")
            need(row, schema, f"{section}[{i}].")
    for section, schema in REPORT_OPTIONAL.items():
        value = report.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"{source}: key {section!r} is {value!r}: expected {_OBJECT}; pass {wrote}.")
        need(value, schema, f"{section}.")


def load_report(path: str) -> dict:
    """A verify report saved with ``--output`` (JSON), checked by :func:`check_report`.

    Raises:
        ValueError: an unreadable file, not JSON, or a report the human view or
            ``--plot`` could not show (one line naming the key).
    """
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            report = json.load(fh)
    except (OSError, ValueError) as err:
        raise ValueError(f"--from-report {path}: cannot read it as JSON ({err}).") from None
    check_report(report, f"--from-report {path}")
    return report
