"""Update rules on fp32 tensors: AdamW, Adam (L2 decay) and SGD with momentum.

Each rule updates its state Parameters with ``ops.assign`` and returns the new weight;
they run eagerly and compile (``mindspore.jit``, GRAPH_MODE) unchanged. The arithmetic
follows ``torch.optim.AdamW`` / ``Adam`` / ``SGD`` (dampening 0, no Nesterov):

* AdamW: ``p *= 1 - lr*wd``; ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``;
  ``p -= lr / (1-b1^t) * m / (sqrt(v) / sqrt(1-b2^t) + eps)``.
* Adam: the same with ``g += wd * p`` instead of the decoupled decay.
* SGD: ``g += wd * p``; ``buf = momentum * buf + g`` (no buffer when momentum is 0);
  ``p -= lr * buf``.

``t`` is the step number starting at 1. Padding rows of a shard have weight 0 and
gradient 0, so every rule keeps them 0 (the moments stay 0 and ``0 / (0 + eps) = 0``).
"""

from __future__ import annotations

from mindspore import ops


def adam(p, g, m, v, lr, beta1, beta2, eps, wd, bc1, bc2_sqrt, decoupled):
    """One Adam(W) step of weight ``p``; ``bc1 = 1 - b1^t``, ``bc2_sqrt = sqrt(1 - b2^t)``."""
    if decoupled:
        p = p * (1.0 - lr * wd)
    else:
        g = g + wd * p
    m_new = beta1 * m + (1.0 - beta1) * g
    v_new = beta2 * v + (1.0 - beta2) * (g * g)
    m_new = ops.depend(m_new, ops.assign(m, m_new))
    v_new = ops.depend(v_new, ops.assign(v, v_new))
    denom = ops.sqrt(v_new) / bc2_sqrt + eps
    return p - (lr / bc1) * m_new / denom


def sgd(p, g, buf, lr, momentum, wd, has_momentum):
    """One SGD step of weight ``p`` (``buf`` unused when ``has_momentum`` is False)."""
    g = g + wd * p
    if has_momentum:
        g = momentum * buf + g
        g = ops.depend(g, ops.assign(buf, g))
    return p - lr * g
