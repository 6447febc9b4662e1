"""Ring attention: K/V blocks travel around the context-parallel group.

Each of the ``n`` ranks keeps its queries. At step ``i`` (0 .. n-1) rank ``r`` holds the
K/V block of rank ``(r - i) mod n``, attends to it and merges the partial result into its
running output by log-sum-exp (online softmax), then passes the block on with
``p2p.ring_shift`` (one K/V-sized tensor to the next rank). A causal ring skips every
block (at the chunk level, every chunk pair) that lies entirely above the diagonal; the
shifts still run on every rank, so all ranks stay in step.

Backward (the Cell's ``bprop``) keeps only this rank's q, k, v, output and log-sum-exp:
the K/V blocks travel around the ring once more, together with the accumulators of
their gradients (dK, dV), which every rank adds its share to; one last shift brings each
accumulator home. Activation memory is ``O(S/n)`` per rank: one block of K/V (and its
gradient) at a time, never the whole sequence.

Uneven ``split_sizes``: blocks are zero-padded to the largest shard so that every shift
moves the same shape; the padded rows are never attended to (the plan below only selects
real rows). ``load_balance=True`` (zigzag): rank r holds chunks r and 2n-1-r of 2n, so
every rank does the same causal work (Brandon et al.'s striped / zigzag layout).

Example, n = 4, causal, no load balance: rank 0 attends 1 block (its own, masked), rank 3
attends 4 (three full blocks and its own). With zigzag each rank attends its own two
chunks (masked) and 1.5 blocks' worth of the others'.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import mint, nn, ops

from ... import collectives as C
from ... import p2p
from .core import AttentionMath, positions, segments_of, to_f32, visibility


class _Plan:
    """What each step computes on this rank (static: built from sizes and the rank)."""

    def __init__(self, group, sizes, causal, load_balance, g):
        n, r = group.size, group.rank
        self.m = max(sizes)
        self.q_segs = segments_of(r, sizes, load_balance)
        self.pos = []
        self.steps = []
        started = [False] * len(self.q_segs)
        for i in range(n):
            src = (r - i) % n
            k_segs = segments_of(src, sizes, load_balance)
            per_q = []
            for j, qs in enumerate(self.q_segs):
                seen = [visibility(qs, ks, causal) for ks in k_segs]
                sel = tuple(t for t, s in enumerate(seen) if s != "none")
                mask = -1
                if "partial" in seen:
                    mask = len(self.pos)
                    self.pos.append(positions((qs,), tile=g))
                    self.pos.append(positions([k_segs[t] for t in sel]))
                first = bool(sel) and not started[j]
                started[j] = started[j] or bool(sel)
                # Where the selected rows go back in the (padded) block: (take?, start, len).
                layout, cursor = [], 0
                for t, ks in enumerate(k_segs):
                    if t in sel:
                        layout.append((1, cursor, ks[1]))
                        cursor += ks[1]
                    else:
                        layout.append((0, 0, ks[1]))
                if self.m > sizes[src]:
                    layout.append((0, 0, self.m - sizes[src]))
                rows = tuple((k_segs[t][0], k_segs[t][1]) for t in sel)
                per_q.append((rows, mask, first, tuple(layout), cursor == self.m))
            self.steps.append(tuple(per_q))
        self.steps = tuple(self.steps)


def ring_shift_cell(group, compiled):
    """The cell of ``p2p.ring_shift(x, group, 1)`` for eager or compiled code.

    The backward cannot call the ``ring_shift`` function: inside a ``bprop``
    ``collectives.compiling()`` is not folded (docs/COMPILED_MODE.md), so the function
    would take its eager path in a compiled graph. The cell, chosen once here, serves
    both directions. (p2p's own cache, so the same communicators are shared.)
    """
    key = (group, 1, compiled, C.get_backend().name if not compiled else None)
    cell = p2p._RING_CELLS.get(key)
    if cell is None:
        cell = p2p._RingShift(group, 1, compiled)
        p2p._RING_CELLS[key] = cell
    return cell


class _RingBase(nn.Cell):
    def __init__(self, group, plan, n_heads, n_kv, head_dim, scale, local_rows, compiled):
        super().__init__()
        self.group = group
        self.shifter = ring_shift_cell(group, compiled)
        self.n_steps = group.size
        self.math = AttentionMath(n_heads, n_kv, scale)
        self.q_segs = plan.q_segs
        self.steps = plan.steps
        self.pos = tuple(plan.pos)
        self.m = plan.m
        self.d = head_dim
        self.local_rows = local_rows
        self.n_q = len(plan.q_segs)
        self.scale = scale

    def shift(self, x):
        return self.shifter(x)

    def pad(self, x):
        """``x`` (rows, ...) padded with zero rows to the block size ``m``."""
        have = x.shape[0]
        if have == self.m:
            return x
        pad = ops.zeros((self.m - have,) + tuple(x.shape[1:]), x.dtype)
        if have == 0:
            return ops.depend(pad, x)
        return ops.cat((x, pad), 0)

    def selected(self, kv, rows):
        """The selected rows of the padded K/V block, as internal-layout k and v."""
        parts = ()
        for start, length in rows:
            parts = parts + (self.math.rows(kv, start, length),)
        block = parts[0] if len(parts) == 1 else ops.cat(parts, 0)
        k = self.math.to_kv(self.math.lastdim(block, 0, self.d))
        v = self.math.to_kv(self.math.lastdim(block, self.d, self.d))
        return k, v

    def mask_pos(self, mask):
        if mask < 0:
            return None, None
        return self.pos[mask], self.pos[mask + 1]


class _RingBackward(_RingBase):
    """The backward as a construct (compiled code folds its mode branches there)."""

    def construct(self, q, k, v, o, lse, do):
        math = self.math
        qf, of, dof = to_f32(q), to_f32(o), to_f32(do)
        g = math.g
        q_int, do_int, lses, deltas, dqs = (), (), (), (), ()
        for j in range(self.n_q):
            start, length = self.q_segs[j][0], self.q_segs[j][1]
            qj = math.to_q(math.rows(qf, start, length))
            dj = math.to_q(math.rows(dof, start, length))
            oj = math.to_q(math.rows(of, start, length))
            q_int = q_int + (qj,)
            do_int = do_int + (dj,)
            deltas = deltas + (ops.expand_dims((dj * oj).sum(-1), -1),)
            lses = lses + (ops.expand_dims(math.lastdim(lse, g * start, g * length), -1),)
            dqs = dqs + (ops.zeros(qj.shape, ms.float32),)
        kv = self.pad(ops.cat((to_f32(k), to_f32(v)), -1))
        dkv = ops.zeros(kv.shape, ms.float32)
        for i in range(self.n_steps):
            if i > 0:
                both = self.shift(ops.cat((kv, dkv), -1))
                kv = math.lastdim(both, 0, 2 * self.d)
                dkv = math.lastdim(both, 2 * self.d, 2 * self.d)
            for j in range(self.n_q):
                rows, mask, _, layout, whole = self.steps[i][j]
                if rows:
                    kb, vb = self.selected(kv, rows)
                    qpos, kpos = self.mask_pos(mask)
                    p = ops.exp(math.scores(q_int[j], kb, qpos, kpos) - lses[j])
                    dv = mint.matmul(p.transpose(0, 1, 3, 2), do_int[j])
                    ds = p * (mint.matmul(do_int[j], vb.transpose(0, 1, 3, 2)) - deltas[j])
                    dq = dqs[j] + mint.matmul(ds, kb) * self.scale
                    dqs = dqs[:j] + (dq,) + dqs[j + 1:]
                    dk = mint.matmul(ds.transpose(0, 1, 3, 2), q_int[j]) * self.scale
                    piece = ops.cat((math.from_kv(dk), math.from_kv(dv)), -1)
                    dkv = dkv + self.place(piece, layout, whole)
        dkv = self.shift(dkv)  # home: each accumulator back to the rank that owns the block
        dk = math.rows(math.lastdim(dkv, 0, self.d), 0, self.local_rows)
        dv = math.rows(math.lastdim(dkv, self.d, self.d), 0, self.local_rows)
        if self.n_q == 0:
            dq = ops.depend(ops.zeros(q.shape, ms.float32), dkv)
        else:
            parts = ()
            for j in range(self.n_q):
                parts = parts + (math.from_q(dqs[j]),)
            dq = parts[0] if self.n_q == 1 else ops.cat(parts, 0)
            dq = ops.depend(dq, dkv)
        return ops.cast(dq, q.dtype), ops.cast(dk, k.dtype), ops.cast(dv, v.dtype)

    def place(self, piece, layout, whole):
        """The selected rows' gradient put back at their rows of the padded block."""
        if whole:
            return piece
        parts = ()
        for take, start, length in layout:
            if take == 1:
                parts = parts + (self.math.rows(piece, start, length),)
            else:
                parts = parts + (ops.zeros((length,) + tuple(piece.shape[1:]), ms.float32),)
        return ops.cat(parts, 0)


class RingAttention(_RingBase):
    """construct -> (out, lse); bprop -> the ring backward. One per static configuration."""

    def __init__(self, group, sizes, causal, load_balance, n_heads, n_kv, head_dim, scale,
                 compiled=False):
        plan = _Plan(group, sizes, causal, load_balance, n_heads // n_kv)
        local_rows = sizes[group.rank]
        super().__init__(group, plan, n_heads, n_kv, head_dim, scale, local_rows, compiled)
        self.backward = _RingBackward(group, plan, n_heads, n_kv, head_dim, scale, local_rows,
                                      compiled)

    def construct(self, q, k, v):
        math = self.math
        qf = to_f32(q)
        q_int = ()
        for j in range(self.n_q):
            q_int = q_int + (math.to_q(math.rows(qf, self.q_segs[j][0], self.q_segs[j][1])),)
        outs, lses = q_int, q_int  # placeholders, replaced at each segment's first block
        kv = self.pad(ops.cat((to_f32(k), to_f32(v)), -1))
        for i in range(self.n_steps):
            if i > 0:
                kv = self.shift(kv)
            for j in range(self.n_q):
                rows, mask, first, _, _ = self.steps[i][j]
                if rows:
                    kb, vb = self.selected(kv, rows)
                    qpos, kpos = self.mask_pos(mask)
                    o_b, l_b = math.block(q_int[j], kb, vb, qpos, kpos)
                    if not first:
                        o_b, l_b = math.merge(outs[j], lses[j], o_b, l_b)
                    outs = outs[:j] + (o_b,) + outs[j + 1:]
                    lses = lses[:j] + (l_b,) + lses[j + 1:]
        B = q.shape[1]
        if self.n_q == 0:
            out = ops.depend(ops.zeros(q.shape, ms.float32), kv)
            lse = ops.depend(ops.zeros((B, math.n_kv, 0), ms.float32), kv)
        else:
            parts = ()
            for j in range(self.n_q):
                parts = parts + (math.from_q(outs[j]),)
            out = parts[0] if self.n_q == 1 else ops.cat(parts, 0)
            lse = lses[0] if self.n_q == 1 else ops.cat(lses, -1)
            # The last shifts feed nothing on a rank whose later blocks are all skipped;
            # without this a compiled graph would drop them there and the ring would hang.
            out = ops.depend(out, kv)
        return ops.cast(out, q.dtype), lse

    def bprop(self, q, k, v, out, dout):
        # Start from the forward's output: the backward shifts must follow the forward ones.
        do = ops.depend(dout[0], out[0])
        return self.backward(q, k, v, out[0], out[1], do)
