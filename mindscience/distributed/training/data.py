"""The tokens of every training step: synthetic from a seed, or cut from a ``.npy`` file (pure numpy).

The global batch of step ``k`` depends only on ``(seed, k)`` (synthetic) or on ``k`` and
the file (``--data``), never on the layout or on a resume, so a run at tp2 x pp2 and a
run at one rank see the same sequences and their losses compare.

A sequence holds ``seq_length + 1`` tokens: the inputs are its first ``seq_length``, the
labels the last ``seq_length`` (the inputs shifted by one). A file of ``n`` tokens is cut
into ``(n - 1) // seq_length`` sequences in order, sequence ``j`` being tokens
``j*s .. j*s + s`` (neighbours share one token, so no token is lost as a label). Step
``k`` reads sequences ``first + k*G .. first + (k+1)*G - 1`` (``G`` the global batch), and
data-parallel rank ``r`` of ``dp`` reads only its ``G/dp`` of them.

Example, G = 8 sequences per step on dp = 2: step 3 is sequences 24..31; dp rank 0 reads
24..27, dp rank 1 reads 28..31::

    >>> dp_rows(step=3, global_batch=8, dp_rank=1, dp=2)
    range(28, 32)
    >>> synthetic_rows(seed=0, step=3, rows=range(28, 30), seq_length=4, vocab_size=50).shape
    (2, 5)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

# A file is scanned for its largest id in slabs of this many tokens (memory stays small).
SCAN_TOKENS = 1 << 22


class DataError(ValueError):
    """A token file that cannot feed the run: missing, not 1-D integer, ids out of range, too short."""


def dp_rows(step: int, global_batch: int, dp_rank: int, dp: int, first_sequence: int = 0) -> range:
    """Sequence indices data-parallel rank ``dp_rank`` of ``dp`` reads at ``step``.

    Raises:
        DataError: ``global_batch`` not divisible by ``dp``.
    """
    if global_batch % dp:
        raise DataError(f"global batch {global_batch} does not split over dp={dp}: every data-parallel "
                        "rank trains the same number of sequences. Use a global batch divisible by dp.")
    share = global_batch // dp
    start = first_sequence + step * global_batch + dp_rank * share
    return range(start, start + share)


def synthetic_rows(seed: int, step: int, rows: range, seq_length: int, vocab_size: int) -> np.ndarray:
    """Synthetic sequences ``rows`` of ``step``: ``(len(rows), seq_length + 1)`` int32 ids.

    Each sequence is drawn from ``numpy.random.default_rng([seed, step, row])``, so a rank
    draws only its share and every layout draws the same sequence for the same row.
    """
    out = np.empty((len(rows), seq_length + 1), np.int32)
    for i, row in enumerate(rows):
        out[i] = np.random.default_rng([seed, step, row]).integers(0, vocab_size, seq_length + 1)
    return out


@dataclass(frozen=True)
class TokenFile:
    """A 1-D ``.npy`` array of token ids, memory-mapped, checked against the model.

    Attributes:
        path: The file.
        tokens: Number of token ids it holds.
        sequences: Whole sequences of ``seq_length + 1`` tokens it yields.
        max_id: Its largest id.
        dtype: Its numpy dtype name.
    """

    path: str
    tokens: int
    sequences: int
    max_id: int
    dtype: str

    def rows(self, rows: range, seq_length: int) -> np.ndarray:
        """Sequences ``rows`` as ``(len(rows), seq_length + 1)`` int32 ids (reads only them)."""
        data = np.load(self.path, mmap_mode="r")
        out = np.empty((len(rows), seq_length + 1), np.int32)
        for i, row in enumerate(rows):
            out[i] = data[row * seq_length: row * seq_length + seq_length + 1]
        return out


def sequences_in(tokens: int, seq_length: int) -> int:
    """Sequences of ``seq_length + 1`` tokens a file of ``tokens`` ids yields: ``(tokens - 1) // s``.

        >>> sequences_in(129, 64), sequences_in(128, 64)
        (2, 1)
    """
    return max(0, (tokens - 1) // seq_length)


def open_token_file(path: str, vocab_size: int, seq_length: int, sequences_needed: int = 0) -> TokenFile:
    """Check ``path`` and describe it; the one place ``--data`` is validated (before any rank starts).

    Args:
        path: A ``.npy`` file holding a 1-D integer array.
        vocab_size: Ids must be in ``[0, vocab_size)``.
        seq_length: Tokens per sequence (the model's).
        sequences_needed: Sequences the run reads (steps x global batch, from the data
            position); 0 skips the length check.

    Raises:
        DataError: one line naming the file, what is wrong and the fix.
    """
    if not os.path.exists(path):
        raise DataError(f"--data {path}: no such file: pass a .npy file of token ids (numpy.save of a 1-D "
                        "integer array).")
    try:
        data = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise DataError(f"--data {path}: not a .npy array ({err}): save the token ids with numpy.save.") from None
    if not isinstance(data, np.ndarray) or data.ndim != 1:
        shape = getattr(data, "shape", None)
        raise DataError(f"--data {path}: holds an array of shape {shape}: expected a 1-D array of token ids "
                        "(flatten it with .reshape(-1)).")
    if not np.issubdtype(data.dtype, np.integer):
        raise DataError(f"--data {path}: holds {data.dtype} values: expected integer token ids (e.g. "
                        "uint16 or int32); convert with .astype(np.int32).")
    max_id, min_id = -1, 0
    for start in range(0, data.shape[0], SCAN_TOKENS):
        slab = data[start:start + SCAN_TOKENS]
        max_id = max(max_id, int(slab.max()))
        min_id = min(min_id, int(slab.min()))
    if min_id < 0:
        raise DataError(f"--data {path}: holds the negative id {min_id}: token ids are 0..{vocab_size - 1}.")
    if max_id >= vocab_size:
        raise DataError(f"--data {path}: holds id {max_id}, but the model's vocab_size is {vocab_size}: ids "
                        f"must be below it. Use a model with vocab_size > {max_id} or re-tokenize.")
    held = sequences_in(int(data.shape[0]), seq_length)
    if sequences_needed and held < sequences_needed:
        raise DataError(f"--data {path}: holds {data.shape[0]} tokens = {held} sequences of {seq_length} + 1, "
                        f"but the run reads {sequences_needed}: pass a longer file or fewer --steps or a "
                        "smaller --global-batch-size.")
    return TokenFile(path=os.path.abspath(path), tokens=int(data.shape[0]), sequences=held, max_id=max_id,
                     dtype=str(data.dtype))


def batch_rows(step: int, global_batch: int, dp_rank: int, dp: int, seq_length: int, vocab_size: int,
               seed: int = 0, token_file: TokenFile | None = None, first_sequence: int = 0) -> np.ndarray:
    """This dp rank's sequences of ``step``: ``(global_batch / dp, seq_length + 1)`` int32 ids.

    Synthetic (from ``seed``) when ``token_file`` is None, else cut from the file starting
    at sequence ``first_sequence`` (the data position of step 0).
    """
    rows = dp_rows(step, global_batch, dp_rank, dp, first_sequence if token_file else 0)
    if token_file is None:
        return synthetic_rows(seed, step, rows, seq_length, vocab_size)
    return token_file.rows(rows, seq_length)


def inputs_and_labels(sequences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, labels)``: the first ``s`` and the last ``s`` tokens of each sequence.

        >>> inputs_and_labels(np.arange(5)[None])
        (array([[0, 1, 2, 3]]), array([[1, 2, 3, 4]]))
    """
    return sequences[:, :-1], sequences[:, 1:]
