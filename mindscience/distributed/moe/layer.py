"""``MoELayer``: router -> dispatch -> experts -> combine, over the expert groups.

Collectives, in order, for one forward (``alltoall`` dispatcher; sizes: N tokens of this
rank, E experts, C slots per expert, L = E/ep local experts):

1. tp > 1 without sequence parallelism: keep this tp rank's rows of the sequence (no
   communication; the tp ranks hold the same tokens, each routes its share).
2. router statistics: all-reduce of ``[counts, dropped, sums]`` over tp (2E+2 floats),
   then over dp-cp (``aux_loss``) or cp (``seq_aux_loss``) when a loss is on.
3. dispatch: PyNative dropless: all-gather of the E per-expert counts over etp x ep (the
   sizes), then an uneven all-to-all over ep of the N*k rows sorted by expert
   (:func:`.comm.all_to_all_v`); otherwise an all-to-all over ep of the (E, C, H) slot
   buffer. etp > 1: all-gather over etp.
4. experts: one batched matmul each way over the L local experts.
5. combine: etp > 1: reduce-scatter over etp; all-to-all over ep back to (E, C, H).
6. tp > 1 without sequence parallelism: all-gather of the sequence over tp.

The backward runs the transposes in reverse (all-to-all <-> all-to-all, all-gather <->
reduce-scatter). ``allgather`` replaces 3 and 5 by an all-gather of the tokens and of
the routing weights over the dispatch group (etp x ep) and a reduce-scatter of the
partial outputs.

PyNative dropless (Megatron's layout): each rank sorts its N*k (token, expert) rows by
expert; chunk j (the rows for ep rank j's experts) goes to ep rank j, whose uneven sizes
come from the counts, all-gathered over the etp x ep group first. The receiver regroups its
rows per local expert, padded to its busiest local expert for the batched matmul; the way
back is the same in reverse, and the combine weighs each token's k returned rows with one
batched matmul. On the composed CPU backend the all-to-all is an all-gather and needs no
padding; natively each chunk is padded to the largest of the group. ``last_dispatch``
records the rows each rank hands to the exchange: ``tokens * topk * imbalance``, what the
cost model prices (``imbalance`` 1 when every rank of the group routes as many tokens, on
CPU). Layers whose dispatch group is not etp-major fall back to the slots below.

Slots (a capacity factor, and compiled code): each expert's slot of a rank's dispatch
buffer holds C rows, the capacity. Compiled (ms.jit / GRAPH_MODE) shapes are static, so
dropless C = N there (a token picks an expert at most once): ``E/topk`` times the rows;
the cost model prices that with ``moe_static_slots``. Empty rows are zeros, which the
experts map to zeros (no bias), so padding changes no number. (The slot fallback sizes
dropless C from the largest per-expert count of the dispatch group.)

In PyNative each call records what the alltoall dispatcher moved on this rank in
:attr:`MoELayer.last_dispatch` (:func:`dispatch_record`).
"""

from __future__ import annotations

from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import nn, ops
from mindspore import dtype as mstype

from .. import collectives as C
from .. import mappings
from ..collectives import compiling
from ..group import ParallelGroup
from .comm import all_to_all_experts, all_to_all_v, all_to_all_v_rows, reduce_for_loss
from .config import MoEConfig, capacity_of, check_layout, dispatch_record
from .experts import GroupedExperts, SharedExperts
from .router import TopKRouter, aux_loss_from_sums

__all__ = ["MoELayer", "expert_groups"]


def _manager_group(getter: str, key: str) -> ParallelGroup:
    from .. import manager

    if manager.is_initialized():
        fn = getattr(manager, getter, None)
        if fn is not None:
            return fn()
    return ParallelGroup.trivial(key)


