"""Lightning attention for TPUs: Pallas Mosaic kernels, grid ``(batch, heads, blocks)`` with the state in VMEM.

The block axis is the innermost, sequential ("arbitrary") grid axis: each step loads one ``(B, d)``
block of q, k, v, computes its output from the ``d x d_v`` float32 state held in a VMEM scratch
(`kernels_pallas.lightning.base.forward_block`) and updates it; the first step loads the initial
state, the last writes the final one into its output block, which stays resident across the sweep.
The per-block scalars (the runs before and at the end of each block, its real tokens) and the decay
rates are prefetched into scalar memory. Backward: the dQ kernel sweeps forward like the forward
kernel; the dK, dV kernel sweeps the blocks in reverse (its index maps read block ``n - 1 - j``)
carrying dS, and writes the initial state's gradient at the end. A compiled TPU kernel wants ``B`` a
multiple of 8 and ``d`` of 128; the tests run it in TPU interpret mode on CPU. Not yet compiled or
timed on a TPU.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.lightning import base


def interpret_params() -> pltpu.InterpretParams:
    """The TPU interpreter (simulates VMEM and the DMAs; fresh buffers poisoned with NaN)."""
    return pltpu.InterpretParams(uninitialized_memory="nan")


def _decays(b, h, j, scalars, rcol_ref, rrow_ref) -> base.Decays:
    r_prev_ref, r_last_ref, n_valid_ref, slopes_ref = scalars
    return base.decays(slopes_ref[h], n_valid_ref[j], rcol_ref[...], rrow_ref[...], r_prev_ref[b, j], r_last_ref[b, j])


def _forward_kernel(*refs):
    scalars, (q_ref, k_ref, v_ref, rcol_ref, rrow_ref, state_ref, out_ref, final_ref, s_ref) = refs[:4], refs[4:]
    b, h, j, last = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.num_programs(2) - 1

    @pl.when(j == 0)
    def _():
        s_ref[...] = state_ref[...]

    out, s_ref[...] = base.forward_block(q_ref[...], k_ref[...], v_ref[...], s_ref[...], _decays(b, h, j, scalars, rcol_ref, rrow_ref))
    out_ref[...] = out.astype(out_ref.dtype)

    @pl.when(j == last)
    def _():
        final_ref[...] = s_ref[...]


def _dq_kernel(*refs):
    scalars, (q_ref, k_ref, v_ref, rcol_ref, rrow_ref, do_ref, state_ref, dq_ref, s_ref) = refs[:4], refs[4:]
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(j == 0)
    def _():
        s_ref[...] = state_ref[...]

    decays = _decays(b, h, j, scalars, rcol_ref, rrow_ref)
    dq, s_ref[...] = base.dq_block(q_ref[...], k_ref[...], v_ref[...], do_ref[...], s_ref[...], decays)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(*refs):
    scalars, (q_ref, k_ref, v_ref, rcol_ref, rrow_ref, do_ref, ds_ref, dk_ref, dv_ref, ds0_ref, acc_ref) = refs[:4], refs[4:]
    b, h, last = pl.program_id(0), pl.program_id(1), pl.num_programs(2) - 1
    j = last - pl.program_id(2)

    @pl.when(j == last)
    def _():
        acc_ref[...] = ds_ref[...]

    decays = _decays(b, h, j, scalars, rcol_ref, rrow_ref)
    dk, dv, acc_ref[...] = base.dkv_block(q_ref[...], k_ref[...], v_ref[...], do_ref[...], acc_ref[...], decays)
    dk_ref[...], dv_ref[...] = dk.astype(dk_ref.dtype), dv.astype(dv_ref.dtype)

    @pl.when(j == 0)
    def _():
        ds0_ref[...] = acc_ref[...]


def _call(kernel, blk: base.Blocked, slopes, per_block, whole, outs, *, block: int, reverse: bool, interpret, name: str):
    """``kernel`` over grid ``(batch, heads, blocks)``: ``per_block`` arrays ``(batch, heads, T_pad, w)`` are cut
    into blocks, ``whole`` ``(batch, heads, d, d_v)`` arrays (states) are read whole; ``outs`` likewise by shape."""
    batch, heads, t_pad, d = blk.q.shape
    n = t_pad // block
    at = (lambda j: n - 1 - j) if reverse else (lambda j: j)

    def tile(width):
        return pl.BlockSpec((None, None, block, width), lambda b, h, j, *_: (b, h, at(j), 0))

    def state_spec(shape):
        return pl.BlockSpec((None, None, *shape[2:]), lambda b, h, j, *_: (b, h, 0, 0))

    runs = blk.runs
    in_specs = [
        *(tile(x.shape[3]) for x in (blk.q, blk.k, blk.v)),
        pl.BlockSpec((None, block, 1), lambda b, h, j, *_: (b, at(j), 0)),
        pl.BlockSpec((None, 1, block), lambda b, h, j, *_: (b, 0, at(j))),
        *(tile(x.shape[3]) if x.shape[2] == t_pad else state_spec(x.shape) for x in (*per_block, *whole)),
    ]
    out_specs = [tile(o.shape[3]) if o.shape[2] == t_pad else state_spec(o.shape) for o in outs]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(batch, heads, n),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((d, blk.v.shape[3]), jax.numpy.float32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=outs,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name=name,
    )(blk.r_prev, blk.r_last, blk.n_valid, slopes, blk.q, blk.k, blk.v, runs[:, :, None], runs[:, None, :], *per_block, *whole)


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def forward(blk: base.Blocked, slopes, state, *, block: int, interpret=False):
    """`kernels_pallas.lightning.reference.forward` as a Pallas Mosaic TPU kernel."""
    outs = [jax.ShapeDtypeStruct((*blk.q.shape[:3], blk.v.shape[3]), blk.q.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)]
    return tuple(_call(_forward_kernel, blk, slopes, (), (state,), outs, block=block, reverse=False, interpret=interpret, name="lightning_fwd"))


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def backward(blk: base.Blocked, slopes, state, d_out, d_state, *, block: int, interpret=False):
    """`kernels_pallas.lightning.reference.backward` as two Pallas Mosaic TPU kernels (dQ; dK, dV, dS0)."""
    dq_out = [jax.ShapeDtypeStruct(blk.q.shape, blk.q.dtype)]
    (dq,) = _call(_dq_kernel, blk, slopes, (d_out,), (state,), dq_out, block=block, reverse=False, interpret=interpret, name="lightning_dq")
    outs = [jax.ShapeDtypeStruct(blk.k.shape, blk.k.dtype), jax.ShapeDtypeStruct(blk.v.shape, blk.v.dtype), jax.ShapeDtypeStruct(d_state.shape, d_state.dtype)]
    dk, dv, d_state0 = _call(_dkv_kernel, blk, slopes, (d_out,), (d_state,), outs, block=block, reverse=True, interpret=interpret, name="lightning_dkv")
    return dq, dk, dv, d_state0
