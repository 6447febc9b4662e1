"""Random streams for model parallelism: Megatron's RNG tracker on MindSpore's seeds.

Dropout on activations that every tp rank holds alike (e.g. the residual stream
outside sequence parallelism) must draw the SAME mask on every tp rank, and dropout inside a tensor-parallel region (attention probabilities of this
rank's heads, this rank's MLP columns) must draw DIFFERENT masks per tp rank, or the
ranks' shards would be dropped in lockstep. Megatron keeps two streams: the default one,
and a "model-parallel" one entered with ``get_rng_tracker().fork()``.

    from mindscience.distributed import random as msrandom

    msrandom.model_parallel_seed(1234)           # after initialize_parallel, on every rank
    y = ops.dropout(x, p=0.1)                    # the same mask on every tp rank
    with msrandom.get_rng_tracker().fork():
        h = ops.dropout(h_local, p=0.1)          # a different mask on each tp rank

Seeds (Megatron's rule, :func:`model_parallel_seed`):

=====================  ====================================  ============================
stream                 seed                                  equal across
=====================  ====================================  ============================
default                ``seed + 100 * pp_rank``              tp, cp, dp ranks (differs
                       (``+ 10 * dp_rank`` with                per pipeline stage)
                       ``data_parallel_random_init``)
``model-parallel-rng`` default + 2718 + ``tp_rank``          cp, dp ranks (differs per
                                                             tp rank and pp stage)
=====================  ====================================  ============================

cp ranks share both streams: they hold different tokens, so the same stream still drops
different activations (Megatron does the same).

What a "stream" is in MindSpore 2.10 (measured on CPU): ``ops.dropout`` and
``nn.Dropout`` draw from a Philox kernel seeded with ``(global seed, op seed)``; the global
seed is ``mindspore.set_seed``'s and the op seed is a per-kernel-name counter that
advances at every ``ops.dropout`` call (and every ``nn.Dropout`` construction). Neither
follows ``mindspore.get_rng_state()`` (the default ``Generator``, used by ``mint`` random
ops). A stream's state is therefore ``(global seed, op-seed counters, Generator state)``;
:meth:`RNGStatesTracker.fork` swaps all three in and out. The counters live in a private
MindSpore module (``mindspore.common.seed``), read and written in one place here.

Compiled code (``ms.jit``, GRAPH_MODE): the seeds of a dropout are fixed when the graph is
traced, and its kernel then advances its own state at every run. So ``fork()`` takes
effect around the code that fixes the seeds: the construction of ``nn.Dropout`` layers,
or the first call (the trace) of a compiled function that calls ``ops.dropout``. A
``with fork():`` statement inside compiled code is not supported, and ``set_states``
cannot rewind the kernels of an already compiled graph (build or trace again to replay).

Activation recompute (measured on CPU, MindSpore 2.10): ``Cell.recompute()`` in PyNative
restores only the default ``Generator`` before it re-runs the block, so an
``ops.dropout`` in the block (on the default stream or under ``fork()``) draws a NEW mask
in the recomputed forward and the gradients are wrong; it also advances every stream
twice per step. :func:`recompute` marks a cell so that its recomputed forward replays the
states of every stream the forward started from, and leaves them where the forward left
them afterwards: gradients and later masks equal those without recompute. Compiled code
(``ms.jit``, GRAPH_MODE) needs nothing: its recompute pass re-runs the traced kernels with
the same seeds (measured: identical gradients with ``ops.dropout`` in the block).
"""

from __future__ import annotations

import contextlib
import importlib
import numbers

import mindspore as ms

__all__ = ["RNGStatesTracker", "get_rng_tracker", "model_parallel_seed", "MODEL_PARALLEL_RNG",
           "seeds_for", "recompute"]

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_OFFSET = 2718
_PP_STRIDE = 100
_DP_STRIDE = 10

# mindspore.common.seed: the global seed and the per-kernel op-seed counters of the
# ops.dropout family (private: the only place that holds them).
_SEED = importlib.import_module("mindspore.common.seed")


def _capture():
    """The current stream: (global seed, op-seed counters, default Generator state)."""
    try:
        generator = ms.get_rng_state()
    except Exception:  # noqa: BLE001 - a build without the default generator
        generator = None
    return (_SEED._GLOBAL_SEED, dict(_SEED._KERNEL_SEED), generator)


def _install(state) -> None:
    seed, counters, generator = state
    _SEED._GLOBAL_SEED = seed
    _SEED._KERNEL_SEED.clear()
    _SEED._KERNEL_SEED.update(counters)
    if generator is not None:
        ms.set_rng_state(generator)


def _fresh(seed: int):
    """The state right after seeding with ``seed``, without touching the current one
    (``mindspore.set_seed`` would also reseed numpy, which parameter init draws from)."""
    generator = ms.Generator()
    generator.manual_seed(seed)
    return (int(seed), {}, generator.get_state())


def _check_seed(where, seed):
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"{where}: seed={seed!r} must be an integer >= 0.")


