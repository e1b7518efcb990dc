"""`gmm`: the public grouped matmul, `jax.lax.ragged_dot`'s signature, one `custom_vjp` over the kernels.

``backend`` picks the implementation: ``triton`` (GPU), ``mosaic_tpu`` (TPU) or ``xla``
(``jax.lax.ragged_dot``). The default is ``xla`` on every platform until the Pallas kernels have been
compiled and timed at or above ``ragged_dot``'s speed (docs/benchmarks.md, section 8); naming a kernel
opts in (the MoE layer's ``model.moe_matmul=auto`` does, `lm.moe`). On a CPU the kernels run in
interpret mode (the default there), which is how the tests check them; ``mosaic_tpu`` then uses the
TPU interpreter. Backward: ``dlhs`` is the forward kernel with ``rhs`` transposed in place, ``drhs``
the ``tgmm`` kernel; no gradient flows to ``group_sizes``.

`grouped_matmul` owns the MoE layer's choice (``model.moe_matmul``: ``auto``, ``ragged_dot``, ``gmm``,
``tokamax``): ``auto`` tries the platform's `MATMUL_ORDER` (the Pallas kernel where the platform compiles
one: GPU, TPU; ``ragged_dot`` elsewhere) and logs each reason for passing one over once. ``tokamax``
(`tokamax_op`, where the optional package is installed) is named only until GPU timings place it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kernels_pallas import varying
from kernels_pallas.backends import PLATFORM_BACKENDS, platform
from kernels_pallas.gmm import mosaic_tpu, reference, tokamax_op, triton
from kernels_pallas.gmm.base import Tiling

KERNELS = {"triton": triton, "mosaic_tpu": mosaic_tpu}
BACKENDS = (*KERNELS, "xla")

__all__ = ["BACKENDS", "MATMUL_ORDER", "PLATFORM_BACKENDS", "Tiling", "gmm", "grouped_matmul"]

_log = logging.getLogger(__name__)
_LOGGED: set[str] = set()


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _pallas_gmm(lhs, rhs, group_sizes, backend: str, tiling: Tiling, out_dtype, interpret):
    kernel = functools.partial(KERNELS[backend].gmm, tiling=tiling, out_dtype=out_dtype, interpret=interpret)
    return varying.call_opaque(kernel, lhs, rhs, group_sizes)


def _pallas_gmm_fwd(lhs, rhs, group_sizes, backend, tiling, out_dtype, interpret):
    return _pallas_gmm(lhs, rhs, group_sizes, backend, tiling, out_dtype, interpret), (lhs, rhs, group_sizes)


def _pallas_gmm_bwd(backend, tiling, out_dtype, interpret, residuals, dout):
    lhs, rhs, group_sizes = residuals
    dout = dout.astype(lhs.dtype)
    kernels = KERNELS[backend]
    dlhs = functools.partial(kernels.gmm, tiling=tiling, transpose_rhs=True, out_dtype=lhs.dtype, interpret=interpret)
    drhs = functools.partial(kernels.tgmm, tiling=tiling, out_dtype=rhs.dtype, interpret=interpret)
    return varying.call_opaque(dlhs, dout, rhs, group_sizes), varying.call_opaque(drhs, lhs, dout, group_sizes), None


_pallas_gmm.defvjp(_pallas_gmm_fwd, _pallas_gmm_bwd)


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
      backend: ``triton``, ``mosaic_tpu`` or ``xla`` (the default, see the module docstring).
      interpret: run the Pallas kernel in interpret mode; default: on a CPU. ``mosaic_tpu`` also takes
        a `jax.experimental.pallas.tpu.InterpretParams`.
      tiling: `Tiling` of the kernels; default: the backend's ``DEFAULT_TILING``.
    """
    reference.check_shapes(lhs, rhs, group_sizes)
    target = platform()
    if backend is None:
        backend = PLATFORM_BACKENDS.get(target, "triton") if interpret else "xla"
    if backend not in BACKENDS:
        raise ValueError(f"unknown gmm backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "xla":
        return reference.gmm(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    interpret = target == "cpu" if interpret is None else interpret
    lhs, rhs, group_sizes = varying.unify(lhs, rhs, group_sizes)
    if interpret:
        varying.check_interpretable("gmm", "use model.moe_matmul=ragged_dot on a CPU", lhs)
    return _pallas_gmm(lhs, rhs, group_sizes, backend, tiling or KERNELS[backend].DEFAULT_TILING, out_dtype, interpret)


# ---------------------------------------------------------------------------------- the choice

GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]  # (lhs, rhs, group_sizes) -> out


def _gmm_unsupported(target: str) -> str | None:
    if target not in PLATFORM_BACKENDS:
        return f"the Pallas gmm kernel does not compile for {target} (interpret mode only, for tests)"
    return None


MATMULS: dict[str, Callable[[str], str | None]] = {
    "ragged_dot": lambda target: None,
    "gmm": _gmm_unsupported,
    "tokamax": tokamax_op.unsupported,
}
# What ``auto`` tries, in order, per platform (``ragged_dot`` on one not listed); the last always serves.
MATMUL_ORDER = {target: ("gmm", "ragged_dot") for target in PLATFORM_BACKENDS}


def grouped_matmul(implementation: str) -> tuple[GroupedMatmul, bool]:
    """``(matmul, is_kernel)`` for ``model.moe_matmul`` on the target platform (`kernels_pallas.backends`).

    ``matmul`` has `jax.lax.ragged_dot`'s signature. ``is_kernel``: it is a Pallas call, which GSPMD
    cannot partition, so the caller must run it per shard. Named ``gmm`` on a CPU, the kernel runs in
    interpret mode (slow, for tests). Named ``tokamax`` where it is not installed: a ValueError naming
    the install command.
    """
    target = platform()
    if implementation == "auto":
        reasons = []
        for implementation in MATMUL_ORDER.get(target, ("ragged_dot",)):
            reason = MATMULS[implementation](target)
            if reason is None:
                break
            reasons.append(reason)
        message = "; ".join(reasons)
        if message and message not in _LOGGED:
            _LOGGED.add(message)
            _log.info("model.moe_matmul=auto chose %s: %s", implementation, message)
    if implementation == "ragged_dot":
        return jax.lax.ragged_dot, False
    if implementation == "tokamax":
        if (reason := tokamax_op.unsupported(target)) is not None:
            raise ValueError(f"{tokamax_op.WHAT}: {reason}; or use model.moe_matmul=auto")
        return tokamax_op.ragged_dot, True
    if implementation != "gmm":
        raise ValueError(f"unknown model.moe_matmul {implementation!r}; use one of auto, {', '.join(MATMULS)}")
    backend = PLATFORM_BACKENDS.get(target)
    return functools.partial(gmm, backend=backend or "triton", interpret=backend is None), True
