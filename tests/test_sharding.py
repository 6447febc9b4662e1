"""Sharding metadata (mindscience.distributed.sharding) and its marks on the parallel layers."""

import numpy as np
import pytest

from mindscience.distributed.sharding import get_sharding, local_slices, mark_sharding


class _P:
    def __init__(self, shape):
        self.shape = shape


def test_mark_and_get_roundtrip():
    p = mark_sharding(_P((8, 4)), axis="tp", partition_dim=-1, partition_stride=2)
    assert get_sharding(p) == {"axis": "tp", "partition_dim": 1, "partition_stride": 2,
                               "sequence_parallel": False}
    assert p.tensor_model_parallel is True
    assert get_sharding(_P((3,))) == {"axis": None, "partition_dim": None,
                                      "partition_stride": 1, "sequence_parallel": False}
    q = mark_sharding(_P((3,)), axis=None, sequence_parallel=True)
    assert get_sharding(q)["sequence_parallel"] is True and get_sharding(q)["axis"] is None


@pytest.mark.parametrize("kwargs, match", [
    ({"axis": "pp", "partition_dim": 0}, "axis='pp'"),
    ({"axis": "tp"}, "needs partition_dim"),
    ({"axis": "tp", "partition_dim": 2}, "out of range"),
    ({"axis": "tp", "partition_dim": 0, "partition_stride": 0}, "partition_stride=0"),
    ({"axis": None, "partition_dim": 0}, "replicated"),
])
def test_mark_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mark_sharding(_P((4, 4)), **kwargs)


def test_local_slices_interleaved_matches_megatron_blocks():
    # 12 rows, tp 2, stride 3: blocks of 2 rows; rank 1 holds blocks 1, 3, 5.
    assert local_slices(12, 2, 1, stride=3) == [(2, 4), (6, 8), (10, 12)]
    assert local_slices(12, 4, 0) == [(0, 3)]
    full = np.arange(12)
    parts = [np.concatenate([full[a:b] for a, b in local_slices(12, 2, r, 3)]) for r in range(2)]
    assert parts[0].tolist() == [0, 1, 4, 5, 8, 9]
    with pytest.raises(ValueError, match="not divisible by 8"):
        local_slices(12, 4, 0, stride=2)


def test_parallel_linear_layers_are_marked():
    from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear
    col = ColumnParallelLinear(4, 6)
    row = RowParallelLinear(6, 4, use_sequence_parallel=True)
    assert get_sharding(col.weight) == {"axis": "tp", "partition_dim": 0, "partition_stride": 1,
                                        "sequence_parallel": False}
    assert get_sharding(col.bias)["axis"] == "tp" and get_sharding(col.bias)["partition_dim"] == 0
    assert get_sharding(row.weight)["partition_dim"] == 1
    assert get_sharding(row.bias) == {"axis": None, "partition_dim": None, "partition_stride": 1,
                                      "sequence_parallel": True}
