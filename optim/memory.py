"""How much memory an optimizer state takes.

`state_bytes` counts the exact bytes of any state pytree (arrays, `jax.ShapeDtypeStruct`s from
`jax.eval_shape`, NumPy arrays or Python scalars), so ``state_bytes(jax.eval_shape(tx.init, params))``
costs nothing. Quantized states (`optim.quantize_state`) are pytrees of ``uint8`` codes and fp32
scales, so they are counted like any other state.

Where state leaves live on a mesh (including quantization scales, factored second moments and
4-bit packed codes) is decided by `sharding.partition.state_shardings`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

_FOUR_BIT = {"int4", "uint4", "float4_e2m1fn"}


def state_bytes(state: Any) -> int:
    """The exact number of bytes held by the leaves of ``state`` (global, not per device).

    4-bit dtypes count half a byte per element, rounded up per leaf.
    """
    total = 0
    for leaf in jax.tree.leaves(state):
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            leaf = np.asarray(leaf)
            shape, dtype = leaf.shape, leaf.dtype
        size = int(np.prod(shape, dtype=np.int64))
        total += -(-size // 2) if np.dtype(dtype).name in _FOUR_BIT else size * np.dtype(dtype).itemsize
    return total
