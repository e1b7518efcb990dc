"""`lightning_attention`: the public op, one `custom_vjp` over the XLA form and the Pallas kernels.

``implementation`` picks what runs: ``xla`` (`reference`, a scan over blocks), ``pallas`` (the platform's
kernel: ``triton`` on GPU, ``mosaic_tpu`` on TPU; on a CPU the Triton kernel in interpret mode, for
tests) or ``auto``: the platform's order in `ORDER`. Until the kernels have been compiled and timed on a
GPU and a TPU, ``auto`` is ``xla`` everywhere (docs/benchmarks.md, the lightning row); naming ``pallas``
opts in. Whatever runs, the backward pass is the explicit Lightning Attention-2 one: it keeps q, k, v
and the initial state, never a per-block state (`kernels_pallas.lightning.reference`).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from kernels_pallas import backends, varying
from kernels_pallas.lightning import base, mosaic_tpu, reference, triton

IMPLEMENTATIONS = ("auto", "xla", "pallas")
KERNELS = {"xla": reference, "triton": triton, "mosaic_tpu": mosaic_tpu}
# What ``auto`` runs per platform (``xla`` where none is listed).
ORDER: dict[str, str] = {}
DEFAULT_BLOCK = 64

_log = logging.getLogger(__name__)


def _functions(backend: str, interpret):
    module = KERNELS[backend]
    if backend == "xla":
        return module.forward, module.backward
    return (functools.partial(module.forward, interpret=interpret), functools.partial(module.backward, interpret=interpret))


def _run(backend: str, fn, *args):
    """``fn(*args)``; a Pallas kernel out of reach of an enclosing `jax.shard_map`'s type check (`varying`)."""
    return fn(*args) if backend == "xla" else varying.call_opaque(fn, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _blocked(q, k, v, runs, r_prev, r_last, n_valid, block, backend, interpret, slopes, state):
    fwd, _ = _functions(backend, interpret)
    return _run(backend, lambda *a: fwd(base.Blocked(*a[:7]), *a[7:], block=block), q, k, v, runs, r_prev, r_last, n_valid, slopes, state)


def _blocked_fwd(q, k, v, runs, r_prev, r_last, n_valid, block, backend, interpret, slopes, state):
    out = _blocked(q, k, v, runs, r_prev, r_last, n_valid, block, backend, interpret, slopes, state)
    return out, (q, k, v, runs, r_prev, r_last, n_valid, slopes, state)


def _blocked_bwd(block, backend, interpret, residuals, cotangents):
    q, k, v, runs, r_prev, r_last, n_valid, slopes, state = residuals
    d_out, d_state = cotangents
    _, bwd = _functions(backend, interpret)
    d_out, d_state = varying.vary_like((d_out.astype(v.dtype), d_state.astype(jnp.float32)), q, state)
    dq, dk, dv, d_state0 = _run(
        backend, lambda *a: bwd(base.Blocked(*a[:7]), *a[7:], block=block), q, k, v, runs, r_prev, r_last, n_valid, slopes, state,
        d_out, d_state,
    )  # fmt: skip
    d_slopes, d_state0 = varying.vary_like((jnp.zeros_like(slopes), d_state0), slopes, state)  # typed like the inputs
    return dq, dk, dv, None, None, None, None, d_slopes, d_state0


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def backend_for(implementation: str) -> tuple[str, bool]:
    """``(backend, interpret)`` for ``implementation`` on the target platform (`kernels_pallas.backends`)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown lightning attention implementation {implementation!r}; use one of {', '.join(IMPLEMENTATIONS)}")
    target = backends.platform()
    if implementation == "auto":
        implementation = ORDER.get(target, "xla")
    if implementation == "xla":
        return "xla", False
    backend = backends.PLATFORM_BACKENDS.get(target)
    if backend is None:
        _log.info("lightning attention: no Pallas backend compiles for %s; the Triton kernel runs in interpret mode", target)
    return backend or "triton", backend is None


def lightning_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slopes: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    state: jax.Array | None = None,
    block: int = DEFAULT_BLOCK,
    implementation: str = "auto",
    backend: str | None = None,
    interpret=None,
) -> tuple[jax.Array, jax.Array]:
    """Causal linear attention with per-head decay, ``o_t = q_t S_t``, ``S_t = lambda S_{t-1} + k_t^T v_t``.

    Args:
      q, k: ``(batch, seq, heads, d)``; v: ``(batch, seq, heads, d_v)``.
      slopes: ``(heads,)`` float decay rates ``s``, ``lambda = exp(-s)``.
      segment_ids: ``(batch, seq)`` or None; the state resets where the id changes (a new document).
      state: ``(batch, heads, d, d_v)`` float32 state before the first token (decoding), or None (zeros).
      block: tokens per block ``B`` (the intra-block part is ``B x B``).
      implementation: ``auto``, ``xla`` or ``pallas`` (module docstring); ``backend`` names a kernel
        (``triton``, ``mosaic_tpu``, ``xla``) outright, ``interpret`` runs it in Pallas interpret mode.

    Returns:
      ``(out (batch, seq, heads, d_v) in q's dtype, final state (batch, heads, d, d_v) float32)``, both
      differentiable (in q, k, v and the initial state; the slopes are constants and get zero).
    """
    base.check_shapes(q, k, v, slopes, state)
    if block < 1:
        raise ValueError(f"lightning attention: block={block} must be >= 1")
    if backend is None:
        backend, auto_interpret = backend_for(implementation)
        interpret = auto_interpret if interpret is None else interpret
    elif backend not in KERNELS:
        raise ValueError(f"unknown lightning attention backend {backend!r}; use one of {', '.join(KERNELS)}")
    if interpret is None:
        interpret = backends.platform() == "cpu"
    if backend == "mosaic_tpu" and interpret is True:
        interpret = mosaic_tpu.interpret_params()
    batch, seq, heads = q.shape[:3]
    if state is None:
        state = jnp.zeros((batch, heads, q.shape[3], v.shape[3]), jnp.float32)
    blk = base.to_blocks(q, k, v, segment_ids, block)
    # one set of manual axes for all (inside the replica-local step's shard_map: the scans' carries vary like q)
    *blk, slopes, state = varying.unify(*blk, slopes.astype(jnp.float32), state.astype(jnp.float32))
    if interpret and backend != "xla":
        varying.check_interpretable("lightning_attention", "leave model.attention at auto or xla on a CPU", q)
    out, final = _blocked(*blk, block, backend, interpret, slopes, state)
    return base.from_blocks(out, seq), final
