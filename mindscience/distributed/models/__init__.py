"""Reference models that run at every layout: ``TransformerConfig`` and ``GPTModel``.

    from mindscience.distributed.models import TransformerConfig, GPTModel
    cfg = TransformerConfig.from_model_spec("tiny-gpt")     # or a YAML path, or keywords
    model = GPTModel(cfg)                                   # this rank's part of the model
    loss, grads = model.forward_backward(input_ids, labels, num_microbatches=4)

``TransformerConfig`` (:mod:`.config`) is pure Python; ``GPTModel`` (:mod:`.gpt`, with
its blocks in :mod:`.layers` and its weights in :mod:`.weights`) loads MindSpore on first
use.
"""

import importlib

from .config import TransformerConfig

__all__ = ["TransformerConfig", "GPTModel", "sequence_rows"]

_LAZY = {"GPTModel": "gpt", "sequence_rows": "gpt"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
