"""`gmm`: the public grouped matmul, `jax.lax.ragged_dot`'s signature, one `custom_vjp` over the kernels.

``backend`` picks the implementation: ``triton`` (ours) or ``xla`` (``jax.lax.ragged_dot``). The default
is ``xla`` on every platform until the Triton kernels have been compiled and timed on a GPU at or above
``ragged_dot``'s speed (docs/benchmarks.md, section 6); ``backend="triton"`` opts in. ``mosaic_tpu`` is
not written yet. On a CPU the Triton kernels run in interpret mode (the default there when
``backend="triton"``), which is how the tests check them. Backward: ``dlhs`` is the
forward kernel with ``rhs`` transposed in place, ``drhs`` the ``tgmm`` kernel; no gradient flows to
``group_sizes``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.attention.api import platform
from kernels_pallas.gmm import reference, triton
from kernels_pallas.gmm.triton import Tiling

BACKENDS = ("triton", "xla")
# The Pallas kernel each platform compiles; a platform not listed (CPU) runs one only in interpret mode.
PLATFORM_BACKENDS = {"gpu": "triton", "cuda": "triton", "rocm": "triton"}

__all__ = ["BACKENDS", "PLATFORM_BACKENDS", "Tiling", "gmm"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _triton_gmm(lhs, rhs, group_sizes, tiling: Tiling, out_dtype, interpret: bool):
    return triton.gmm(lhs, rhs, group_sizes, tiling=tiling, out_dtype=out_dtype, interpret=interpret)


def _triton_gmm_fwd(lhs, rhs, group_sizes, tiling, out_dtype, interpret):
    return _triton_gmm(lhs, rhs, group_sizes, tiling, out_dtype, interpret), (lhs, rhs, group_sizes)


def _triton_gmm_bwd(tiling, out_dtype, interpret, residuals, dout):
    lhs, rhs, group_sizes = residuals
    dout = dout.astype(lhs.dtype)
    dlhs = triton.gmm(dout, rhs, group_sizes, tiling=tiling, transpose_rhs=True, out_dtype=lhs.dtype, interpret=interpret)
    drhs = triton.tgmm(lhs, dout, group_sizes, tiling=tiling, out_dtype=rhs.dtype, interpret=interpret)
    return dlhs, drhs, None


_triton_gmm.defvjp(_triton_gmm_fwd, _triton_gmm_bwd)


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type=None,
    *,
    backend: str | None = None,
    interpret: bool | None = None,
    tiling: Tiling | None = None,
) -> jax.Array:
    """Grouped matmul ``out[i] = lhs[i] @ rhs[g(i)]`` (see `reference`), differentiable in lhs and rhs.

    Args:
      lhs: ``(m, k)``, rows sorted by group.
      rhs: ``(G, k, n)``.
      group_sizes: ``(G,)`` integers summing to at most ``m``; rows past the sum come out 0.
      preferred_element_type: output dtype; default lhs's.
      backend: ``triton`` or ``xla`` (the default, see the module docstring).
      interpret: run the Pallas kernel in interpret mode; default: on a CPU.
      tiling: `Tiling` of the Triton kernels.
    """
    reference.check_shapes(lhs, rhs, group_sizes)
    target = platform()
    if backend is None:
        backend = "triton" if interpret else "xla"
    if backend not in BACKENDS:
        raise ValueError(f"unknown gmm backend {backend!r}; use one of {', '.join(BACKENDS)} (mosaic_tpu is not written yet)")
    if backend == "xla":
        return reference.gmm(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    interpret = target == "cpu" if interpret is None else interpret
    return _triton_gmm(lhs, rhs, group_sizes, tiling or Tiling(), out_dtype, interpret)
