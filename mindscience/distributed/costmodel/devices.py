"""Device presets for ``cluster.device``: peak compute, memory, link bandwidths and latencies.

A preset fills every ``cluster:`` key the file leaves out; keys written in the file win.
The figures are nominal (vendor peaks, typical achievable bus bandwidths and small-message
latencies of NCCL/HCCL rings; sources in docs/COST_MODEL.md, "Device presets"): for
numbers of your own cluster run ``msdist verify`` there and pass its report to
``--calibrate``.

    >>> DEVICE_PRESETS["h100-80gb"]["peak_tflops"]
    989.0
    >>> sorted(DEVICE_PRESETS)[:2]
    ['a100-80gb', 'ascend-910b']
"""

from __future__ import annotations

from .errors import ModelError

# peak_tflops: dense bf16/fp16 tensor throughput per device (no sparsity).
# intra/inter_node_gbps: achievable per-device bus bandwidth (nccl-tests' busbw) inside a
# node and across nodes; *_latency_us: time of one small collective call.
DEVICE_PRESETS: dict[str, dict] = {
    "ascend-910b": {
        "peak_tflops": 313.0, "device_memory_gb": 64, "intra_node_gbps": 90.0, "inter_node_gbps": 22.0,
        "intra_node_latency_us": 20.0, "inter_node_latency_us": 40.0,
        "about": "Huawei Ascend 910B: 313 TFLOPS fp16, 64 GB HBM, HCCS inside a node, 200 Gb/s RoCE per device",
    },
    "a100-80gb": {
        "peak_tflops": 312.0, "device_memory_gb": 80, "intra_node_gbps": 230.0, "inter_node_gbps": 22.0,
        "intra_node_latency_us": 10.0, "inter_node_latency_us": 25.0,
        "about": "NVIDIA A100 80GB SXM: 312 TFLOPS bf16, NVLink 3 (600 GB/s), 200 Gb/s HDR InfiniBand per GPU",
    },
    "h100-80gb": {
        "peak_tflops": 989.0, "device_memory_gb": 80, "intra_node_gbps": 360.0, "inter_node_gbps": 45.0,
        "intra_node_latency_us": 10.0, "inter_node_latency_us": 25.0,
        "about": "NVIDIA H100 80GB SXM: 989 TFLOPS bf16, NVLink 4 (900 GB/s), 400 Gb/s NDR InfiniBand per GPU",
    },
    "h200": {
        "peak_tflops": 989.0, "device_memory_gb": 140, "intra_node_gbps": 360.0, "inter_node_gbps": 45.0,
        "intra_node_latency_us": 10.0, "inter_node_latency_us": 25.0,
        "about": "NVIDIA H200 SXM: 989 TFLOPS bf16, 141 GB HBM3e, NVLink 4, 400 Gb/s NDR InfiniBand per GPU",
    },
    # Fitted to msdist train's quiet steps on the project's 2-core machine (docs/COST_MODEL.md,
    # "Ranks sharing cores"; bench/cpu_preset_steps.json): per rank on a core of its own, an
    # operator launch 150 us, a ring hop 150 us and 13 MB/s (1, 4 and 8 ranks, divided by
    # ranks / cores).
    "cpu": {
        "peak_tflops": 0.1, "device_memory_gb": 16, "intra_node_gbps": 0.013, "inter_node_gbps": 0.013,
        "intra_node_latency_us": 150.0, "inter_node_latency_us": 300.0,
        # Ranks share this machine's cores (local_cores()); each operator costs a launch.
        "cores_per_node": "local", "op_overhead_us": 150.0,
        "about": "MindSpore's CPU backend (ranks sharing the machine's cores, collectives over loopback)",
    },
}
PRESET_KEYS = ("peak_tflops", "device_memory_gb", "intra_node_gbps", "inter_node_gbps",
               "intra_node_latency_us", "inter_node_latency_us")
# Keys of the hosts whose ranks share CPU cores (the `cpu` preset); accelerator presets leave them out.
HOST_KEYS = ("cores_per_node", "op_overhead_us")
CORES_ENV = "MSDIST_CPU_CORES"


def local_cores() -> int:
    """The cores ranks of this machine share: ``$MSDIST_CPU_CORES``, else the CPUs this process may run on.

    The ``cpu`` preset's ``cores_per_node`` (``"local"``): ``msdist train`` runs its ranks
    here. ``MSDIST_CPU_CORES`` prices another host's cores (the documentation's outputs pin
    it to the 2 cores they were recorded on).
    """
    import os

    value = os.environ.get(CORES_ENV, "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ModelError(f"{CORES_ENV}={value!r} is invalid: expected a whole number of cores >= 1, e.g. 2 "
                             "(or unset it to use this machine's).")
        return int(value)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def device_names() -> list[str]:
    """The preset names, for ``--help`` and error messages."""
    return sorted(DEVICE_PRESETS)


def describe_devices() -> str:
    """One line per preset: name, peak TFLOPS, memory, bandwidths (``msdist suggest --help``)."""
    return "; ".join(
        f"{name} ({p['peak_tflops']:g} TFLOPS, {p['device_memory_gb']:g} GiB, "
        f"{p['intra_node_gbps']:g}/{p['inter_node_gbps']:g} GB/s)"
        for name, p in sorted(DEVICE_PRESETS.items()))