class RNGStatesTracker:
    """Named random streams; ``fork(name)`` runs a block on one of them.

    Outside every ``fork()`` the default stream is in force. Entering ``fork(name)`` saves
    the default stream, installs ``name``'s; leaving saves ``name``'s (advanced by what the
    block drew) and restores the default, so the default stream continues as if the
    block had drawn nothing.
    """

    def __init__(self):
        self._states = {}

    def reset(self) -> None:
        self._states = {}

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` seeded with ``seed``."""
        _check_seed("RNGStatesTracker.add", seed)
        if name in self._states:
            raise ValueError(f"RNGStatesTracker.add: the stream {name!r} already exists; call "
                             "reset() first, or pick another name.")
        self._states[name] = _fresh(seed)

    def get_states(self) -> dict:
        """A copy of every stream's state (to replay them later with :meth:`set_states`)."""
        return {name: (s, dict(c), g) for name, (s, c, g) in self._states.items()}

    def set_states(self, states: dict) -> None:
        """Install states returned by :meth:`get_states` (replaces all streams)."""
        self._states = {name: (s, dict(c), g) for name, (s, c, g) in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block on stream ``name`` (default: the model-parallel one)."""
        if name not in self._states:
            raise ValueError(f"RNGStatesTracker.fork: no stream {name!r}; call "
                             "model_parallel_seed(seed) (or add(name, seed)) first. Streams: "
                             f"{sorted(self._states) or 'none'}.")
        saved = _capture()
        _install(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _capture()
            _install(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (one per process, as Megatron's)."""
    return _TRACKER


def _stream_state():
    """Every stream at once: the one in force and the tracker's."""
    return _capture(), _TRACKER.get_states()


def _install_stream_state(state) -> None:
    _install(state[0])
    _TRACKER.set_states(state[1])


_REPLAY_CLS = {}


def _replay_cls():
    """MindSpore's recompute cell with every stream replayed (built on first use).

    ``Cell.recompute()`` puts a ``_RecomputeCell`` (private, ``mindspore.common.recompute``)
    in front of the cell: its forward runs the block without a tape and records the
    Generator state, its ``bprop`` re-runs the block with autodiff. This subclass records
    every stream as well, installs them around the re-run, then puts back the streams in
    force. (MindSpore's non-reentrant recompute, which takes such context managers, fails
    on CPU once the block holds a custom-bprop cell, as every collective mapping is:
    "Stack input_args_info_stack_ is empty", measured.)
    """
    cls = _REPLAY_CLS.get("cls")
    if cls is None:
        base = importlib.import_module("mindspore.common.recompute")._RecomputeCell

        class _ReplayRecompute(base):
            def __init__(self, block):
                super().__init__(block)
                self.stream_states = []

            def construct(self, *args, **kwargs):
                self.stream_states.append(_stream_state())
                return super().construct(*args, **kwargs)

            def bprop(self, *args):
                now = _stream_state()
                _install_stream_state(self.stream_states.pop())
                try:
                    return super().bprop(*args)
                finally:
                    _install_stream_state(now)

        cls = _REPLAY_CLS["cls"] = _ReplayRecompute
    return cls


def recompute(cell):
    """Recompute ``cell``'s forward in the backward, with the same dropout masks.

    ``cell.recompute()``, whose PyNative recomputed forward then starts from the states
    every stream (the default one and the tracker's) had at the forward, and leaves them
    where the forward left them: the gradients and every later mask equal those without
    recompute. Compiled code is unchanged (``Cell.recompute()`` already replays its traced
    seeds there). Returns ``cell``.

    Example (any tp): ``random.recompute(mlp)``; ``mlp``'s forward may draw dropout on the
    default stream and inside ``get_rng_tracker().fork()``, and the gradients equal those
    of the same step without recompute (measured at tp2, collectives in the block).

    Raises:
        TypeError: ``cell`` is not an ``nn.Cell``.
    """
    if not isinstance(cell, ms.nn.Cell):
        raise TypeError(f"random.recompute: cell must be an nn.Cell, got {type(cell).__name__}; "
                        "wrap a function in a Cell whose construct calls it.")
    cell.recompute()
    # The same assignment Cell.recompute() makes, with the replaying cell.
    cell._recompute_cell = _replay_cls()(cell.construct)  # pylint: disable=protected-access
    return cell


def seeds_for(seed: int, tp_rank: int = 0, pp_rank: int = 0, dp_rank: int = 0,
              data_parallel_random_init: bool = False) -> dict:
    """``{"default": ..., "model-parallel-rng": ...}``: the seeds of a rank (pure arithmetic).

    ``seeds_for(1234, tp_rank=1, pp_rank=2) == {"default": 1434, "model-parallel-rng": 4153}``.
    """
    default = seed + _PP_STRIDE * pp_rank + (_DP_STRIDE * dp_rank if data_parallel_random_init else 0)
    return {"default": default, MODEL_PARALLEL_RNG: default + _TP_OFFSET + tp_rank}


def model_parallel_seed(seed: int, *, data_parallel_random_init: bool = False) -> dict:
    """Seed the default stream and the model-parallel stream of this rank (see the module
    docstring for the rule). Call it on every rank after ``initialize_parallel`` (without
    it, tp = pp = dp = 1).

    Seeds the default stream with ``mindspore.set_seed`` (numpy too, so parameter init
    after it is deterministic) and resets the tracker to one stream,
    ``"model-parallel-rng"``. Returns the seeds used.

    Raises:
        ValueError: ``seed`` is not an integer >= 0.
    """
    _check_seed("model_parallel_seed", seed)
    from . import manager

    tp = pp = dp = 0
    if manager.is_initialized():
        tp = manager.get_tensor_parallel_rank()
        pp = manager.get_pipeline_parallel_rank()
        dp = manager.get_data_parallel_rank()
    seeds = seeds_for(int(seed), tp, pp, dp, data_parallel_random_init)
    ms.set_seed(seeds["default"])
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seeds[MODEL_PARALLEL_RNG])
    return seeds
