"""What the lightning-attention implementations share: the layout, the runs, and the math of one block.

Notation for one head with decay rate ``s`` (``lambda = exp(-s)``). The sequence is cut into blocks of
``B`` tokens; in block ``t`` with queries ``Q``, keys ``K``, values ``V`` (``B x d``) and the state
``S`` (``d x d_v``, the decayed ``sum_j k_j^T v_j`` of the earlier blocks):

    O      = [(Q K^T) * M] V  +  diag(a) Q S                          (intra-block + inter-block)
    S'     = g S  +  (diag(b) K)^T V
    M_ij   = lambda^(i - j) [i >= j] [r_i = r_j],   a_i = lambda^(i + 1) [r_i = r_prev]
    b_j    = lambda^(B - 1 - j) [r_j = r_last],     g   = lambda^B [r_last = r_prev]

``r`` are *run ids* (`runs`): the index of the document a token belongs to, counted from the
boundaries, so a document boundary resets the state; ``r_prev`` is the run of the token before the
block (the block's own first token for block 0, so a given initial state continues), ``r_last`` the
run of the block's last token. Padding past the sequence decays nothing (its exponents stop at the
last real token) and adds nothing (its keys and values are zero), so the final state is exact.

Backward (Lightning Attention-2, arXiv:2401.04658, Algorithm 2), with ``dS`` the gradient of the state
after the block, swept from the last block to the first:

    dQ = [(dO V^T) * M] K + diag(a) dO S^T          (needs S: a forward sweep)
    dK = [(dO V^T) * M]^T Q + diag(b) V dS^T,   dV = [(Q K^T) * M]^T dO + diag(b) K dS
    dS_before = g dS + (diag(a) Q)^T dO

Each function here works on one block of one (batch, head) as 2-D arrays; the XLA reference vmaps them
and scans over blocks, the Pallas kernels call them inside their loops.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas.attention.base import dot_nn, dot_nt, dot_tn


class Decays(NamedTuple):
    """The block's masks and decays (`module docstring`): ``m (B, B)``, ``a, b (B, 1)``, ``g`` a scalar."""

    m: jax.Array
    a: jax.Array
    b: jax.Array
    g: jax.Array


def decays(slope, n_valid, runs_col: jax.Array, runs_row: jax.Array, r_prev, r_last) -> Decays:
    """`Decays` of a block whose first ``n_valid`` tokens are real, with runs ``(B, 1)`` and ``(1, B)``.

    The decay exponent of token ``i`` is ``c_i = s min(i + 1, n_valid)`` (inclusive prefix within the block),
    so ``lambda^(i - j) = exp(c_j - c_i)`` and padding stops the clock.
    """
    block = runs_col.shape[0]
    slope = jnp.asarray(slope, jnp.float32)
    i = jax.lax.broadcasted_iota(jnp.int32, (block, block), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (block, block), 1)
    col = jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
    c_col = slope * jnp.minimum(col + 1, n_valid).astype(jnp.float32)
    c_i = slope * jnp.minimum(i + 1, n_valid).astype(jnp.float32)
    c_j = slope * jnp.minimum(j + 1, n_valid).astype(jnp.float32)
    total = slope * jnp.asarray(n_valid, jnp.float32)
    visible = (i >= j) & (runs_col == runs_row)
    m = jnp.exp(jnp.where(visible, c_j - c_i, -jnp.inf))
    a = jnp.where(runs_col == r_prev, jnp.exp(-c_col), 0.0)
    b = jnp.where(runs_col == r_last, jnp.exp(c_col - total), 0.0)
    g = jnp.where(r_last == r_prev, jnp.exp(-total), 0.0)
    return Decays(m, a, b, g)


def forward_block(q, k, v, state: jax.Array, d: Decays) -> tuple[jax.Array, jax.Array]:
    """``(O, S')`` of one block, float32."""
    out = dot_nn((dot_nt(q, k) * d.m).astype(v.dtype), v) + d.a * dot_nn(q, state.astype(q.dtype))
    return out, d.g * state + dot_tn((k * d.b).astype(k.dtype), v)


