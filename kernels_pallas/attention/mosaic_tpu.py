"""Flash attention for TPUs: Pallas Mosaic TPU, FlashAttention-2 with block-sparse causal skipping.

The block math is `base`'s; what is TPU-specific is the schedule. The key loop is the last grid
axis (``arbitrary``), so Mosaic double-buffers the K/V tiles, and the running ``m, l, acc`` live in
VMEM scratch between grid steps:

- forward and dQ, grid ``(batch, heads, query blocks, key blocks)``;
- dK/dV, grid ``(batch, kv heads, key blocks, G, query blocks)``: the ``G`` query heads that share a
  kv head and their query blocks accumulate into one dK/dV tile (no repeated K/V, no atomics).

Block-sparse causal skipping: a tile wholly above the diagonal computes nothing (`pl.when`) and its
index map repeats the last useful block index, so the pipeline issues no DMA for it either. Only tiles
that cross the diagonal or the end of the sequence build a position mask.

Layout: arrays are moved to ``(batch, heads, seq, head_dim)`` so the sequence and head dims are
the (sublane, lane) tile dims; row statistics are broadcast over the 128 lanes and key segment ids
over 8 sublanes, the layouts jax's own TPU kernels use. On hardware ``block_kv`` must be a multiple of
128 and ``block_q`` of 8; interpret mode takes any size. Not yet compiled or timed on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.attention import base

DEFAULT_BLOCK_SIZES = base.BlockSizes(
    block_q=128, block_kv=128, block_q_dq=128, block_kv_dq=128, block_q_dkv=128, block_kv_dkv=128
)
LANES, SUBLANES = 128, 8


def _interpret(spec: base.Spec):
    """``interpret=True`` means the TPU interpreter (it simulates VMEM, DMAs and poisons fresh buffers)."""
    return pltpu.InterpretParams() if spec.interpret is True else spec.interpret


def _block(requested: int, seq_len: int, multiple: int, name: str, spec: base.Spec) -> int:
    block = min(requested, base.round_up(seq_len, multiple if not spec.interpret else 1))
    if not spec.interpret and block % multiple:
        raise ValueError(f"BlockSizes.{name}={requested} must be a multiple of {multiple} on a TPU")
    return block


def _lanes(stat: jax.Array, seq: int) -> jax.Array:
    """``(batch, heads, seq)`` row statistic, padded and broadcast over the lanes: ``(..., seq, 128)``."""
    stat = base.pad_axis(stat, 2, seq)
    return jnp.broadcast_to(stat[..., None], (*stat.shape, LANES))


def _head_major(x: jax.Array, seq: int) -> jax.Array:
    return base.pad_axis(x, 1, seq).transpose(0, 2, 1, 3)


def _segment_args(segment_ids, q_len: int, kv_len: int, block_q: int, block_kv: int, q_map, kv_map):
    """Query ids broadcast over lanes ``(batch, seq, 128)``, key ids over sublanes ``(batch, 8, seq)``."""
    if segment_ids is None:
        return (), []
    q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)  # one array or a pair
    q_ids = base.pad_axis(q_ids, 1, q_len)
    kv_ids = base.pad_axis(kv_ids, 1, kv_len)
    args = (
        jnp.broadcast_to(q_ids[:, :, None], (*q_ids.shape, LANES)),
        jnp.broadcast_to(kv_ids[:, None, :], (kv_ids.shape[0], SUBLANES, kv_len)),
    )
    return args, [pl.BlockSpec((None, block_q, LANES), q_map), pl.BlockSpec((None, SUBLANES, block_kv), kv_map)]


def _tile_mask(spec, seq_len, q_start, block_q, k_start, block_kv, q_seg_ref, kv_seg_ref, masked: bool):
    return base.allowed(
        q_start, block_q, k_start, block_kv, seq_len=seq_len, causal=spec.causal, positions=masked,
        q_segments=None if q_seg_ref is None else q_seg_ref[...][:, :1],
        kv_segments=None if kv_seg_ref is None else kv_seg_ref[...][:1, :],
    )


def _tile_flags(spec: base.Spec, seq_len: int, q_start, block_q: int, k_start, block_kv: int):
    """(tile has an allowed pair at all, tile needs a position mask), as traced booleans."""
    crosses_end = (q_start + block_q > seq_len) | (k_start + block_kv > seq_len)
    if not spec.causal:
        return jnp.bool_(True), crosses_end
    return k_start <= q_start + block_q - 1, crosses_end | (k_start + block_kv - 1 > q_start)


def _last_visible_kv_block(i, block_q: int, block_kv: int):
    return jax.lax.div((i + 1) * block_q - 1, block_kv)


def _first_visible_q_block(j, block_q: int, block_kv: int):
    return jax.lax.div(j * block_kv, block_q)


def _run_tile(visible, needs_mask, step):
    """Calls ``step(masked)`` on tiles with work: masked where a position mask is needed."""
    pl.when(visible & needs_mask)(lambda: step(True))
    pl.when(visible & jnp.logical_not(needs_mask))(lambda: step(False))


def _forward_kernel(*refs, spec: base.Spec, seq_len: int, block_q: int, block_kv: int, segments: bool):
    q_ref, k_ref, v_ref, *refs = refs
    q_seg_ref, kv_seg_ref, *refs = refs if segments else (None, None, *refs)
    o_ref, lse_ref, *refs = refs
    row_max_ref = refs[0] if len(refs) == 4 else None
    m_ref, l_ref, acc_ref = refs[-3:]
    i, j = pl.program_id(2), pl.program_id(3)
    q_start, k_start = i * block_q, j * block_kv

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, base.MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(masked: bool):
        s = base.dot_nt(q_ref[...], k_ref[...]) * spec.scale2
        mask = _tile_mask(spec, seq_len, q_start, block_q, k_start, block_kv, q_seg_ref, kv_seg_ref, masked)
        carry = (m_ref[...][:, :1], l_ref[...][:, :1], acc_ref[...])
        m, l, acc = base.online_softmax_step(carry, s, v_ref[...], mask)
        m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l, l_ref.shape)
        acc_ref[...] = acc

    _run_tile(*_tile_flags(spec, seq_len, q_start, block_q, k_start, block_kv), step)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        m, l = m_ref[...], l_ref[...]
        o_ref[...] = (acc_ref[...] / l[:, :1]).astype(o_ref.dtype)
        lse_ref[...] = m + jnp.log2(l)
        if row_max_ref is not None:
            row_max_ref[...] = m / base.LOG2E


def _dq_kernel(*refs, spec: base.Spec, seq_len: int, block_q: int, block_kv: int, segments: bool):
    q_ref, k_ref, v_ref, *refs = refs
    q_seg_ref, kv_seg_ref, *refs = refs if segments else (None, None, *refs)
    do_ref, lse_ref, delta_ref, dq_ref, dq_acc_ref = refs
    i, j = pl.program_id(2), pl.program_id(3)
    q_start, k_start = i * block_q, j * block_kv

    @pl.when(j == 0)
    def _init():
        dq_acc_ref[...] = jnp.zeros(dq_acc_ref.shape, jnp.float32)

    def step(masked: bool):
        k = k_ref[...]
        mask = _tile_mask(spec, seq_len, q_start, block_q, k_start, block_kv, q_seg_ref, kv_seg_ref, masked)
        p = base.probabilities(base.dot_nt(q_ref[...], k) * spec.scale2, lse_ref[...][:, :1], mask)
        ds = p * (base.dot_nt(do_ref[...], v_ref[...]) - delta_ref[...][:, :1])
        dq_acc_ref[...] += base.dot_nn(ds.astype(k.dtype), k)

    _run_tile(*_tile_flags(spec, seq_len, q_start, block_q, k_start, block_kv), step)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_acc_ref[...] * spec.sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, spec: base.Spec, seq_len: int, block_q: int, block_kv: int, segments: bool):
    q_ref, k_ref, v_ref, *refs = refs
    q_seg_ref, kv_seg_ref, *refs = refs if segments else (None, None, *refs)
    do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc_ref, dv_acc_ref = refs
    j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    q_start, k_start = i * block_q, j * block_kv

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

    def step(masked: bool):
        q, do = q_ref[...], do_ref[...]
        mask = _tile_mask(spec, seq_len, q_start, block_q, k_start, block_kv, q_seg_ref, kv_seg_ref, masked)
        p = base.probabilities(base.dot_nt(q, k_ref[...]) * spec.scale2, lse_ref[...][:, :1], mask)
        ds = p * (base.dot_nt(do, v_ref[...]) - delta_ref[...][:, :1])
        dv_acc_ref[...] += base.dot_tn(p.astype(do.dtype), do)
        dk_acc_ref[...] += base.dot_tn(ds.astype(q.dtype), q)

    _run_tile(*_tile_flags(spec, seq_len, q_start, block_q, k_start, block_kv), step)

    @pl.when((g == pl.num_programs(3) - 1) & (i == pl.num_programs(4) - 1))
    def _finish():
        dk_ref[...] = (dk_acc_ref[...] * spec.sm_scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)


def forward(q, k, v, segment_ids, spec: base.Spec):
    """Returns ``(out, row_max or None, residuals)``; row_max ``(batch, heads, seq)`` in natural units."""
    b, t, h, d = q.shape
    kv_heads, dv = k.shape[2], v.shape[3]
    group = h // kv_heads
    sizes = spec.block_sizes.with_defaults(DEFAULT_BLOCK_SIZES)
    bq = _block(sizes.block_q, t, SUBLANES, "block_q", spec)
    bk = _block(sizes.block_kv, t, LANES, "block_kv", spec)
    tq, tk = base.round_up(t, bq), base.round_up(t, bk)

    def kv_map(bi, hi, i, j):
        return bi, hi // group, jnp.minimum(j, _last_visible_kv_block(i, bq, bk)) if spec.causal else j, 0

    q_map = lambda bi, hi, i, j: (bi, hi, i, 0)  # noqa: E731
    seg_args, seg_specs = _segment_args(
        segment_ids, tq, tk, bq, bk, lambda bi, hi, i, j: (bi, i, 0), lambda bi, hi, i, j: (bi, 0, kv_map(bi, hi, i, j)[2])
    )
    stat = jax.ShapeDtypeStruct((b, h, tq, LANES), jnp.float32)
    stat_spec = pl.BlockSpec((None, None, bq, LANES), q_map)
    out, lse, *row_max = pl.pallas_call(
        functools.partial(_forward_kernel, spec=spec, seq_len=t, block_q=bq, block_kv=bk, segments=bool(seg_args)),
        grid=(b, h, tq // bq, tk // bk),
        in_specs=[
            pl.BlockSpec((None, None, bq, d), q_map),
            pl.BlockSpec((None, None, bk, d), kv_map),
            pl.BlockSpec((None, None, bk, dv), kv_map),
            *seg_specs,
        ],
        out_specs=[pl.BlockSpec((None, None, bq, dv), q_map), stat_spec] + [stat_spec] * spec.return_row_max,
        out_shape=[jax.ShapeDtypeStruct((b, h, tq, dv), q.dtype), stat] + [stat] * spec.return_row_max,
        scratch_shapes=[
            pltpu.VMEM((bq, LANES), jnp.float32),
            pltpu.VMEM((bq, LANES), jnp.float32),
            pltpu.VMEM((bq, dv), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=(pltpu.PARALLEL,) * 3 + (pltpu.ARBITRARY,)),
        interpret=_interpret(spec),
        name="flash_attention_fwd",
    )(_head_major(q, tq), _head_major(k, tk), _head_major(v, tk), *seg_args)
    out = out[:, :, :t].transpose(0, 2, 1, 3)
    row_max = row_max[0][:, :, :t, 0] if row_max else None
    return out, row_max, (q, k, v, segment_ids, out, lse[:, :, :t, 0])


def backward(residuals, d_out, spec: base.Spec):
    """``(dq, dk, dv)`` from `forward`'s residuals and the output cotangent."""
    q, k, v, segment_ids, out, lse = residuals
    b, t, h, d = q.shape
    kv_heads, dv = k.shape[2], v.shape[3]
    group = h // kv_heads
    sizes = spec.block_sizes.with_defaults(DEFAULT_BLOCK_SIZES)
    delta = base.row_delta(out, d_out)

    # dQ: grid (batch, heads, query blocks, key blocks), key blocks past the diagonal skipped.
    bq = _block(sizes.block_q_dq, t, SUBLANES, "block_q_dq", spec)
    bk = _block(sizes.block_kv_dq, t, LANES, "block_kv_dq", spec)
    tq, tk = base.round_up(t, bq), base.round_up(t, bk)

    def kv_map(bi, hi, i, j):
        return bi, hi // group, jnp.minimum(j, _last_visible_kv_block(i, bq, bk)) if spec.causal else j, 0

    q_map = lambda bi, hi, i, j: (bi, hi, i, 0)  # noqa: E731
    seg_args, seg_specs = _segment_args(
        segment_ids, tq, tk, bq, bk, lambda bi, hi, i, j: (bi, i, 0), lambda bi, hi, i, j: (bi, 0, kv_map(bi, hi, i, j)[2])
    )
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, spec=spec, seq_len=t, block_q=bq, block_kv=bk, segments=bool(seg_args)),
        grid=(b, h, tq // bq, tk // bk),
        in_specs=[
            pl.BlockSpec((None, None, bq, d), q_map),
            pl.BlockSpec((None, None, bk, d), kv_map),
            pl.BlockSpec((None, None, bk, dv), kv_map),
            *seg_specs,
            pl.BlockSpec((None, None, bq, dv), q_map),
            pl.BlockSpec((None, None, bq, LANES), q_map),
            pl.BlockSpec((None, None, bq, LANES), q_map),
        ],
        out_specs=pl.BlockSpec((None, None, bq, d), q_map),
        out_shape=jax.ShapeDtypeStruct((b, h, tq, d), q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=(pltpu.PARALLEL,) * 3 + (pltpu.ARBITRARY,)),
        interpret=_interpret(spec),
        name="flash_attention_dq",
    )(
        _head_major(q, tq), _head_major(k, tk), _head_major(v, tk), *seg_args,
        _head_major(d_out, tq), _lanes(lse, tq), _lanes(delta, tq),
    )

    # dK, dV: grid (batch, kv heads, key blocks, group, query blocks), query blocks before the diagonal skipped.
    bq = _block(sizes.block_q_dkv, t, SUBLANES, "block_q_dkv", spec)
    bk = _block(sizes.block_kv_dkv, t, LANES, "block_kv_dkv", spec)
    tq, tk = base.round_up(t, bq), base.round_up(t, bk)

    def q_map(bi, ki, j, g, i):
        return bi, ki * group + g, jnp.maximum(i, _first_visible_q_block(j, bq, bk)) if spec.causal else i, 0

    kv_map = lambda bi, ki, j, g, i: (bi, ki, j, 0)  # noqa: E731
    seg_args, seg_specs = _segment_args(
        segment_ids, tq, tk, bq, bk, lambda bi, ki, j, g, i: (bi, q_map(bi, ki, j, g, i)[2], 0), lambda bi, ki, j, g, i: (bi, 0, j)
    )
    dk, dv_ = pl.pallas_call(
        functools.partial(_dkdv_kernel, spec=spec, seq_len=t, block_q=bq, block_kv=bk, segments=bool(seg_args)),
        grid=(b, kv_heads, tk // bk, group, tq // bq),
        in_specs=[
            pl.BlockSpec((None, None, bq, d), q_map),
            pl.BlockSpec((None, None, bk, d), kv_map),
            pl.BlockSpec((None, None, bk, dv), kv_map),
            *seg_specs,
            pl.BlockSpec((None, None, bq, dv), q_map),
            pl.BlockSpec((None, None, bq, LANES), q_map),
            pl.BlockSpec((None, None, bq, LANES), q_map),
        ],
        out_specs=[pl.BlockSpec((None, None, bk, d), kv_map), pl.BlockSpec((None, None, bk, dv), kv_map)],
        out_shape=[jax.ShapeDtypeStruct((b, kv_heads, tk, d), k.dtype), jax.ShapeDtypeStruct((b, kv_heads, tk, dv), v.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, dv), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=(pltpu.PARALLEL,) * 3 + (pltpu.ARBITRARY,) * 2),
        interpret=_interpret(spec),
        name="flash_attention_dkdv",
    )(
        _head_major(q, tq), _head_major(k, tk), _head_major(v, tk), *seg_args,
        _head_major(d_out, tq), _lanes(lse, tq), _lanes(delta, tq),
    )
    return tuple(x[:, :, :t].transpose(0, 2, 1, 3) for x in (dq, dk, dv_))
