"""Lightning attention for GPUs: Pallas Triton kernels, one program per (batch, head) sweeping its blocks.

Forward: a loop over the blocks carries the ``d x d_v`` float32 state in registers, writes each block's
output and finally the state (`kernels_pallas.lightning.base.forward_block`). Backward: one kernel
sweeps forward for dQ (`base.dq_block`), one sweeps backward carrying dS for dK, dV and the gradient
of the initial state (`base.dkv_block`), as Lightning Attention-2's Algorithm 2 does. Operands are
whole arrays addressed by `pl.ds` (the sequence need not be a power of two; ``block`` and the head
widths must be, at least 16 for ``tl.dot``). Tested in interpret mode against the XLA form; not yet
compiled or timed on a GPU.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from kernels_pallas.lightning import base


def _block_operands(b, h, t, block, q_ref, k_ref, v_ref, runs_ref, r_prev_ref, r_last_ref, n_valid_ref, slope):
    rows = pl.ds(t * block, block)
    q, k, v = q_ref[b, h, rows, :], k_ref[b, h, rows, :], v_ref[b, h, rows, :]
    r = runs_ref[b, rows]
    decays = base.decays(slope, n_valid_ref[t], r[:, None], r[None, :], r_prev_ref[b, t], r_last_ref[b, t])
    return rows, q, k, v, decays


def _forward_kernel(q_ref, k_ref, v_ref, runs_ref, r_prev_ref, r_last_ref, n_valid_ref, slopes_ref, state_ref, out_ref, final_ref, *, block, n_blocks):
    b, h = pl.program_id(0), pl.program_id(1)
    refs = (q_ref, k_ref, v_ref, runs_ref, r_prev_ref, r_last_ref, n_valid_ref, slopes_ref[h])

    def body(t, s):
        rows, q, k, v, decays = _block_operands(b, h, t, block, *refs)
        o, s = base.forward_block(q, k, v, s, decays)
        out_ref[b, h, rows, :] = o.astype(out_ref.dtype)
        return s

    final_ref[b, h, :, :] = jax.lax.fori_loop(0, n_blocks, body, state_ref[b, h, :, :])


def _dq_kernel(q_ref, k_ref, v_ref, runs_ref, r_prev_ref, r_last_ref, n_valid_ref, slopes_ref, state_ref, do_ref, dq_ref, *, block, n_blocks):
    b, h = pl.program_id(0), pl.program_id(1)
    refs = (q_ref, k_ref, v_ref, runs_ref, r_prev_ref, r_last_ref, n_valid_ref, slopes_ref[h])

    def body(t, s):
        rows, q, k, v, decays = _block_operands(b, h, t, block, *refs)
        dq, s = base.dq_block(q, k, v, do_ref[b, h, rows, :], s, decays)
        dq_ref[b, h, rows, :] = dq.astype(dq_ref.dtype)
        return s

    jax.lax.fori_loop(0, n_blocks, body, state_ref[b, h, :, :])


def _dkv_kernel(q_ref, k_ref, v_ref, runs_ref, r_prev_ref, r_last_ref, n_valid_ref, slopes_ref, do_ref, ds_ref, dk_ref, dv_ref, ds0_ref, *, block, n_blocks):
    b, h = pl.program_id(0), pl.program_id(1)
    refs = (q_ref, k_ref, v_ref, runs_ref, r_prev_ref, r_last_ref, n_valid_ref, slopes_ref[h])

    def body(i, ds):
        rows, q, k, v, decays = _block_operands(b, h, n_blocks - 1 - i, block, *refs)
        dk, dv, ds = base.dkv_block(q, k, v, do_ref[b, h, rows, :], ds, decays)
        dk_ref[b, h, rows, :] = dk.astype(dk_ref.dtype)
        dv_ref[b, h, rows, :] = dv.astype(dv_ref.dtype)
        return ds

    ds0_ref[b, h, :, :] = jax.lax.fori_loop(0, n_blocks, body, ds_ref[b, h, :, :])


def _call(kernel, blk: base.Blocked, outs, *args, block: int, interpret, name: str):
    batch, heads, t_pad = blk.q.shape[:3]
    return pl.pallas_call(
        functools.partial(kernel, block=block, n_blocks=t_pad // block),
        out_shape=outs,
        grid=(batch, heads),
        interpret=interpret,
        name=name,
    )(*blk, *args)


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def forward(blk: base.Blocked, slopes, state, *, block: int, interpret=False):
    """`kernels_pallas.lightning.reference.forward` as a Pallas Triton kernel."""
    outs = (jax.ShapeDtypeStruct((*blk.q.shape[:3], blk.v.shape[3]), blk.q.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype))
    return _call(_forward_kernel, blk, outs, slopes, state, block=block, interpret=interpret, name="lightning_fwd")


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def backward(blk: base.Blocked, slopes, state, d_out, d_state, *, block: int, interpret=False):
    """`kernels_pallas.lightning.reference.backward` as two Pallas Triton kernels (dQ; dK, dV, dS0)."""
    dq = _call(_dq_kernel, blk, jax.ShapeDtypeStruct(blk.q.shape, blk.q.dtype), slopes, state, d_out, block=block, interpret=interpret, name="lightning_dq")
    outs = (jax.ShapeDtypeStruct(blk.k.shape, blk.k.dtype), jax.ShapeDtypeStruct(blk.v.shape, blk.v.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype))
    dk, dv, d_state0 = _call(_dkv_kernel, blk, outs, slopes, d_out, d_state, block=block, interpret=interpret, name="lightning_dkv")
    return dq, dk, dv, d_state0
