"""DistributedOptimizer: pure shard/bucket arithmetic, argument checks, one-process steps
against a numpy AdamW, and (multiprocess) training at tp2 x dp2, dp4 and pp2 x dp2 against
GradientFinalizer + a numpy AdamW (tests/_optimizer_checks.py, one 4-rank launch)."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

import _optimizer_job as job_mod
from mindscience.distributed.optimizer import DistributedOptimizerError
from mindscience.distributed.optimizer.layout import (
    bytes_per_element, param_shard, plan_buckets, shard_range, shard_rows,
)
from mindscience.distributed.optimizer.validate import check_grads, check_group, check_options

ADAM_STATES = 3  # fp32 main weights, exp_avg, exp_avg_sq


# ----------------------------------------------------------------------------- pure layout
def test_layout_imports_no_mindspore():
    code = ("import sys; import mindscience.distributed.optimizer.layout, "
            "mindscience.distributed.optimizer.validate; print('mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("rows,d,want", [(5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),
                                         (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
                                         (1, 3, [(0, 1), (1, 1), (1, 1)]),
                                         (7, 1, [(0, 7)])])
def test_shard_ranges_cover_the_rows_once(rows, d, want):
    got = [shard_range(rows, d, k) for k in range(d)]
    assert got == want
    assert shard_rows(rows, d) == math.ceil(rows / d)


def test_param_shard_of_a_matrix_and_of_a_scalar():
    sh = param_shard((5, 3), 4)
    assert (sh.shard_rows, sh.rest, sh.pad, sh.shard_shape, sh.padded_shape) == (2, 3, 3, (2, 3), (8, 3))
    assert (sh.numel, sh.shard_numel, sh.padded_numel) == (15, 6, 24)
    scalar = param_shard((), 2)
    assert (scalar.shape, scalar.shard_shape, scalar.pad) == ((1,), (1,), 1)


def test_bucket_layout_lands_each_rank_on_its_shard():
    """The flat buffer of the module docstring: cut into d chunks, chunk k is rank k's
    rows of every member, padding where the parameter has none."""
    shards = [param_shard((3, 2), 2), param_shard((4,), 2)]
    (bucket,) = plan_buckets(shards, ["float32", "float32"], 1 << 20, sharded=True)
    assert (bucket.members, bucket.sections, bucket.chunk, bucket.size) == ((0, 1), (4, 2), 6, 12)
    w = np.arange(6, dtype=np.float32).reshape(3, 2) + 1
    b = np.arange(4, dtype=np.float32) + 10
    parts = []
    for sh, g in zip(shards, (w, b)):
        flat = g.reshape(sh.rows, sh.rest)
        flat = np.concatenate([flat, np.zeros((sh.pad, sh.rest), np.float32)])
        parts.append(flat.reshape(2, sh.shard_numel))
    buffer = np.concatenate(parts, axis=1).reshape(-1)
    chunks = buffer.reshape(2, bucket.chunk)
    np.testing.assert_array_equal(chunks[0], [1, 2, 3, 4, 10, 11])
    np.testing.assert_array_equal(chunks[1], [5, 6, 0, 0, 12, 13])


def test_buckets_split_by_size_and_dtype_and_keep_order():
    shards = [param_shard((10,), 2), param_shard((10,), 2), param_shard((30,), 2),
              param_shard((4,), 2)]
    dtypes = ["float32", "bfloat16", "float32", "float32"]
    buckets = plan_buckets(shards, dtypes, bucket_bytes=100, sharded=True)
    # fp32 buffers: 40 B, 40 B, 120 B, 16 B; one bucket per dtype up to 100 B.
    assert [b.members for b in buckets] == [(0,), (1,), (2,), (3,)]
    merged = plan_buckets(shards, dtypes, bucket_bytes=1000, sharded=True)
    assert [b.members for b in merged] == [(0, 2, 3), (1,)]
    assert plan_buckets(shards, dtypes, bucket_bytes=0, sharded=False)[0].sections == (10,)


@pytest.mark.parametrize("w,d,stage,want", [
    (2, 4, 0, 18), (2, 4, 1, 2 + 4 + 3), (2, 4, 2, 2 + 16 / 4), (2, 4, 3, 18 / 4),
    (4, 8, 0, 16), (4, 8, 1, 8 + 12 / 8), (4, 8, 2, 4 + 16 / 8), (4, 8, 3, 20 / 8),
])
def test_bytes_per_element_is_contract_c2(w, d, stage, want):
    assert bytes_per_element(stage, d, w)["total"] == pytest.approx(want)


def test_sgd_bytes_per_element():
    assert bytes_per_element(0, 2, 4, "sgd", 0.9)["optimizer"] == 4
    assert bytes_per_element(0, 2, 4, "sgd", 0.0)["optimizer"] == 0
    assert bytes_per_element(1, 2, 2, "sgd", 0.9)["optimizer"] == 4


# ----------------------------------------------------------------------------- validation
def _options(**kw):
    args = dict(optimizer="adamw", zero_stage=1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                bucket_size_mb=None, max_grad_norm=None, momentum=0.9, lr_is_schedule=False, lr=1e-3)
    args.update(kw)
    return check_options(**args)


@pytest.mark.parametrize("kw,words", [
    ({"zero_stage": 4}, ["zero_stage=4", "0, 1, 2 or 3"]),
    ({"zero_stage": True}, ["zero_stage=True"]),
    ({"optimizer": "lamb"}, ["'lamb'", "adamw, adam, sgd"]),
    ({"lr": float("nan")}, ["lr=nan"]),
    ({"betas": (0.9,)}, ["betas=(0.9,)"]),
    ({"eps": -1.0}, ["eps=-1.0"]),
    ({"eps": 0.0}, ["eps=0"]),
    ({"weight_decay": "x"}, ["weight_decay='x'"]),
    ({"bucket_size_mb": -1}, ["bucket_size_mb=-1"]),
    ({"max_grad_norm": -2.0}, ["max_grad_norm=-2.0"]),
    ({"momentum": 1.0}, ["momentum=1.0", "[0, 1)"]),
])
def test_option_errors_name_the_value(kw, words):
    with pytest.raises(DistributedOptimizerError) as exc:
        _options(**kw)
    assert all(w in str(exc.value) for w in words), str(exc.value)
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, TypeError)


def test_good_options_return_the_betas():
    assert _options(betas=[0.8, 0.99]) == (0.8, 0.99)


class _Group:
    def __init__(self, ranks, rank, key="dp-cp"):
        self.ranks, self.rank, self.key = tuple(ranks), rank, key


def test_group_checks():
    check_group(_Group((1, 3), 0), 1, [1, 3])  # the dp-cp group itself
    check_group(_Group((3,), 0), 3, [1, 3])    # a subset
    with pytest.raises(DistributedOptimizerError, match=r"does not hold this rank \(1\)"):
        check_group(_Group((0, 2), 0), 1, [1, 3])
    with pytest.raises(DistributedOptimizerError, match=r"ranks \[2\] are outside"):
        check_group(_Group((1, 2), 0), 1, [1, 3])


class _G:
    def __init__(self, shape):
        self.shape = shape


def test_gradient_checks():
    shapes, dts = [(2, 3), (4,)], ["bfloat16", "float32"]
    check_grads((_G((2, 3)), _G((4,))), shapes, dts, ["float32", "float32"])
    with pytest.raises(DistributedOptimizerError, match="got 1 gradients for 2 parameters"):
        check_grads((_G((2, 3)),), shapes, dts, ["float32"])
    with pytest.raises(DistributedOptimizerError, match=r"grads\[1\] has shape \(5,\)"):
        check_grads((_G((2, 3)), _G((5,))), shapes, dts, ["float32", "float32"])
    with pytest.raises(DistributedOptimizerError, match=r"grads\[0\] has dtype float16"):
        check_grads((_G((2, 3)), _G((4,))), shapes, dts, ["float16", "float32"])
    with pytest.raises(DistributedOptimizerError, match="expected a tuple"):
        check_grads(_G((2, 3)), shapes, dts, [])


# ----------------------------------------------------------------------------- one process
def _numpy_adamw(w, grads_seq, lr, wd, b1=0.9, b2=0.999, eps=1e-8):
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t, g in enumerate(grads_seq, start=1):
        w = w * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - lr / (1 - b1 ** t) * m / (np.sqrt(v) / math.sqrt(1 - b2 ** t) + eps)
    return w


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_one_process_step_equals_numpy_adamw(stage):
    import mindspore as ms

    from mindscience.distributed.optimizer import DistributedOptimizer

    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((5, 3)).astype(np.float32)
    p = ms.Parameter(ms.Tensor(w0), name=f"w{stage}")
    opt = DistributedOptimizer([p], lr=0.05, weight_decay=0.1, zero_stage=stage)
    grads = [rng.standard_normal((5, 3)).astype(np.float32) for _ in range(3)]
    for g in grads:
        assert bool(opt((ms.Tensor(g),)).asnumpy())
    want = _numpy_adamw(w0.astype(np.float64), [g.astype(np.float64) for g in grads], 0.05, 0.1)
    np.testing.assert_allclose(p.asnumpy(), want, rtol=0, atol=2e-6)
    assert int(opt.step.asnumpy()) == 3
    names = sorted(q.name for q in opt.get_parameters())
    assert f"w{stage}.exp_avg" in names and f"w{stage}.exp_avg_sq" in names
    # fp32 weights: stage 0 keeps no main copy (C2), stages 1-3 do.
    assert (f"w{stage}.main" in names) == (stage > 0)
    assert opt.memory_bytes() == {"weights": 60, "gradients": 60,
                                  "optimizer": 60 * (2 + (stage > 0))}


def test_one_process_clipping_returns_the_norm_and_scales_the_step():
    import mindspore as ms

    from mindscience.distributed.optimizer import DistributedOptimizer

    p = ms.Parameter(ms.Tensor(np.zeros((4,), np.float32)), name="clip_w")
    opt = DistributedOptimizer([p], optimizer="sgd", lr=1.0, momentum=0.0, max_grad_norm=1.0)
    g = np.array([3.0, 4.0, 0.0, 0.0], np.float32)  # norm 5
    norm = opt((ms.Tensor(g),))
    assert float(norm.asnumpy()) == pytest.approx(5.0)
    np.testing.assert_allclose(p.asnumpy(), -g / (5.0 + 1e-6), rtol=1e-6)


def test_one_process_bf16_weights_keep_an_fp32_main_copy():
    import mindspore as ms

    from mindscience.distributed.optimizer import DistributedOptimizer

    w0 = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    p = ms.Parameter(ms.Tensor(w0, ms.bfloat16), name="bf16_w")
    opt = DistributedOptimizer([p], lr=1e-3, zero_stage=0)
    g = np.full((2, 4), 0.5, np.float32)
    opt((ms.Tensor(g, ms.bfloat16),))
    (main,) = opt.mains
    assert main.dtype == ms.float32 and p.dtype == ms.bfloat16
    # The main copy starts from the bf16 weight the model holds.
    start = ms.Tensor(w0, ms.bfloat16).float().asnumpy().astype(np.float64)
    want = _numpy_adamw(start, [g.astype(np.float64)], 1e-3, 0.0)
    np.testing.assert_allclose(main.asnumpy(), want, atol=1e-6)
    # The model's weight is the main weight rounded to bfloat16.
    np.testing.assert_array_equal(p.float().asnumpy(), ms.Tensor(main.asnumpy(), ms.bfloat16).float().asnumpy())
    # C2 at stage 0, bf16: 2 + 4 + 12 bytes an element.
    assert opt.memory_bytes() == {"weights": 16, "gradients": 32, "optimizer": 96}


def test_one_process_call_errors_are_typed():
    import mindspore as ms

    from mindscience.distributed.optimizer import DistributedOptimizer

    p = ms.Parameter(ms.Tensor(np.zeros((3,), np.float32)), name="err_w")
    opt = DistributedOptimizer([p])
    with pytest.raises(DistributedOptimizerError, match="got 2 gradients for 1 parameters"):
        opt((ms.Tensor(np.zeros(3, np.float32)),) * 2)
    with pytest.raises(DistributedOptimizerError, match="already stepped"):
        DistributedOptimizer([p])
    q = ms.Parameter(ms.Tensor(np.zeros((3,), np.float32)), name="err_q")
    with pytest.raises(DistributedOptimizerError, match="not sharded by fully_shard"):
        DistributedOptimizer([q], zero_stage=3)
