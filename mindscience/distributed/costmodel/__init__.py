"""Memory and communication estimates of a parallel layout for a model (no MindSpore import).

It sits next to :mod:`~mindscience.distributed.topology` at the bottom of the tree and
reads group placement (which groups span nodes) from it. Modules, in reading order:

* :mod:`.spec` — the model, training and cluster descriptions and their YAML sections
  (:mod:`.moe_spec`: the mixture-of-experts keys' checks; :mod:`.values`: single-value checks);
* :mod:`.constraints` — the divisibility rules a layout must meet for a model;
* :mod:`.params` — parameters per layer, pipeline rank and ZeRO shard (the structure ``GPTModel`` builds);
* :mod:`.memory` — bytes per rank and pipeline stage (ZeRO stages 0-3, activations);
* :mod:`.comm` — bytes each rank sends per step and group, and the time they take;
* :mod:`.steptime` — the step time of the busiest stage;
* :mod:`.runtime` — what the library runs for a training (the pipeline runtime's re-run
  forward, the gradient reduction after the backward) and the notes saying so;
* :mod:`.report` — both for one layout (``msdist plan --model``);
* :mod:`.search` — every layout of a world, ranked (``msdist suggest``).

Formulas and their sources: docs/COST_MODEL.md.

    >>> from mindscience.distributed.topology import Layout
    >>> from mindscience.distributed.costmodel import ModelSpec, Workload, estimate
    >>> m = ModelSpec(num_layers=8, hidden_size=512, num_attention_heads=8,
    ...               seq_length=1024, vocab_size=32000)
    >>> estimate(Layout(world_size=8, tp=2, pp=2), Workload(model=m))["communication"]["bottleneck"]
    'tp'
"""

from .constraints import check, violations
from .errors import ModelConstraintError, ModelError, ModelFileError
from .report import estimate
from .memory import bytes_per_parameter, layer_activation_bytes, stage_parameters, stage_rows, total_parameters
from .params import model_stage_layers, rank_layers, stage_counts
from .runtime import Runtime, what_runs
from .search import suggest
from .spec import ClusterSpec, ModelSpec, TrainingSpec, Workload, load_workload, workload_from_mapping

__all__ = [
    "ClusterSpec",
    "ModelConstraintError",
    "ModelError",
    "ModelFileError",
    "ModelSpec",
    "Runtime",
    "TrainingSpec",
    "Workload",
    "bytes_per_parameter",
    "check",
    "estimate",
    "layer_activation_bytes",
    "load_workload",
    "model_stage_layers",
    "rank_layers",
    "stage_counts",
    "stage_parameters",
    "stage_rows",
    "suggest",
    "total_parameters",
    "violations",
    "what_runs",
    "workload_from_mapping",
]