def dq_block(q, k, v, do, state: jax.Array, d: Decays) -> tuple[jax.Array, jax.Array]:
    """``(dQ, S')`` of one block (the forward sweep of the backward pass), float32."""
    del q
    dq = dot_nn((dot_nt(do, v) * d.m).astype(k.dtype), k) + d.a * dot_nt(do, state.astype(do.dtype))
    return dq, d.g * state + dot_tn((k * d.b).astype(k.dtype), v)


def dkv_block(q, k, v, do, dstate: jax.Array, d: Decays) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dK, dV, dS_before)`` of one block given ``dS`` after it (the reverse sweep), float32."""
    low = dstate.astype(k.dtype)
    dk = dot_tn((dot_nt(do, v) * d.m).astype(q.dtype), q) + d.b * dot_nt(v, low)
    dv = dot_tn((dot_nt(q, k) * d.m).astype(do.dtype), do) + d.b * dot_nn(k, low)
    return dk, dv, d.g * dstate + dot_tn((q * d.a).astype(q.dtype), do)


def runs(segment_ids: jax.Array | None, batch: int, seq: int) -> jax.Array:
    """Run ids ``(batch, seq)`` int32: 0 at the start, +1 at every change of segment id (a document boundary)."""
    if segment_ids is None:
        return jnp.zeros((batch, seq), jnp.int32)
    changes = jnp.concatenate([jnp.zeros((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return jnp.cumsum(changes, axis=1, dtype=jnp.int32)


class Blocked(NamedTuple):
    """Operands in the kernels' layout: ``q, k, v (batch, heads, T_pad, d)``, runs ``(batch, T_pad)``
    (edge-padded), ``r_prev, r_last (batch, n_blocks)``, and ``n_valid (n_blocks,)`` real tokens per block."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    runs: jax.Array
    r_prev: jax.Array
    r_last: jax.Array
    n_valid: jax.Array


def to_blocks(q, k, v, segment_ids: jax.Array | None, block: int) -> Blocked:
    """``(batch, seq, heads, d)`` operands transposed to heads-major and zero-padded to whole blocks."""
    batch, seq = q.shape[:2]
    pad = -seq % block
    n_blocks = (seq + pad) // block

    def heads_major(x):
        return jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, pad), (0, 0)))

    r = jnp.pad(runs(segment_ids, batch, seq), ((0, 0), (0, pad)), mode="edge")
    ends = r[:, block - 1 :: block]
    r_prev = jnp.concatenate([r[:, :1], ends[:, :-1]], axis=1)
    n_valid = jnp.clip(seq - block * jnp.arange(n_blocks, dtype=jnp.int32), 0, block)
    return Blocked(heads_major(q), heads_major(k), heads_major(v), r, r_prev, ends, n_valid)


def from_blocks(x: jax.Array, seq: int) -> jax.Array:
    """``(batch, heads, T_pad, d)`` back to ``(batch, seq, heads, d)``."""
    return jnp.swapaxes(x[:, :, :seq], 1, 2)


def check_shapes(q, k, v, slopes, state) -> None:
    """A ValueError naming the fix when the operands do not fit together."""
    if q.ndim != 4 or q.shape != k.shape or q.shape[:3] != v.shape[:3]:
        raise ValueError(f"lightning attention: q {q.shape}, k {k.shape} must match and v {v.shape} share (batch, seq, heads)")
    if slopes.shape != (q.shape[2],):
        raise ValueError(f"lightning attention: slopes {slopes.shape} must hold one decay rate per head ({q.shape[2]},)")
    want = (q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    if state is not None and state.shape != want:
        raise ValueError(f"lightning attention: the state {state.shape} must be (batch, heads, d, d_v) = {want}")
