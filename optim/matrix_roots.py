"""Inverse p-th roots of batched symmetric PSD matrices, with failure detection (for Shampoo).

For a batch ``A`` of shape ``(n, b, b)`` and an integer ``p`` both methods return
``X ~= (A + r I)^(-1/p)`` with the ridge ``r = ridge_epsilon * max(lambda_max(A), 1e-16)``
(relative to the largest eigenvalue, as in distributed Shampoo, arXiv:2002.09018; ``"newton"``
estimates it by power iteration) and a per-matrix error, so a caller can reject bad roots with `accepted`:

- ``"eigh"``: ``A = V diag(lambda) V^T``, ``X = V diag((max(lambda, 0) + r)^(-1/p)) V^T``.
  Error: the relative backward error of the decomposition, ``max|V diag(lambda) V^T - A| / lambda_max``.
- ``"newton"``: the coupled Newton iteration (Guo & Higham 2006; the ``matrix_inverse_pth_root`` of
  google-research/scalable_shampoo): with ``z = (1 + p) / (2 ||A + r I||_F)``,
  ``M_0 = z (A + r I)``, ``H_0 = z^(1/p) I``,
  ``T_k = ((p + 1) I - M_k) / p``, ``M_{k+1} = T_k^p M_k``, ``H_{k+1} = H_k T_k``, so
  ``H_k -> (A + r I)^(-1/p)`` while ``M_k = H_k^p (A + r I) -> I``. A matrix stops iterating when
  ``max|M_k - I| <= tolerance`` or when a step would grow that error by more than 1.2x (the step is
  then discarded). Error: ``max|M_k - I|``.

Every matmul runs at ``Precision.HIGHEST`` and in float32 at least.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from optim import blocking

HIGHEST = jax.lax.Precision.HIGHEST
METHODS = ("eigh", "newton")
_FLOOR = 1e-16


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=HIGHEST)


def _max_abs(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x), axis=(-2, -1))


def matrix_power(x: jax.Array, p: int) -> jax.Array:
    """``x^p`` for a static integer ``p >= 1`` by repeated squaring (batched)."""
    result = None
    base = x
    while True:
        if p & 1:
            result = base if result is None else _mm(result, base)
        p >>= 1
        if not p:
            return result
        base = _mm(base, base)


def max_eigenvalue(mats: jax.Array, num_iters: int = 32) -> jax.Array:
    """Largest eigenvalue of each symmetric PSD matrix by power iteration (batched)."""
    b = mats.shape[-1]
    v = jnp.broadcast_to(jax.random.normal(jax.random.key(0), (b,), mats.dtype), mats.shape[:-1])

    def step(_, v):
        w = jnp.einsum("...ij,...j->...i", mats, v, precision=HIGHEST)
        return w / jnp.maximum(jnp.linalg.norm(w, axis=-1, keepdims=True), 1e-30)

    v = jax.lax.fori_loop(0, num_iters, step, v / jnp.linalg.norm(v, axis=-1, keepdims=True))
    return jnp.einsum("...i,...ij,...j->...", v, mats, v, precision=HIGHEST)


def lapack_map(fn: Callable[[jax.Array], Any], mats: jax.Array) -> Any:
    """``fn(mats)`` for a LAPACK-backed batched ``fn`` (eigh, qr) on a ``(n, b, b)`` block stack.

    On CPU the stack is walked one matrix per device at a time (`lax.map` over the local blocks):
    jaxlib's batched LAPACK kernels split a batch over XLA's intra-op thread pool and block until
    it is done, which deadlocks when several such calls (other groups, other devices) hold every
    pool thread (jax 0.10). Other platforms run ``fn`` batched.
    """

    def per_matrix(x):
        _, size = blocking.mesh_axes()
        n = x.shape[0]
        k = size if n % size == 0 else 1
        out = jax.lax.map(fn, jnp.swapaxes(x.reshape(k, n // k, *x.shape[1:]), 0, 1))
        return jax.tree.map(lambda o: jnp.swapaxes(o, 0, 1).reshape(n, *o.shape[2:]), out)

    return jax.lax.platform_dependent(mats, cpu=per_matrix, default=fn)


def lapack_each(fn: Callable[[jax.Array], Any], x: jax.Array) -> Any:
    """``fn(x)`` for a LAPACK-backed batched ``fn`` (svd, qr, eigh) on ``(*batch, m, n)`` matrices.

    On CPU one matrix at a time (`lax.map` over the batch), for the deadlock `lapack_map` avoids, here
    for stacks whose batch axes are not spread over the devices (a layer stack: every device would
    run the whole batch in one call). Other platforms, and a single matrix, run ``fn`` directly.
    """
    if x.ndim == 2:
        return fn(x)

    def per_matrix(x):
        out = jax.lax.map(fn, x.reshape(-1, *x.shape[-2:]))
        return jax.tree.map(lambda o: o.reshape(*x.shape[:-2], *o.shape[1:]), out)

    return jax.lax.platform_dependent(x, cpu=per_matrix, default=fn)


def inverse_pth_root_eigh(mats: jax.Array, p: int, ridge_epsilon: float = 1e-6) -> tuple[jax.Array, jax.Array]:
    """``(A + r I)^(-1/p)`` by symmetric eigendecomposition; returns (roots, errors)."""
    mats = 0.5 * (mats + jnp.swapaxes(mats, -1, -2))
    lam, vecs = lapack_map(jnp.linalg.eigh, mats)
    top = jnp.maximum(lam[..., -1], _FLOOR)
    damped = jnp.maximum(lam, 0.0) + (ridge_epsilon * top)[..., None]
    roots = _mm(vecs * (damped ** (-1.0 / p))[..., None, :], jnp.swapaxes(vecs, -1, -2))
    rebuilt = _mm(vecs * lam[..., None, :], jnp.swapaxes(vecs, -1, -2))
    return roots, _max_abs(rebuilt - mats) / top


def inverse_pth_root_newton(
    mats: jax.Array,
    p: int,
    ridge_epsilon: float = 1e-6,
    max_iters: int = 100,
    tolerance: float = 1e-6,
) -> tuple[jax.Array, jax.Array]:
    """``(A + r I)^(-1/p)`` by the coupled Newton iteration; returns (roots, errors)."""
    b = mats.shape[-1]
    eye = jnp.eye(b, dtype=mats.dtype)
    ridge = ridge_epsilon * jnp.maximum(max_eigenvalue(mats), _FLOOR)
    damped = mats + ridge[..., None, None] * eye
    z = (1.0 + p) / (2.0 * jnp.linalg.norm(damped, axis=(-2, -1)))
    m = damped * z[..., None, None]
    h = eye * (z ** (1.0 / p))[..., None, None]
    err = _max_abs(m - eye)
    active = err > tolerance

    def cond(carry):
        i, _, _, _, active = carry
        return (i < max_iters) & jnp.any(active)

    def body(carry):
        i, m, h, err, active = carry
        t = ((p + 1.0) * eye - m) / p
        m_new = _mm(matrix_power(t, p), m)
        h_new = _mm(h, t)
        err_new = _max_abs(m_new - eye)
        take = active & (err_new < 1.2 * err)
        sel = take[..., None, None]
        m = jnp.where(sel, m_new, m)
        h = jnp.where(sel, h_new, h)
        err = jnp.where(take, err_new, err)
        return i + 1, m, h, err, take & (err_new > tolerance)

    _, _, h, err, _ = jax.lax.while_loop(cond, body, (0, m, h, err, active))
    return h, err


def inverse_pth_root(
    mats: jax.Array,
    p: int,
    *,
    method: str = "eigh",
    ridge_epsilon: float = 1e-6,
    newton_iters: int = 100,
) -> tuple[jax.Array, jax.Array]:
    """Batched ``(A + r I)^(-1/p)`` by ``method`` (``"eigh"`` or ``"newton"``); returns (roots, errors).

    Computes in float32 (or the input's precision if higher).
    """
    if method not in METHODS:
        raise ValueError(f"unknown root method {method!r}; use one of {METHODS}")
    if p < 1:
        raise ValueError(f"root exponent p={p} must be a positive integer")
    mats = mats.astype(jnp.promote_types(mats.dtype, jnp.float32))
    if method == "eigh":
        return inverse_pth_root_eigh(mats, p, ridge_epsilon)
    return inverse_pth_root_newton(mats, p, ridge_epsilon, max_iters=newton_iters)


def accepted(roots: jax.Array, errors: jax.Array, threshold: float) -> jax.Array:
    """Per matrix: the root is finite and its error is at most ``threshold``."""
    finite = jnp.all(jnp.isfinite(roots), axis=(-2, -1))
    return finite & jnp.isfinite(errors) & (errors <= threshold)
