"""``TransformerConfig``: the shape and training options of a GPT-style model (pure: no MindSpore).

The fields are those of the cost model's ``model:`` and ``training:`` sections (contract
C4), so one YAML file describes what ``msdist plan --model`` prices and what
:class:`~mindscience.distributed.models.GPTModel` builds::

    cfg = TransformerConfig.from_model_spec("tiny-llama")            # a bundled preset
    cfg = TransformerConfig.from_model_spec("my-model.yaml", num_layers=5)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                            seq_length=64, vocab_size=256)

:meth:`TransformerConfig.num_parameters` counts exactly the parameters GPTModel builds
(per layer: input norm, fused qkv ``h x (h + 2 g d)``, output projection ``h x h``,
post-attention norm, fc1 ``h x f`` (``h x 2f`` for SwiGLU), fc2 ``f x h``, biases when
``bias``; the embedding ``V x h``, learned positions ``s x h``, the final norm and an
untied output layer ``V x h``). :meth:`TransformerConfig.check_layout` says before any
collective whether a layout can run the model, with the fix.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional, Union

from ..costmodel.errors import ModelConstraintError, ModelError
from ..costmodel.spec import ModelSpec, TrainingSpec, Workload, load_workload
from ..pipeline.split import stage_layers

__all__ = ["TransformerConfig", "resolve_model_file"]

_MODEL_KEYS = tuple(f.name for f in fields(ModelSpec))
_TRAINING_KEYS = ("micro_batch_size", "global_batch_size", "precision", "recompute",
                  "sequence_parallel", "virtual_pipeline_stages", "zero_stage",
                  "context_parallel_method", "first_stage_layers", "last_stage_layers",
                  "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def _models_dir() -> Path:
    """``layouts/models`` of this checkout (``$MSDIST_LAYOUTS_DIR/models`` when set), as the CLI."""
    override = os.environ.get("MSDIST_LAYOUTS_DIR")
    base = Path(override) if override else Path(__file__).resolve().parents[3] / "layouts"
    return base / "models"


def resolve_model_file(spec) -> Path:
    """The model file meant by ``spec``: an existing path, or a bundled preset name.

    The same lookup as ``msdist plan --model``: a path that exists wins, then
    ``layouts/models/<name>.yaml``.

    Raises:
        ModelError: nothing matches; the message lists the presets.
    """
    path = Path(spec)
    if path.exists():
        return path
    name = path.stem if path.suffix in (".yaml", ".yml") and path.parent == Path(".") else str(spec)
    presets = {p.stem: p for p in sorted(_models_dir().glob("*.yaml"))}
    if name in presets:
        return presets[name]
    raise ModelError(f"{spec}: no such model file or bundled model preset: pass a YAML path or "
                     f"one of: {', '.join(presets) or '(none found)'}.")


@dataclass(frozen=True)
class TransformerConfig:
    """A GPT-style decoder and how it is trained; validated at construction.

    Model (the ``model:`` section): ``num_layers``, ``hidden_size``,
    ``num_attention_heads``, ``seq_length``, ``vocab_size``, ``num_query_groups`` (None:
    the head count), ``ffn_hidden_size`` (None: ``4 * hidden_size``), ``normalization``
    (``layernorm`` | ``rmsnorm``), ``activation`` (``gelu`` | ``swiglu``),
    ``position_embedding`` (``learned`` | ``rope``), ``tie_embeddings``, ``bias``,
    ``dropout``, ``name``; mixture of experts (contract C of issue 36, Megatron-core's
    names): ``num_moe_experts`` (None: dense), ``moe_router_topk``, ``moe_ffn_hidden_size``
    (None: ``ffn_hidden_size``), ``moe_layer_freq`` (int N: layer ``i`` is MoE when
    ``i % N == 0``; or a 0/1 tuple per layer, :meth:`is_moe_layer`),
    ``moe_shared_expert_intermediate_size``, ``moe_router_score_function``,
    ``moe_router_pre_softmax``, ``moe_aux_loss_coeff``, ``moe_z_loss_coeff``,
    ``moe_token_dispatcher_type``, ``moe_expert_capacity_factor`` (None: dropless),
    ``moe_router_enable_expert_bias``, ``moe_router_load_balancing_type``,
    ``moe_router_topk_scaling_factor``, ``moe_router_num_groups``,
    ``moe_router_group_topk``, ``moe_router_bias_update_rate``, ``moe_expert_drop_policy``,
    ``moe_pad_expert_input_to_capacity``.

    Training (the ``training:`` section): ``context_parallel_method`` (``ring``, the
    causal ring with the zigzag load balance; ``ulysses``; ``allgather_kv``),
    ``recompute`` (``none`` | ``selective``: the attention core | ``full``: each layer),
    ``zero_stage``, ``sequence_parallel``, ``virtual_pipeline_stages``,
    ``first_stage_layers``, ``last_stage_layers``,
    ``account_for_embedding_in_pipeline_split``, ``account_for_loss_in_pipeline_split``,
    ``micro_batch_size``, ``global_batch_size``, ``precision`` (``fp32`` by default here:
    the reference model is checked in float32; ``bf16``/``fp16`` keep the parameters in
    that dtype).

    Raises:
        ModelError: a value out of range or an unknown choice (the cost model's checks,
            same messages).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    normalization: str = "layernorm"
    activation: str = "gelu"
    position_embedding: str = "learned"
    tie_embeddings: bool = True
    bias: bool = True
    dropout: float = 0.0
    name: Optional[str] = None
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_layer_freq: Union[int, tuple] = 1
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_token_dispatcher_type: str = "alltoall"
    moe_expert_capacity_factor: Optional[float] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_load_balancing_type: str = "aux_loss"
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    context_parallel_method: str = "ring"
    recompute: str = "none"
    zero_stage: int = 0
    sequence_parallel: bool = True
    virtual_pipeline_stages: int = 1
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None
    precision: str = "fp32"

    def __post_init__(self):
        # The cost model's specs validate every value (and fill the defaults), so a config
        # accepts exactly what `msdist plan --model` accepts.
        model = self.model_spec()
        training = self.training_spec()
        object.__setattr__(self, "num_query_groups", model.num_query_groups)
        object.__setattr__(self, "ffn_hidden_size", model.ffn_hidden_size)
        object.__setattr__(self, "moe_ffn_hidden_size", model.moe_ffn_hidden_size)
        object.__setattr__(self, "moe_layer_freq", model.moe_layer_freq)  # a list becomes a tuple
        object.__setattr__(self, "zero_stage", training.zero_stage)
        # The stage cut (first/last_stage_layers...) depends on pp: check_layout checks it.

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_model_spec(cls, spec, **overrides) -> "TransformerConfig":
        """The config of a model file, a bundled preset name or a cost-model ``Workload``.

        Args:
            spec: A preset name (``"gqa-7b"``, ``"tiny-gpt"``...), a YAML path (the file
                ``msdist plan --model`` reads: a ``model:`` section, optionally
                ``training:``), a :class:`~..costmodel.spec.Workload` or a
                :class:`~..costmodel.spec.ModelSpec`.
            **overrides: Fields to replace, e.g. ``num_layers=5``.

        Raises:
            ModelError: an unknown preset or bad file (``ModelFileError``), an unknown
                override, or an invalid value.
        """
        if isinstance(spec, ModelSpec):
            workload = Workload(model=spec, training=TrainingSpec(precision="fp32"))
        elif isinstance(spec, Workload):
            workload = spec
        else:
            workload = load_workload(resolve_model_file(spec))
        if workload.model is None:
            raise ModelError(f"{spec!r} has no model section: a model file holds 'model:' "
                             "(num_layers, hidden_size, ...).")
        values = {k: getattr(workload.model, k) for k in _MODEL_KEYS}
        values.update({k: getattr(workload.training, k) for k in _TRAINING_KEYS})
        unknown = sorted(set(overrides) - {f.name for f in fields(cls)})
        if unknown:
            raise ModelError(f"TransformerConfig.from_model_spec: unknown field(s) "
                             f"{', '.join(unknown)}: expected fields of TransformerConfig "
                             f"({', '.join(f.name for f in fields(cls))}).")
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes) -> "TransformerConfig":
        """A copy with ``changes`` (validated again)."""
        return replace(self, **changes)

    def model_spec(self) -> ModelSpec:
        """The cost model's ``ModelSpec`` of this config."""
        return ModelSpec(**{k: getattr(self, k) for k in _MODEL_KEYS})

    def training_spec(self) -> TrainingSpec:
        """The cost model's ``TrainingSpec`` of this config."""
        return TrainingSpec(**{k: getattr(self, k) for k in _TRAINING_KEYS})

    def to_dict(self) -> dict:
        return asdict(self)

    # ------------------------------------------------------------------ shapes
    @property
    def head_dim(self) -> int:
        """Channels per head, ``hidden_size / num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads

    @property
    def qkv_size(self) -> int:
        """Output features of the fused qkv projection, ``h + 2 g d``."""
        return self.hidden_size + 2 * self.num_query_groups * self.head_dim

    @property
    def fc1_size(self) -> int:
        """Output features of fc1: ``f``, or ``2f`` with SwiGLU (gate and up fused)."""
        return self.ffn_hidden_size * (2 if self.activation == "swiglu" else 1)

    def _norm(self) -> int:
        return self.hidden_size * (2 if self.normalization == "layernorm" else 1)

    @property
    def is_moe(self) -> bool:
        """The model has routed experts (``num_moe_experts`` is set)."""
        return self.num_moe_experts is not None

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) has a MoE layer in place of its MLP."""
        if not 0 <= index < self.num_layers:
            raise ModelError(f"layer index {index} is out of range: the model has {self.num_layers} layers "
                             f"(0 to {self.num_layers - 1}).")
        return self.model_spec().is_moe_layer(index)

    def _mlp(self, width: int, bias: bool) -> int:
        # fc1 h x F (F = 2 width with SwiGLU) and fc2 width x h, with their biases.
        f1 = width * (2 if self.activation == "swiglu" else 1)
        return self.hidden_size * f1 + width * self.hidden_size + ((f1 + self.hidden_size) if bias else 0)

    def expert_parameters(self) -> int:
        """Routed-expert parameters of one MoE layer: ``E x (h x F_e + f_e x h)``, no biases
        (``F_e`` = ``2 f_e`` with SwiGLU, ``f_e`` = ``moe_ffn_hidden_size``); 0 when dense."""
        return self.num_moe_experts * self._mlp(self.moe_ffn_hidden_size, False) if self.is_moe else 0

    def layer_parameters(self, moe: bool = False) -> int:
        """Parameters of one transformer layer (contract C4).

        ``moe``: a MoE layer, whose MLP is the router ``E x h`` (no bias), the routed
        experts (:meth:`expert_parameters`) and the shared experts, a dense MLP of width
        ``moe_shared_expert_intermediate_size`` without biases (``moe.SharedExperts``).
        """
        h, b = self.hidden_size, bool(self.bias)
        qkv = h * self.qkv_size + (self.qkv_size if b else 0)
        proj = h * h + (h if b else 0)
        if not moe:
            return 2 * self._norm() + qkv + proj + self._mlp(self.ffn_hidden_size, b)
        shared = self.moe_shared_expert_intermediate_size
        router = self.num_moe_experts * h
        return (2 * self._norm() + qkv + proj + router + self.expert_parameters()
                + (self._mlp(shared, False) if shared else 0))

    def embedding_parameters(self) -> int:
        """Word embedding ``V x h`` plus learned positions ``s x h`` (none with RoPE)."""
        positions = self.seq_length * self.hidden_size if self.position_embedding == "learned" else 0
        return self.vocab_size * self.hidden_size + positions

    def num_parameters(self) -> int:
        """All parameters of the dense model, counted once (a tied output layer is the embedding).

        Example: ``tiny-gpt`` (4 layers, h 64, f 256, s 64, V 256, layernorm, gelu,
        learned, tied, bias): 4 * 49,984 + 16,384 + 4,096 + 128 = 220,544.
        """
        head = 0 if self.tie_embeddings else self.vocab_size * self.hidden_size
        moe = sum(self.is_moe_layer(i) for i in range(self.num_layers)) if self.is_moe else 0
        layers = (self.num_layers - moe) * self.layer_parameters()
        if moe:
            layers += moe * self.layer_parameters(moe=True)
        return layers + self.embedding_parameters() + self._norm() + head

    def stage_layers(self, pp: int) -> list:
        """Layers of every model stage at pipeline size ``pp`` (``pp * v`` entries at
        ``pp > 1``; one entry at ``pp == 1``, where the chunks are not used)."""
        v = self.virtual_pipeline_stages if pp > 1 else 1
        return stage_layers(
            self.num_layers, pp, v, first_stage_layers=self.first_stage_layers,
            last_stage_layers=self.last_stage_layers,
            account_for_embedding_in_pipeline_split=self.account_for_embedding_in_pipeline_split,
            account_for_loss_in_pipeline_split=self.account_for_loss_in_pipeline_split)

    # ------------------------------------------------------------------ layout checks
    def check_layout(self, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None) -> list:
        """Raise if the model cannot run at ``tp x cp x pp`` (experts at ``ep x etp``); return the stage layers.

        Every rank runs this before any collective, so a bad config raises everywhere.
        ``etp`` None means ``tp`` (the layout's default).

        Raises:
            ModelConstraintError: a size that does not divide (heads, query groups,
                vocabulary, ffn, the sequence, ``num_moe_experts % ep``, the expert and
                shared-expert widths over etp and tp), expert parallelism for a dense
                model, or layers that cannot be cut; the message names the value and the fix.
        """
        self._check_experts(tp, ep, tp if etp is None else etp)
        if self.vocab_size < 1:
            raise ModelError(f"vocab_size={self.vocab_size}: GPTModel embeds tokens and predicts "
                             "them, so it needs vocab_size >= 1 (a cost-model preset without "
                             "embeddings cannot be built); set vocab_size.")
        g = self.num_query_groups
        for what, value, key in (("num_query_groups", g, "whole query groups per tp rank"),
                                 ("vocab_size", self.vocab_size, "vocabulary rows per tp rank"),
                                 ("ffn_hidden_size", self.ffn_hidden_size, "MLP columns per tp rank")):
            if value % tp:
                raise ModelConstraintError(
                    f"{what}={value} is not divisible by tp={tp}: GPTModel holds {key}. Use a tp "
                    f"that divides {value}, or make {what} a multiple of {tp} (e.g. "
                    f"{-(-value // tp) * tp}).", f"{what} % tp")
        if cp > 1:
            chunks = 2 * cp if self.context_parallel_method == "ring" else cp
            if self.seq_length % chunks:
                why = ("the causal ring cuts the sequence in 2*cp chunks (zigzag load balance)"
                       if chunks != cp else "every cp rank holds seq_length/cp tokens")
                raise ModelConstraintError(
                    f"seq_length={self.seq_length} is not divisible by {chunks} at cp={cp}: {why}. "
                    f"Use a sequence length that is a multiple of {chunks}, or another cp.",
                    "seq_length % cp")
            if self.context_parallel_method == "ulysses" and (g // tp) % cp:
                raise ModelConstraintError(
                    f"context_parallel_method='ulysses' at tp={tp} x cp={cp} needs the key/value "
                    f"heads per tp rank (num_query_groups/tp = {g}/{tp} = {g // tp}) divisible by "
                    f"cp={cp}: the all-to-all hands every cp rank whole heads. Use 'ring' or "
                    "'allgather_kv', or a smaller cp.", "heads % (tp*cp)")
        if self.sequence_parallel and tp > 1:
            local = self.seq_length // cp
            if local % tp:
                raise ModelConstraintError(
                    f"sequence_parallel at tp={tp}: each cp rank's {local} tokens "
                    f"(seq_length {self.seq_length} / cp {cp}) are not divisible by tp={tp}. Use "
                    "a sequence length that is a multiple of tp*cp, or sequence_parallel=False.",
                    "seq_length % (tp*cp)")
        if pp == 1 and self.virtual_pipeline_stages > 1:
            raise ModelConstraintError(
                f"virtual_pipeline_stages={self.virtual_pipeline_stages} needs pipeline "
                "parallelism (pp > 1): the chunks are interleaved over the pipeline ranks. Set "
                "virtual_pipeline_stages=1, or use pp > 1.", "virtual_pipeline_stages")
        layers = self.stage_layers(pp)
        if pp > 1 and min(layers) < 1:
            raise ModelConstraintError(
                f"num_layers={self.num_layers} cut over pp={pp} x v="
                f"{self.virtual_pipeline_stages} leaves a model stage without layers "
                f"({layers}); GPTModel needs one per stage. Use fewer stages or more layers.",
                "num_layers % pp")
        return layers

    def _check_experts(self, tp: int, ep: int, etp: int) -> None:
        """The expert-parallel rules of :meth:`check_layout` (contract C of issue 36)."""
        if not self.is_moe:
            if ep > 1 or etp not in (1, tp):
                raise ModelConstraintError(
                    f"ep={ep}, etp={etp} shard experts, but the model is dense (num_moe_experts is not set): "
                    "use ep=1 and leave etp out, or set num_moe_experts.", "num_moe_experts % ep")
            return
        experts = self.num_moe_experts
        if experts % ep:
            good = [d for d in range(1, experts + 1) if experts % d == 0]
            raise ModelConstraintError(
                f"num_moe_experts={experts} is not divisible by ep={ep}: every expert-parallel rank holds "
                f"the same number of whole experts. Use an ep that divides {experts} "
                f"({', '.join(map(str, good[:8]))}{', ...' if len(good) > 8 else ''}).", "num_moe_experts % ep")
        if self.moe_ffn_hidden_size % etp:
            raise ModelConstraintError(
                f"moe_ffn_hidden_size={self.moe_ffn_hidden_size} is not divisible by etp={etp}: expert tensor "
                f"parallelism splits each expert's width over etp. Use an etp that divides "
                f"{self.moe_ffn_hidden_size} (e.g. etp=1).", "moe_ffn_hidden_size % etp")
        shared = self.moe_shared_expert_intermediate_size
        if shared and shared % tp:
            raise ModelConstraintError(
                f"moe_shared_expert_intermediate_size={shared} is not divisible by tp={tp}: the shared experts "
                f"are split over tp like the dense MLP. Use a tp that divides {shared}.",
                "moe_shared_expert_intermediate_size % tp")
