"""Per-block checksums of stored tensors, so that a reader verifies only what it reads.

Format version 2 records, for every stored tensor (a shard of a parameter in a rank
file), the CRC-32 of each fixed-size block of its bytes: ``"block_bytes": 1048576`` and
``"block_crc32"``, the blocks' CRCs as one string of 8 hex digits each, in order (the
last block may be shorter). A rank that reads a slice verifies the blocks overlapping
the slice's bytes and nothing else:

* a slice of rows (a dim-0 split, a reshard slab) is one contiguous byte range: the
  blocks read are that range rounded out to block edges, so a tp8 rank of a tp1
  checkpoint reads 1/8 of a dim-0-split tensor plus at most two partial blocks;
* a slice of columns (a dim-1 split) is a segment of every row: each block holding part
  of a segment is verified, which for rows shorter than a block is every block of the
  tensor (the data read itself is still only the segments' pages).

The whole-tensor CRC (used by the file checksum that ``inspect`` verifies) is the
blocks' CRCs combined (``crc32_combine``), so writing costs one pass over the data.
No MindSpore import.
"""

from __future__ import annotations

import mmap
import zlib

import numpy as np

__all__ = ["BLOCK_BYTES", "crc32", "crc32_combine", "BlockCrc", "block_crcs", "touched_blocks",
           "split_crcs"]

# 1 MiB: a 2 GiB checkpoint's manifest grows by ~18 KiB of block checksums, and a rank
# reading a slice reads at most 2 MiB more than the slice.
BLOCK_BYTES = 1 << 20
# Beyond this many contiguous runs in one slice, round the slice out to its first and
# last byte instead of listing runs (a superset: more is verified, nothing is missed).
_MAX_RUNS = 1 << 22