def expert_groups(ep_group=None, etp_group=None, tp_group=None, dp_cp_group=None, cp_group=None,
                  dispatch_group=None) -> dict:
    """The groups the layer uses: given ones resolved, the others from the manager
    (``get_expert_model_parallel_group`` ..., tp, dp-cp, cp), size 1 without a manager.

    ``dispatch_group`` (etp x ep, the ``allgather`` dispatcher's) defaults to the manager's
    ``"etp-ep"`` group, or to ``ep_group`` when etp is 1.
    """
    def pick(group, getter, key):
        return C.resolve_group(group) if group is not None else _manager_group(getter, key)

    groups = {
        "ep": pick(ep_group, "get_expert_model_parallel_group", "ep"),
        "etp": pick(etp_group, "get_expert_tensor_parallel_group", "etp"),
        "tp": pick(tp_group, "get_tensor_parallel_group", "tp"),
        "dp-cp": pick(dp_cp_group, "get_data_context_parallel_group", "dp-cp"),
        "cp": pick(cp_group, "get_context_parallel_group", "cp"),
    }
    if dispatch_group is not None:
        groups["etp-ep"] = C.resolve_group(dispatch_group)
    elif groups["etp"].size == 1:
        groups["etp-ep"] = groups["ep"]
    else:
        from .. import manager

        if manager.is_initialized():
            groups["etp-ep"] = manager.get_group("etp-ep")
        else:
            groups["etp-ep"] = ParallelGroup.trivial("etp-ep")
    return groups


