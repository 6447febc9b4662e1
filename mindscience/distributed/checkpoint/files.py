"""safetensors files with numpy only: a streaming, atomic writer and byte-range readers.

The safetensors format is an 8-byte little-endian header length ``N``, ``N`` bytes of
JSON (``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
offsets relative to the end of the header) and the raw little-endian, C-ordered tensor
bytes. So a reader needs only the header to find any slice of any tensor: :func:`tensor_view`
memory-maps one tensor and slicing it touches only the pages of that slice.

Checksums are CRC-32 (zlib's polynomial; computed with ``zlib-ng``'s folded-multiply
kernel, ~24 GB/s here against ~2 GB/s for the standard ``zlib.crc32``, same values; the
standard one is the fallback): one per block of each tensor (:mod:`.blocks`), one per
tensor (its blocks' CRCs combined) and one per file, the CRC-32 of the header bytes
followed by each tensor's CRC-32 as 4 big-endian bytes in file order. The file checksum
thus covers every byte while a single pass over the data computes all three, and
``load`` can verify just the blocks it reads.

bfloat16 has no numpy dtype: its arrays are ``uint16`` bit patterns tagged ``"BF16"``.
No MindSpore import here.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Iterable, Optional

import numpy as np

from .blocks import BLOCK_BYTES, BlockCrc, block_crcs, blocks_hex, combine_blocks, crc32  # noqa: F401
from .errors import CheckpointError, CheckpointIntegrityError

__all__ = ["NUMPY_DTYPES", "st_dtype_of", "SafetensorsWriter", "read_header", "tensor_view",
           "file_checksum", "fsync_dir", "crc_hex", "crc32"]

NUMPY_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
_FROM_NUMPY = {np.dtype(v): k for k, v in NUMPY_DTYPES.items() if k not in ("BF16",)}
# Chunk for streaming copies and checksums: big enough for full disk speed, small
# enough to keep the resident memory of a reshard near one tensor.
CHUNK_BYTES = 64 << 20
_MAX_HEADER = 100 << 20



def _writeback_starter():
    """``start(fd, offset, nbytes)``: queue dirty pages for writing without waiting
    (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the disk writes while the
    next chunk is prepared and the closing fsync has little left to wait for. A no-op
    where the call is unavailable: then fsync does all the work, as before."""
    if not sys.platform.startswith("linux"):
        return lambda fd, offset, nbytes: None
    try:
        import ctypes

        call = ctypes.CDLL(None, use_errno=True).sync_file_range
        call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
        call.restype = ctypes.c_int
    except (OSError, AttributeError):  # pragma: no cover - not glibc / musl without it
        return lambda fd, offset, nbytes: None
    return lambda fd, offset, nbytes: call(fd, offset, nbytes, 2)  # 2: SYNC_FILE_RANGE_WRITE


_start_writeback = _writeback_starter()


def st_dtype_of(array: np.ndarray) -> str:
    """The safetensors dtype tag of a numpy array (uint16 is U16; pass BF16 explicitly)."""
    try:
        return _FROM_NUMPY[np.dtype(array.dtype)]
    except KeyError:
        raise CheckpointError(f"dtype {array.dtype} has no safetensors equivalent: expected one of "
                              f"{', '.join(sorted(NUMPY_DTYPES))}.") from None


def crc_hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def fsync_dir(path: str) -> None:
    """fsync a directory so that a rename inside it survives a crash."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class SafetensorsWriter:
    """Write one safetensors file tensor by tensor, under a temporary name.

    ``entries`` (name, dtype tag, shape) fix the header up front, so tensors are streamed
    in that order, each in one or more chunks (:meth:`write`). :meth:`close` checks that
    every byte arrived, fsyncs, renames to ``path`` and fsyncs the directory; until then
    only ``path + ".tmp"`` exists. Tensor, block and file checksums are in
    :attr:`tensor_crc`, :attr:`tensor_blocks` (hex strings, see :mod:`.blocks`) and
    :attr:`file_crc` after :meth:`close`.
    """

    def __init__(self, path: str, entries: Iterable, metadata: Optional[dict] = None,
                 block_bytes: Optional[int] = None):
        from . import blocks

        self.path = str(path)
        self.block_bytes = int(block_bytes or blocks.BLOCK_BYTES)
        self.tmp = self.path + ".tmp"
        header, offset, self._order = {}, 0, []
        for name, dtype, shape in entries:
            if dtype not in NUMPY_DTYPES:
                raise CheckpointError(f"tensor {name!r}: unknown dtype tag {dtype!r}.")
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(NUMPY_DTYPES[dtype]).itemsize
            header[name] = {"dtype": dtype, "shape": [int(s) for s in shape],
                            "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, nbytes))
            offset += nbytes
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned
        self.header_bytes = struct.pack("<Q", len(raw)) + raw
        self.total_bytes = len(self.header_bytes) + offset
        self.tensor_crc: dict = {}
        self.tensor_blocks: dict = {}
        self.file_crc: Optional[str] = None
        self._index, self._written, self._crc = 0, 0, BlockCrc(self.block_bytes)
        self._file_crc = crc32(self.header_bytes)
        # Unbuffered: chunks are large and go to the kernel as they are (no extra copy).
        self._fh = open(self.tmp, "wb", buffering=0)
        self._offset = 0
        self._put(memoryview(self.header_bytes))

    def _put(self, data: memoryview) -> None:
        start = self._offset
        while data:
            n = self._fh.write(data)
            data = data[n:]
            self._offset += n
        _start_writeback(self._fh.fileno(), start, self._offset - start)

    def write(self, name: str, chunk: np.ndarray) -> None:
        """Append ``chunk`` (C-ordered bytes of the current tensor, possibly partial)."""
        while self._index < len(self._order) and self._order[self._index][1] == 0:
            self._finish_tensor()
        if self._index >= len(self._order) or self._order[self._index][0] != name:
            expected = self._order[self._index][0] if self._index < len(self._order) else None
            raise CheckpointError(f"writer of {self.path}: got tensor {name!r}, expected {expected!r}.")
        data = memoryview(np.ascontiguousarray(chunk)).cast("B")
        if self._written + len(data) > self._order[self._index][1]:
            raise CheckpointError(f"writer of {self.path}: tensor {name!r} got more bytes than its shape.")
        self._put(data)
        self._crc.update(data)
        self._written += len(data)
        if self._written == self._order[self._index][1]:
            self._finish_tensor()

    def _finish_tensor(self) -> None:
        name = self._order[self._index][0]
        crc = self._crc.finish().total()
        self.tensor_crc[name] = crc_hex(crc)
        self.tensor_blocks[name] = self._crc.hex()
        self._file_crc = crc32(struct.pack(">I", crc), self._file_crc)
        self._index, self._written, self._crc = self._index + 1, 0, BlockCrc(self.block_bytes)

    def close(self) -> None:
        while self._index < len(self._order) and self._order[self._index][1] == 0:
            self._finish_tensor()
        if self._index != len(self._order):
            self.abort()
            raise CheckpointError(f"writer of {self.path}: tensor {self._order[self._index][0]!r} "
                                  "was not fully written.")
        os.fsync(self._fh.fileno())
        self._fh.close()
        os.replace(self.tmp, self.path)
        fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        self.file_crc = crc_hex(self._file_crc)

    def abort(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def read_header(path: str) -> tuple:
    """``(header, data_start, file_size)`` of a safetensors file, checked for truncation.

    Raises:
        CheckpointIntegrityError: the file is missing, shorter than its header says, or
            its header is not valid safetensors JSON.
    """
    path = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointIntegrityError(f"{path}: truncated: {size} bytes, no safetensors header.")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointIntegrityError(f"{path}: truncated or not safetensors: header of {n} "
                                               f"bytes in a file of {size} bytes.")
            raw = fh.read(n)
    except FileNotFoundError:
        raise CheckpointIntegrityError(f"{path}: missing file.") from None
    except OSError as err:  # a directory in its place, no permission, an I/O error
        raise CheckpointIntegrityError(f"{path}: cannot be read as a safetensors file "
                                       f"({err.strerror or err}).") from None
    try:
        header = json.loads(raw)
    except ValueError as err:
        raise CheckpointIntegrityError(f"{path}: corrupt safetensors header ({err}).") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise CheckpointIntegrityError(f"{path}: truncated: {size} bytes, its header needs "
                                       f"{8 + n + end}.")
    return header, 8 + n, size


def tensor_view(path: str, header: dict, data_start: int, name: str) -> np.ndarray:
    """A read-only memory map of tensor ``name`` (BF16 as uint16 bits)."""
    info = header[name]
    shape = tuple(info["shape"])
    dtype = NUMPY_DTYPES[info["dtype"]]
    begin = info["data_offsets"][0]
    if int(np.prod(shape, dtype=np.int64)) == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=data_start + begin, shape=shape)


def file_checksum(path: str, progress=None, block_bytes: int = BLOCK_BYTES) -> tuple:
    """``(file_crc, {tensor: crc}, {tensor: block crcs})`` recomputed from the bytes on
    disk in one pass (see the module doc; block CRCs as :mod:`.blocks` hex strings)."""
    header, start, _ = read_header(path)
    with open(path, "rb") as fh:
        raw = fh.read(start)
        file_crc = crc32(raw)
        tensors, blocks = {}, {}
        items = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                       key=lambda kv: kv[1]["data_offsets"][0])
        for name, info in items:
            b, e = info["data_offsets"]
            crcs = block_crcs(fh, start + b, e - b, block_bytes, CHUNK_BYTES, progress)
            crc = combine_blocks(crcs, e - b, block_bytes)
            tensors[name] = crc_hex(crc)
            blocks[name] = blocks_hex(crcs)
            file_crc = crc32(struct.pack(">I", crc), file_crc)
    return crc_hex(file_crc), tensors, blocks


def tensor_checksum(view: np.ndarray) -> str:
    """CRC-32 of a (memory-mapped) tensor's bytes, read in chunks."""
    flat = view.reshape(-1) if view.size else view
    crc, step = 0, max(1, CHUNK_BYTES // max(1, view.itemsize))
    for i in range(0, flat.size, step):
        crc = crc32(memoryview(np.ascontiguousarray(flat[i:i + step])).cast("B"), crc)
    return crc_hex(crc)