def _gf2_times(matrix, vec):
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= matrix[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(matrix):
    return [_gf2_times(matrix, m) for m in matrix]


def _crc32_combine_py(crc1: int, crc2: int, len2: int) -> int:
    """zlib's ``crc32_combine`` (GF(2) matrix powers), for an install without zlib-ng:
    ``crc1`` shifted through ``len2`` zero bytes (the operator for one zero byte squared
    once per bit of ``len2``), then xor ``crc2``."""
    if len2 <= 0:
        return crc1
    op = [0xEDB88320] + [1 << i for i in range(31)]  # the operator for one zero bit
    for _ in range(3):                                  # ... for one zero byte
        op = _gf2_square(op)
    while True:
        if len2 & 1:
            crc1 = _gf2_times(op, crc1)
        len2 >>= 1
        if not len2:
            return crc1 ^ crc2
        op = _gf2_square(op)


try:  # same CRC-32 as zlib's, ~10x faster (carry-less multiply); a declared dependency
    from zlib_ng import zlib_ng as _zlib_fast
    crc32 = _zlib_fast.crc32
    _combine = _zlib_fast.crc32_combine
except ImportError:  # pragma: no cover - a broken install still reads and writes checkpoints
    crc32 = zlib.crc32
    _combine = _crc32_combine_py


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    return _combine(crc1 & 0xFFFFFFFF, crc2 & 0xFFFFFFFF, int(len2)) & 0xFFFFFFFF


def combine_blocks(crcs, length: int, block_bytes: int) -> int:
    """The CRC-32 of ``length`` bytes from the CRCs of their ``block_bytes`` blocks (the
    last one may be shorter)."""
    crc = 0
    for i, c in enumerate(crcs):
        crc = crc32_combine(crc, c, min(block_bytes, length - i * block_bytes))
    return crc


def blocks_hex(crcs) -> str:
    """Block CRCs as one ``block_crc32`` string (8 hex digits each; :func:`split_crcs`)."""
    return "".join(f"{c:08x}" for c in crcs)


class BlockCrc:
    """Incremental CRC-32 of one tensor's bytes, per block and whole.

    Feed the bytes in order (:meth:`update`, any chunk sizes); :attr:`blocks` then holds
    each block's CRC and :meth:`total` the whole tensor's (one pass over the data).
    """

    def __init__(self, block_bytes: int = BLOCK_BYTES):
        self.block_bytes = int(block_bytes)
        self.blocks: list = []
        self._crc, self._filled, self._total = 0, 0, 0

    def update(self, data: memoryview) -> None:
        pos, n = 0, len(data)
        while pos < n:
            take = min(n - pos, self.block_bytes - self._filled)
            self._crc = crc32(data[pos:pos + take], self._crc)
            self._filled += take
            pos += take
            if self._filled == self.block_bytes:
                self._close_block()

    def _close_block(self) -> None:
        self.blocks.append(self._crc & 0xFFFFFFFF)
        self._total = crc32_combine(self._total, self._crc, self._filled)
        self._crc, self._filled = 0, 0

    def finish(self) -> "BlockCrc":
        if self._filled:
            self._close_block()
        return self

    def total(self) -> int:
        return self._total

    def hex(self) -> str:
        return blocks_hex(self.blocks)


def split_crcs(text: str) -> list:
    """The block CRCs of a ``block_crc32`` string (8 hex digits each)."""
    return [text[i:i + 8] for i in range(0, len(text), 8)]


# WILLNEED in steps of this many bytes: Linux reads at most max(read_ahead_kb, the
# device's io size) per call, the rest of a longer range only on faults (with read-around).
_WILLNEED_STEP = 2 << 20


def _advise_exact(mm) -> None:
    """Read exactly the mapped range, in large reads: ``MADV_WILLNEED`` over the whole
    map (in steps the kernel reads in full), so that no fault reads around it (Linux
    reads up to ``read_ahead_kb`` around a faulting page not yet cached, 8 MiB on this
    machine's disk, half of it past the end of a small map). Measured on a cold 512 MiB
    file: ~1 GiB/s and exactly the mapped pages cached; ``MADV_RANDOM`` instead would
    make the same reads 15x slower."""
    if not hasattr(mm, "madvise"):  # pragma: no cover - Python < 3.8 / not POSIX
        return
    try:
        for at in range(0, len(mm), _WILLNEED_STEP):
            mm.madvise(mmap.MADV_WILLNEED, at, min(_WILLNEED_STEP, len(mm) - at))
    except (OSError, AttributeError, ValueError):  # pragma: no cover - advice only
        pass


def block_crcs(fh, start: int, length: int, block_bytes: int, chunk_bytes: int = 64 << 20,
               progress=None) -> list:
    """The CRC-32 (ints) of each ``block_bytes`` block of ``length`` bytes of the open
    file ``fh`` from ``start`` (the last one may be shorter), read through short-lived
    memory maps of about ``chunk_bytes`` (whole blocks)."""
    out, end = [], start + length
    gran = mmap.ALLOCATIONGRANULARITY
    per_map = max(1, chunk_bytes // block_bytes) * block_bytes
    while start < end:
        base = start - start % gran
        size = min(start - base + per_map, end - base)
        with mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ, offset=base) as mm:
            _advise_exact(mm)
            with memoryview(mm) as view:
                for b in range(start - base, size, block_bytes):
                    out.append(crc32(view[b:min(b + block_bytes, size)]) & 0xFFFFFFFF)
        if progress is not None:
            progress(base + size - start)
        start = base + size
    return out


def touched_blocks(shape, itemsize: int, box, block_bytes: int) -> np.ndarray:
    """The indices of the blocks holding any byte of a slice of a C-ordered tensor.

    Args:
        shape: The stored tensor's shape.
        itemsize: Bytes per element.
        box: One ``(start, stop)`` per dim (the slice; ``(0, shape[d])`` for a whole dim).
        block_bytes: The block size.

    Example: a (8, 4) float32 tensor (16-byte rows) in 32-byte blocks; rows 2:5 are
    bytes 32:80, blocks ``[1, 2]``; column 3 of every row touches every block ``[0..3]``.
    """
    shape = tuple(int(s) for s in shape)
    total = int(np.prod(shape, dtype=np.int64)) * itemsize
    if total == 0 or any(b <= a for a, b in box):
        return np.zeros(0, np.int64)
    nblocks = -(-total // block_bytes)
    strides = [itemsize] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    # The innermost dim that is not whole starts a contiguous run; every dim inside it
    # is whole, so one run is (b - a) * stride bytes.
    k = 0
    for d in range(len(shape) - 1, -1, -1):
        if tuple(box[d]) != (0, shape[d]):
            k = d
            break
    if not shape:
        starts, run = np.zeros(1, np.int64), itemsize
    else:
        a, b = box[k]
        run = (b - a) * strides[k]
        runs = int(np.prod([box[d][1] - box[d][0] for d in range(k)], dtype=np.int64))
        if runs > _MAX_RUNS:
            first = sum(box[d][0] * strides[d] for d in range(len(shape)))
            last = sum((box[d][1] - 1) * strides[d] for d in range(len(shape))) + itemsize
            return np.arange(first // block_bytes, (last - 1) // block_bytes + 1, dtype=np.int64)
        starts = np.full(1, a * strides[k], np.int64)
        for d in range(k - 1, -1, -1):
            offs = np.arange(box[d][0], box[d][1], dtype=np.int64) * strides[d]
            starts = (offs[:, None] + starts[None, :]).reshape(-1)
    first = starts // block_bytes
    last = (starts + run - 1) // block_bytes
    marks = np.zeros(nblocks + 1, np.int64)
    np.add.at(marks, first, 1)
    np.add.at(marks, last + 1, -1)
    return np.nonzero(np.cumsum(marks[:-1]) > 0)[0]
