"""Where an optimizer's state lives on a mesh, for any optimizer (`jax.jit(tx.init, out_shardings=...)`).

A state leaf that mirrors a parameter takes that parameter's sharding (`sharding.partition.state_shardings`);
stacked blocks of Shampoo / SOAP statistics are spread over every device (of a replica), as
`optim.blocking` marks them.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from optim import blocking
from sharding import partition


def state_shardings(
    tx: optax.GradientTransformation,
    abstract_params: Any,
    param_shardings: Any,
    mesh: jax.sharding.Mesh,
    replica_axis: str | None = None,
) -> Any:
    """A `jax.NamedSharding` per leaf of ``tx.init(abstract_params)`` for parameters placed as ``param_shardings``.

    ``replica_axis``: the mesh axis of a replica-local run, which no block is spread over.
    """
    abstract_state = blocking.annotate_block_shardings(jax.eval_shape(tx.init, abstract_params), mesh, replica_axis)
    return partition.state_shardings(abstract_state, abstract_params, param_shardings, mesh)
