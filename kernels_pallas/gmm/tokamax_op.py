"""tokamax's grouped matmul (`tokamax.ragged_dot`) as an implementation of ``model.moe_matmul``.

tokamax (openxla/tokamax, ``pip install spmdlab[tokamax]``; read at 0.0.12) has `jax.lax.ragged_dot`'s
signature and picks its own kernel: with ``implementation=None`` its `api.ragged_dot_general` tries
``mosaic`` (Mosaic GPU on sm90 / sm100; Mosaic TPU from v5), then ``triton`` (its Pallas Triton kernel,
any GPU), then ``xla`` (``jax.lax.ragged_dot``'s own lowering, any platform), taking the first whose trace
raises no ``NotImplementedError``; each kernel brings its backward (dlhs a grouped matmul with ``rhs``
transposed, drhs the transposed grouped matmul, as in `reference`). Rows past ``sum(group_sizes)`` come
out 0, as in `reference.gmm`. Its kernels are Pallas calls GSPMD cannot partition, so the MoE layer runs
it per shard (`lm.moe`), as it runs our kernel.
"""

from __future__ import annotations

import jax

from kernels_pallas import extras
from kernels_pallas.gmm import reference

WHAT = "model.moe_matmul=tokamax"


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, preferred_element_type=None) -> jax.Array:
    """``(m, n)`` grouped product ``out[i] = lhs[i] @ rhs[g(i)]`` by tokamax's choice of kernel."""
    tokamax = extras.tokamax(WHAT)
    reference.check_shapes(lhs, rhs, group_sizes)
    return tokamax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


def unsupported(target: str) -> str | None:
    """Why tokamax cannot serve the grouped matmul on platform ``target`` (None when it can): its dispatch
    ends in XLA, which serves every platform, so only a missing package refuses."""
    del target
    return extras.tokamax_missing()
