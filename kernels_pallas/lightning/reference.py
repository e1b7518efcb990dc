"""Lightning attention in plain XLA: the blocked form (`kernels_pallas.lightning.base`), the definition of correct.

Per (batch, head) a `jax.lax.scan` over blocks carries the ``d x d_v`` state: `forward` the outputs
and the final state, `backward` the explicit Lightning Attention-2 gradients (a forward sweep for dQ,
a reverse sweep of dS for dK and dV) from q, k, v alone, so the op's `custom_vjp` keeps no per-block
state: memory O(T d + d^2) per head and work O(T B d + T d^2).

Sources: Qin et al., "Lightning Attention-2" (arXiv:2401.04658), OpenNLPLab/lightning-attention;
MiniMax-01 (arXiv:2501.08313) and its modeling code (MiniMax-AI/MiniMax-01).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.lightning import base

_HEAD = (0, 0, 0, None, None, None, None, 0, 0)  # vmapped over heads: q, k, v, (runs...), slope, state
_BATCH = (0, 0, 0, 0, 0, 0, None, None, 0)


def _per_block(x: jax.Array, block: int) -> jax.Array:
    return x.reshape(x.shape[0] // block, block, *x.shape[1:])


def _decays(slope, runs, r_prev, r_last, n_valid):
    return base.decays(slope, n_valid, runs[:, None], runs[None, :], r_prev, r_last)


def _head_forward(q, k, v, runs, r_prev, r_last, n_valid, slope, state, *, block):
    def step(s, xs):
        qb, kb, vb, rb, rp, rl, nv = xs
        o, s = base.forward_block(qb, kb, vb, s, _decays(slope, rb, rp, rl, nv))
        return s, o.astype(q.dtype)

    blocks = tuple(_per_block(x, block) for x in (q, k, v, runs))
    state, out = jax.lax.scan(step, state, (*blocks, r_prev, r_last, n_valid))
    return out.reshape(q.shape[0], v.shape[1]), state


def _head_backward(q, k, v, do, runs, r_prev, r_last, n_valid, slope, state, dstate, *, block):
    xs = (*(_per_block(x, block) for x in (q, k, v, do, runs)), r_prev, r_last, n_valid)

    def dq_step(s, xs):
        qb, kb, vb, dob, rb, rp, rl, nv = xs
        dq, s = base.dq_block(qb, kb, vb, dob, s, _decays(slope, rb, rp, rl, nv))
        return s, dq.astype(q.dtype)

    def dkv_step(ds, xs):
        qb, kb, vb, dob, rb, rp, rl, nv = xs
        dk, dv, ds = base.dkv_block(qb, kb, vb, dob, ds, _decays(slope, rb, rp, rl, nv))
        return ds, (dk.astype(k.dtype), dv.astype(v.dtype))

    _, dq = jax.lax.scan(dq_step, state, xs)
    dstate0, (dk, dv) = jax.lax.scan(dkv_step, dstate, xs, reverse=True)
    flat = lambda x: x.reshape(-1, x.shape[-1])
    return flat(dq), flat(dk), flat(dv), dstate0


def forward(blk: base.Blocked, slopes: jax.Array, state: jax.Array, *, block: int) -> tuple[jax.Array, jax.Array]:
    """``(out (batch, heads, T_pad, d_v), final state (batch, heads, d, d_v) float32)`` of blocked operands."""
    def head(*args):
        return _head_forward(*args, block=block)

    fn = jax.vmap(jax.vmap(head, in_axes=_HEAD), in_axes=_BATCH)
    return fn(blk.q, blk.k, blk.v, blk.runs, blk.r_prev, blk.r_last, blk.n_valid, slopes, state)


def backward(blk: base.Blocked, slopes, state, d_out, d_state, *, block: int):
    """``(dq, dk, dv, d_state0)`` given the cotangents of `forward`'s outputs."""
    def head(q, k, v, runs, r_prev, r_last, n_valid, slope, state, do, ds):
        return _head_backward(q, k, v, do, runs, r_prev, r_last, n_valid, slope, state, ds, block=block)

    fn = jax.vmap(jax.vmap(head, in_axes=(*_HEAD, 0, 0)), in_axes=(*_BATCH, 0, 0))
    return fn(blk.q, blk.k, blk.v, blk.runs, blk.r_prev, blk.r_last, blk.n_valid, slopes, state, d_out, d_state)


def lightning_attention(q, k, v, slopes, *, segment_ids=None, state=None, block: int = 64):
    """Differentiable by jax's autodiff of the scans (what the explicit `backward` is checked against)."""
    base.check_shapes(q, k, v, slopes, state)
    seq = q.shape[1]
    if state is None:
        state = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), jnp.float32)
    out, final = forward(base.to_blocks(q, k, v, segment_ids, block), slopes, state, block=block)
    return base.from_blocks(out, seq), final