class MoELayer(nn.Cell):
    """A Mixture-of-Experts FFN (see the module docstring for its collectives).

    Args:
        config: A :class:`MoEConfig`, or a ``TransformerConfig`` / ``ModelSpec`` with the
            ``moe_*`` keys (:meth:`MoEConfig.from_model`).
        ep_group: The expert-model-parallel group (default: the manager's; see
            :func:`expert_groups`, as for every group below).
        etp_group: The expert tensor-parallel group.
        tp_group: The dense tensor-parallel group (sequence-parallel inputs).
        dp_cp_group: The dense data x context group (the aux loss's sums).
        cp_group: The context-parallel group.
        dispatch_group: The etp x ep group tokens are exchanged in (Megatron's folding:
            the etp ranks of one ep rank are consecutive).
        compute_dtype: Dtype of the shared experts' matmuls.

    Inputs:
        hidden_states: (S, B, H), or (S/tp, B, H) with ``config.sequence_parallel``.

    Outputs:
        ``(output, aux_loss, stats)``: output shaped like the input; ``aux_loss`` a
        float32 scalar (coefficients applied; add it to the loss); ``stats`` (E + 1,)
        float32: tokens of this rank's input per expert (before capacity), then the
        (token, expert) assignments dropped by capacity.

    Raises:
        MoEConfigError: the experts not divisible by ep, the width by etp, or a bad
            option (at construction, on every rank, before any collective).
    """

    def __init__(self, config, ep_group=None, etp_group=None, tp_group=None, dp_cp_group=None,
                 cp_group=None, dispatch_group=None, compute_dtype=ms.float32):
        super().__init__()
        if not isinstance(config, MoEConfig):
            config = MoEConfig.from_model(config)
        g = expert_groups(ep_group, etp_group, tp_group, dp_cp_group, cp_group, dispatch_group)
        check_layout(config, g["ep"].size, g["etp"].size)
        if g["etp-ep"].size != g["ep"].size * g["etp"].size:
            from .config import MoEConfigError

            raise MoEConfigError(
                f"MoELayer: the dispatch group has {g['etp-ep'].size} ranks but etp x ep = "
                f"{g['etp'].size} x {g['ep'].size}; pass dispatch_group = the etp-ep group.")
        self.config = config
        # The dict is for Python callers; construct reads the groups as plain attributes
        # (a dict of groups does not compile).
        self.groups = g
        self.ep_group = g["ep"]
        self.etp_group = g["etp"]
        self.tp_group = g["tp"]
        self.dispatch_group = g["etp-ep"]
        self.ep = g["ep"].size
        self.etp = g["etp"].size
        self.tp = g["tp"].size
        self.num_experts = config.num_experts
        self.local_experts = config.num_experts // self.ep
        self.first_expert = g["ep"].rank * self.local_experts
        self.topk = config.topk
        self.sp = bool(config.sequence_parallel)
        self.split_tp = self.tp > 1 and not self.sp
        self.alltoall = config.dispatcher == "alltoall"
        self.dropless = config.capacity_factor is None
        self.cap_factor = 0.0 if self.dropless else float(config.capacity_factor)
        self.aux_coeff = (float(config.aux_loss_coeff)
                          if config.load_balancing_type != "none" else 0.0)
        self.z_coeff = float(config.z_loss_coeff)
        self.by_probs = config.drop_policy == "probs"
        self.seq_aux = config.load_balancing_type == "seq_aux_loss"
        self.has_loss = ((config.load_balancing_type != "none" and config.aux_loss_coeff > 0)
                         or config.z_loss_coeff > 0)
        self.loss_group = g["cp"] if self.seq_aux else g["dp-cp"]
        self.router = TopKRouter(config)
        if self.tp > 1:
            # Each tp rank routes its share of the tokens: a partial gradient, summed over
            # tp by the gradient finalizer (as a sequence-parallel weight).
            self.router.weight.sequence_parallel = True
        self.experts = GroupedExperts(config, self.local_experts, self.etp)
        self.sorted_ok = self._etp_major()
        self.last_dispatch = None
        self.shared_experts = None
        if config.shared_expert_ffn_hidden_size is not None:
            self.shared_experts = SharedExperts(config, g["tp"], compute_dtype)

    # ------------------------------------------------------------------ helpers
    def _split_sizes(self, s):
        return tuple(mappings.even_split_sizes(s, self.tp))

    def _select(self, routed, wmap, n, cap):
        """Slots of each expert: token indices (E, C) int32 and 0/1 validity (E, C)."""
        rt = routed.T  # (E, N)
        if self.by_probs:
            key = ops.where(rt > 0.5, ops.stop_gradient(wmap.T) + 2.0, -ops.ones_like(rt))
        else:
            pos = ops.cast(ops.arange(n), mstype.float32).reshape((1, n))
            key = rt * (2.0 * n) - pos
        _, idx = ops.topk(key, cap)
        idx = ops.cast(idx, mstype.int32)
        valid = ops.gather_elements(rt, 1, idx)
        return idx, valid

    def _dropless_slot(self, routed):
        """PyNative: the largest per-expert count over the dispatch group (>= 1): the
        smallest slot that drops nothing, the same on every rank of the exchange."""
        counts = ops.stop_gradient(routed).sum(0).reshape((1, self.num_experts))
        if self.dispatch_group.size > 1:
            counts = C.all_gather(counts, self.dispatch_group, 0)
        return max(int(round(float(counts.max().asnumpy()))), 1)

    def _record(self, n, buf):
        """PyNative: what the exchange of ``buf`` (E, C, H) moves (:func:`dispatch_record`)."""
        E, cap, H = buf.shape
        self.last_dispatch = dispatch_record(E, self.topk, self.ep, self.etp, n, cap, H,
                                             buf.itemsize, not self.dropless)

    def _slots_alltoall(self, x, wmap, idx, valid, n, cap):
        """Tokens into (E, cap, H) slots by ``idx``/``valid``, through the experts, back to (N, H)."""
        E = self.num_experts
        H = x.shape[1]
        flat = idx.reshape((-1,))
        buf = ops.gather(x, flat, 0).reshape((E, cap, H)) * valid.reshape((E, cap, 1))
        cw = ops.gather_elements(wmap.T, 1, idx) * valid
        y = self._experts_alltoall(buf, n)
        return ops.unsorted_segment_sum((y * cw.reshape((E, cap, 1))).reshape((E * cap, H)), flat, n)

    def _sized_alltoall(self, x, routed, wmap):
        """PyNative dropless with slots of the largest real per-expert count (nothing
        dropped): the layout for dispatch groups that are not etp-major (see
        :meth:`_sorted_alltoall`)."""
        n = x.shape[0]
        cap = self._dropless_slot(routed)
        idx, valid = self._select(routed, wmap, n, cap)
        return self._slots_alltoall(x, wmap, idx, valid, n, cap)

    def _etp_major(self) -> bool:
        """True when dispatch-group rank ``i * etp + q`` is ep rank i, etp rank q (Megatron's
        folding, the manager's ``etp-ep`` group), checked on the members this rank sees."""
        T = self.etp
        d, ep, etp = self.dispatch_group, self.ep_group, self.etp_group
        if d.rank != ep.rank * T + etp.rank:
            return False
        return (all(d.ranks[i * T + etp.rank] == ep.ranks[i] for i in range(self.ep))
                and all(d.ranks[ep.rank * T + q] == etp.ranks[q] for q in range(T)))

    def _chunk_plan(self, flat, counts):
        """Host-side plan of :meth:`_sorted_alltoall` (numpy: the sizes are known).

        Args:
            flat: (N*k,) the expert of each (token, choice) assignment, token-major.
            counts: (D, E) the assignments per expert of every dispatch-group rank
                (D = etp x ep, etp-major: rank ``i * etp + t`` is ep rank i, etp rank t).

        Returns:
            ``(send, pos, matrix, sizes, recv, back, R)``: the token of each send row (the
            assignments sorted by expert, so chunk j holds ep rank j's experts); the send
            row of each assignment (where it comes back); the ep size matrix
            (``matrix[i][j]`` rows from ep rank i to ep rank j in this rank's etp slice);
            the rows each etp rank of this ep rank receives; for each of the ``L * R``
            expert rows the received row it takes (``R`` the busiest local expert's rows);
            for each received row its expert row. Padding points at row 0: padded rows
            are never read back, so they need no zeros.

        An ep rank whose experts get no row at all receives one dummy row per etp slice
        (token 0 of ep rank 0), sent back and dropped: every rank's exchanges and row
        gathers are then non-empty, so all ranks run the same collectives forward and
        backward (an empty gather has no backward on CPU).
        """
        G, T, L = self.ep, self.etp, self.local_experts
        q, e = self.etp_group.rank, self.ep_group.rank
        per_dest = counts.reshape((G, T, G, L)).sum(3)  # [i, t, j] rows of rank (i, t) for ep rank j
        dummy = per_dest.sum((0, 1)) == 0  # (G,) ep ranks that receive nothing
        per_dest[0, :, dummy] += 1
        matrix = tuple(tuple(int(v) for v in per_dest[i, q]) for i in range(G))
        sizes = [int(per_dest[:, t, e].sum()) for t in range(T)]
        order = np.argsort(flat, kind="stable")
        sent = per_dest[e, q]
        send = np.zeros(int(sent.sum()), np.int64)
        pos = np.empty(flat.shape[0], np.int64)
        row = start = 0
        k = self.topk
        for j in range(G):
            real = int(sent[j]) - int(e == 0 and dummy[j])
            chunk = order[start:start + real]
            send[row:row + real] = chunk // k
            pos[chunk] = row + np.arange(real)
            start += real
            row += int(sent[j])  # a dummy row (token 0) ends the chunk
        # Received (gathered over etp): block t holds the chunks from ep ranks i of etp
        # slice t in ep-rank order, each sorted by this rank's local experts.
        mine = counts[:, e * L:(e + 1) * L].reshape((G, T, L)).transpose(1, 0, 2)  # (T, G, L)
        R = max(int(mine.sum((0, 1)).max()), 1)
        recv = np.zeros(L * R, np.int64)
        back = np.zeros(sum(sizes), np.int64)
        fill = np.zeros(L, np.int64)
        base = 0
        for t in range(T):
            for i in range(G):
                for l in range(L):
                    c = int(mine[t, i, l])
                    if c:
                        rows = base + np.arange(c)
                        slots = l * R + fill[l] + np.arange(c)
                        recv[slots] = rows
                        back[rows] = slots
                        fill[l] += c
                    base += c
                if i == 0 and dummy[e]:
                    base += 1  # the dummy row: back[] sends expert row 0 back for it
        return send, pos, matrix, sizes, recv, back, R

    def _sorted_alltoall(self, x, indices, weights):
        """PyNative dropless, Megatron's layout: the (token, expert) assignments sorted by
        expert and exchanged over ep with an uneven all-to-all (:func:`.comm.all_to_all_v`:
        on the composed CPU backend no padding at all, natively each chunk padded to the
        largest), then over etp, regrouped per local expert for the batched matmul, and
        back; the combine weighs each token's k rows with one batched matmul.

        Collectives: the all-gather of the E counts over etp x ep (the sizes), the
        all-to-alls, and with etp > 1 the uneven etp all-gather / reduce-scatter. Every
        copy is one row gather: tokens -> sorted rows, received -> per-expert rows, expert
        rows -> received order, returned -> (N, k) rows.
        """
        n, H = x.shape
        k = self.topk
        E, L = self.num_experts, self.local_experts
        flat = indices.asnumpy().reshape(-1)
        counts = np.bincount(flat, minlength=E).astype(np.float32).reshape((1, E))
        if self.dispatch_group.size > 1:
            counts = C.all_gather(ms.Tensor(counts), self.dispatch_group, 0).asnumpy()
        counts = np.rint(counts).astype(np.int64)
        send, pos, matrix, sizes, recv, back, R = self._chunk_plan(flat, counts)
        self._record_sorted(n, H, x.itemsize, matrix, L * R)
        i32 = lambda a: ms.Tensor(a.astype(np.int32))  # noqa: E731
        y = ops.gather(x, i32(send), 0)  # sorted by expert
        y = all_to_all_v(y, self.ep_group, matrix)
        if self.etp > 1:
            y = mappings.gather_from_sequence(y, self.etp_group, True, sizes)
        y = ops.gather(y, i32(recv), 0).reshape((L, R, H))
        y = self.experts(y).reshape((L * R, H))
        y = ops.gather(y, i32(back), 0)
        if self.etp > 1:
            y = mappings.reduce_scatter_to_sequence(y, self.etp_group, sizes)
        y = all_to_all_v(y, self.ep_group, tuple(zip(*matrix)))  # this rank's send rows
        y = ops.gather(y, i32(pos), 0).reshape((n, k, H))
        if y.dtype != weights.dtype:
            y = ops.cast(y, weights.dtype)
        return ops.bmm(weights.reshape((n, 1, k)), y).reshape((n, H))

    def _record_sorted(self, n, H, itemsize, matrix, expert_rows):
        """:attr:`last_dispatch` of :meth:`_sorted_alltoall`: ``rows`` is the buffer each rank
        hands to the ep all-to-all (:func:`.comm.all_to_all_v_rows`), in slot terms
        ``rows / E`` rows per expert; ``expert_rows`` what the local experts multiply
        (``L * R``, each padded to the busiest)."""
        E = self.num_experts
        rows = all_to_all_v_rows(self.ep_group, matrix) if self.ep > 1 else sum(matrix[0])
        rec = dispatch_record(E, self.topk, self.ep, self.etp, n, rows / E, H, itemsize, False)
        whole = lambda v: int(v) if v == int(v) else v  # noqa: E731
        one = (self.ep - 1) * rows * H * itemsize / self.ep
        rec.update(rows=rows, all_to_all_bytes=whole(one), step_all_to_all_bytes=whole(4 * one),
                   etp_bytes=(self.etp - 1) * rows * H * itemsize, expert_rows=expert_rows)
        self.last_dispatch = rec

    def _experts_alltoall(self, buf, n):
        """(E, C, H) dispatch buffer of ``n`` tokens -> (E, C, H) expert outputs, through ep
        and etp."""
        if not compiling():
            self._record(n, buf)
        E, cap, H = buf.shape
        L = self.local_experts
        y = all_to_all_experts(buf, self.ep_group)  # (ep*L, C, H) from each source
        if self.etp > 1:
            y = mappings.gather_from_sequence(y, self.etp_group)  # (etp*ep*L, C, H)
        src = y.shape[0] // L
        y = y.reshape((src, L, cap, H)).transpose(1, 0, 2, 3).reshape((L, src * cap, H))
        y = self.experts(y)
        y = y.reshape((L, src, cap, H)).transpose(1, 0, 2, 3).reshape((src * L, cap, H))
        if self.etp > 1:
            y = mappings.reduce_scatter_to_sequence(y, self.etp_group)
        return all_to_all_experts(y, self.ep_group)

    def _weight_map(self, indices, weights):
        """(N, E): each token's routing weight at its chosen experts, 0 elsewhere."""
        onehot = ops.one_hot(indices, self.num_experts, ops.ones((), mstype.float32),
                             ops.zeros((), mstype.float32))
        return (onehot * weights.reshape(weights.shape + (1,))).sum(1)

    def _route_and_run(self, x, num_seqs):
        """Tokens (N, H) of this rank -> (out (N, H), stats vector, loss sums)."""
        n, H = x.shape
        E = self.num_experts
        indices, weights, routed, sums = self.router(x, num_seqs)
        if self.dropless:
            keep = routed
        else:
            wmap = self._weight_map(indices, weights)
            cap = capacity_of(self.cap_factor, n, self.topk, self.num_experts)
            idx, valid = self._select(routed, wmap, n, cap)
        if self.alltoall:
            if self.dropless:
                if compiling():
                    # Static shapes: every expert's slot holds all N tokens.
                    buf = x.reshape((1, n, H)) * routed.T.reshape((E, n, 1))
                    y = self._experts_alltoall(buf, n)
                    wmap = self._weight_map(indices, weights)
                    out = (y * wmap.T.reshape((E, n, 1))).sum(0)
                elif self.sorted_ok:
                    # No (N, E) weight map: the combine takes the router's (N, k) weights.
                    out = self._sorted_alltoall(x, indices, weights)
                else:
                    out = self._sized_alltoall(x, routed, self._weight_map(indices, weights))
            else:
                out = self._slots_alltoall(x, wmap, idx, valid, n, cap)
                keep = ops.zeros((E, n), mstype.float32)
                keep = ops.tensor_scatter_elements(keep, idx, valid, 1).T
        else:
            if self.dropless:
                wmap = self._weight_map(indices, weights)
            else:
                keep = ops.tensor_scatter_elements(ops.zeros((E, n), mstype.float32), idx, valid, 1).T
            out = self._experts_allgather(x, wmap * keep, ops.stop_gradient(keep))
        counts = routed.sum(0) if not self.seq_aux else \
            routed.reshape((n // num_seqs, num_seqs, E)).sum(0).reshape((-1,))
        dropped = (routed.sum() - ops.stop_gradient(keep).sum()).reshape((1,))
        return out, ops.stop_gradient(counts), ops.stop_gradient(dropped), sums

    def _experts_allgather(self, x, cwmap, keep):
        """Every rank of the dispatch group runs its local experts on all the group's tokens."""
        grp = self.dispatch_group
        H = x.shape[1]
        E = self.num_experts
        L = self.local_experts
        both = ops.cat((x, cwmap, keep), 1)  # (N, H + 2E)
        allg = mappings.gather_from_sequence(both, grp)
        xg = allg[:, :H]
        first = self.first_expert
        wl = allg[:, H + first: H + first + L]  # (T, L)
        kl = ops.stop_gradient(allg[:, H + E + first: H + E + first + L])
        t = xg.shape[0]
        buf = xg.reshape((1, t, H)) * kl.T.reshape((L, t, 1))
        y = self.experts(buf)
        part = (y * wl.T.reshape((L, t, 1))).sum(0)
        return mappings.reduce_scatter_to_sequence(part, grp)

    # ------------------------------------------------------------------ forward
    def construct(self, hidden_states):
        x = hidden_states
        S, B, H = x.shape
        shared = None
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
        if self.split_tp:
            sizes = self._split_sizes(S)
            # Positional arguments: keyword arguments next to a group object broke the
            # compiled gradient w.r.t. the weights (measured under ms.jit).
            x = mappings.scatter_to_sequence(x, self.tp_group, sizes)
        s_local = x.shape[0]
        tokens = x.reshape((s_local * B, H))
        out, counts, dropped, sums = self._route_and_run(tokens, B)
        E = self.num_experts
        stats_vec = ops.cat((counts, dropped), 0)
        if self.tp > 1:
            stats_vec = reduce_for_loss(stats_vec, self.tp_group)
        if self.seq_aux:
            stats = ops.cat((stats_vec[:-1].reshape((B, E)).sum(0), stats_vec[-1:]), 0)
        else:
            stats = stats_vec
        if self.has_loss:
            if self.tp > 1:
                sums = reduce_for_loss(sums, self.tp_group, 1.0 / self.tp)
            glob = ops.cat((stats_vec[:-1], sums), 0)
            glob = reduce_for_loss(glob, self.loss_group)
            n_c = stats_vec.shape[0] - 1
            aux = aux_loss_from_sums(self.num_experts, self.topk, self.aux_coeff, self.z_coeff,
                                     self.seq_aux, ops.stop_gradient(glob[:n_c]), glob[n_c:], B)
        else:
            aux = sums.sum() * 0.0
        out = out.reshape((s_local, B, H))
        if self.split_tp:
            out = mappings.gather_from_sequence(out, self.tp_group, False, self._split_sizes(S))
        out = ops.cast(out, hidden_states.dtype)
        if shared is not None:
            out = out + ops.cast(shared, out.dtype)
        return out, aux, stats

    def update_expert_bias(self, tokens_per_expert):
        """The router's :meth:`TopKRouter.update_expert_bias` (a no-op unless
        ``enable_expert_bias``)."""
        return self.router.update_expert_bias(tokens_per_expert)
