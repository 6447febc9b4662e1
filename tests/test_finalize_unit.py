"""GradientFinalizer without communication: bucket planning, the reference, errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindscience.distributed.finalize import GradientFinalizer, finalize_gradients, plan_buckets  # noqa: E402
from mindscience.distributed.topology import Layout  # noqa: E402
from _training_checks import finalize_reference  # noqa: E402


def test_plan_buckets_by_dtype_and_size():
    f32, bf16 = ms.float32, ms.bfloat16
    # 10 + 10 float32 elements fit 80 bytes, 30 do not; the bf16 one gets its own bucket.
    assert plan_buckets(range(3), (10, 10, 30), (f32, f32, f32), 80) == ((0, 1), (2,))
    assert plan_buckets(range(4), (10, 10, 30, 5), (f32, bf16, f32, bf16), 1 << 20) == ((0, 2), (1, 3))
    assert plan_buckets(range(3), (1, 1, 1), (f32, f32, f32), 0) == ((0,), (1,), (2,))
    assert plan_buckets([], (), (), 100) == ()


def test_reference_sums_sequence_parallel_over_tp_then_averages_dp_cp():
    lay = Layout(world_size=8, tp=2, cp=2, pp=1)  # dp = 2, dp-cp of rank 0 = {0, 2, 4, 6}
    params = (((2,), "float32", True), ((2,), "float32", False))
    ref = finalize_reference(lay, 0, params)
    from _training_checks import _grad_values

    dpcp = lay.group_of(0, "dp-cp")
    want_sp = sum(sum(_grad_values(k, 0, (2,)) for k in lay.group_of(m, "tp")) for m in dpcp) / len(dpcp)
    want = sum(_grad_values(m, 1, (2,)) for m in dpcp) / len(dpcp)
    assert np.array_equal(ref[0], want_sp) and np.array_equal(ref[1], want)


def test_single_process_is_identity_and_checks_counts():
    params = [ms.Parameter(ms.Tensor(np.zeros((2, 3), np.float32)), name=f"w{i}") for i in range(3)]
    grads = tuple(ms.Tensor(np.full((2, 3), i + 1.0, np.float32)) for i in range(3))
    out = GradientFinalizer(params)(grads)
    assert [float(g.asnumpy()[0, 0]) for g in out] == [1.0, 2.0, 3.0]
    assert [float(g.asnumpy()[0, 0]) for g in finalize_gradients(grads, params)] == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="2 gradients for 3 parameters"):
        GradientFinalizer(params)(grads[:2])
    with pytest.raises(ValueError, match="bucket_size_mb=-1"):
        GradientFinalizer(params, bucket_size_mb=-1)


def test_function_form_inside_jit_says_what_to_do(tmp_path):
    # ms.jit needs the source in a file.
    script = tmp_path / "fg.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, mindspore as ms
        from mindscience.distributed import finalize_gradients
        params = [ms.Parameter(ms.Tensor(np.zeros((2,), np.float32)), name="q0")]
        grads = (ms.Tensor(np.ones((2,), np.float32)),)
        @ms.jit
        def f(g):
            return finalize_gradients(g, params)
        try:
            f(grads)
        except RuntimeError as exc:
            print("MESSAGE", str(exc).splitlines()[0])
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    line = next(l for l in out.stdout.splitlines() if l.startswith("MESSAGE"))
    assert "GradientFinalizer(params)" in line and "ms.jit" in line
