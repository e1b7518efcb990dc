"""Flash attention for GPUs: Pallas lowered through Triton (Ampere, Hopper), FlashAttention-2.

Arrays stay in the model's ``(batch, seq, heads, head_dim)`` layout. Three kernels, the block math
of `base`:

- forward, grid ``(query blocks, batch, heads)``: one program holds a query block and walks the
  key/value blocks of its kv head (query head ``h`` reads kv head ``h // G``, so K/V are never
  repeated), up to the causal diagonal only; writes O and the base-2 log-sum-exp.
- dQ, same grid: walks the key blocks again, ``dQ_i = sm_scale sum_j dS_ij K_j``.
- dK/dV, grid ``(key blocks, batch, kv heads)``: one program owns a key/value block and sums over
  the ``G`` query heads that share it and their query blocks from the diagonal on, so dK and dV are
  written once, without atomics and without a per-query-head copy.

Only tiles that cross the causal diagonal or the end of the sequence build a position mask
(`base.split_loop`). With a sliding window (``n`` blocks of ``window_block`` tokens: the record's
128-token block windows, or a token window; ``n`` a runtime value, so a window that grows during
training compiles once) the loops start at the first key block a query
block's window reaches (forward, dQ) and stop after the last query block that sees a key block
(dK/dV), so the work is ``O(T W)``; tiles that cross the window's edge are masked. Sequences are zero-padded to whole blocks and head dims to a power of two
(>= 16, what ``tl.dot`` takes); both copies happen only when a size is off and are masked or sliced
away. ``delta = rowsum(dO * O)`` is one fused XLA reduction.

Default tiles and warps follow the bytes of one padded head row (`default_block_sizes`): wider rows
take smaller tiles, so that every default configuration (head_dim 64, 128, 256, MLA's 192 / 128, in
bf16 and fp32, with and without segment ids or a window) compiles for sm_90a within the H100's 227 KiB
of shared memory and without register spills (``experiments/check_sm90.py``). Operands of ``2**31`` or more elements are refused: the kernels
address them with int32 offsets.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import backends
from kernels_pallas.attention import base

_MIN_BLOCK = 16  # tl.dot needs every matmul dimension >= 16
_INT32_FIX = "split the batch or the heads into smaller calls, or use model.attention=xla"


def default_block_sizes(head_dim: int, v_head_dim: int, dtype, masked: bool = False) -> base.BlockSizes:
    """The Triton defaults for padded head dims ``head_dim`` / ``v_head_dim`` and ``dtype`` (module docstring).

    Row bytes ``r = max(head_dim, v_head_dim) * itemsize``: up to 256, query / key blocks of 128 / 64
    (forward) and 64 / 64 (backward), 4 warps up to 128 bytes and 8 beyond; up to 512 (bf16 head_dim 256
    or MLA, fp32 head_dim 128), 64 / 64, 64 / 32 and 32 / 32; wider (fp32 head_dim 256 or MLA), 32
    everywhere. Two pipeline stages. ``masked`` (segment ids or a sliding window): the dK/dV kernel's
    query blocks of 32 for rows of 129-256 bytes (bf16 head_dim 128, fp32 64), whose bf16 64-row tiles sit at 255
    registers unmasked and spilled 16 / 28 bytes with the masks' extra registers (triton 3.6, sm_90a).
    """
    row = max(head_dim, v_head_dim) * jnp.dtype(dtype).itemsize
    if row <= 256:
        blocks = (128, 64, 64, 64, 32 if masked and row > 128 else 64, 64)
    elif row <= 512:
        blocks = (64, 64, 64, 32, 32, 32)
    else:
        blocks = (32,) * 6
    return base.BlockSizes(*blocks, num_warps=4 if row <= 128 else 8, num_stages=2)


def _block(requested: int, seq_len: int, name: str) -> int:
    if requested & (requested - 1):
        raise ValueError(f"BlockSizes.{name}={requested} must be a power of two for the Triton backend")
    return max(_MIN_BLOCK, min(requested, pl.next_power_of_2(seq_len)))


def _padded_dim(dim: int) -> int:
    return max(_MIN_BLOCK, pl.next_power_of_2(dim))


def _cdiv(a, b: int):
    return jax.lax.div(a + b - 1, b)


def _sizes_and_params(spec: base.Spec, dp: int, dvp: int, dtype, masked: bool = False) -> tuple[base.BlockSizes, plgpu.CompilerParams]:
    sizes = spec.block_sizes.with_defaults(default_block_sizes(dp, dvp, dtype, masked))
    return sizes, plgpu.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages)


def _query_side(
    q_seg_ref, kv_seg_ref, q_start, block_q: int, block_kv: int, spec: base.Spec, seq_len: int, num_kv_blocks: int, blocks
):
    """For a query block: the segment ids, a tile mask builder and the key-block loop bounds (``blocks``: the
    window in blocks, or None)."""
    q_seg = None if q_seg_ref is None else q_seg_ref[...][:, None]

    def mask(k_start, masked: bool):
        kv_seg = None if kv_seg_ref is None else kv_seg_ref[pl.ds(k_start, block_kv)][None, :]
        return base.allowed(
            q_start, block_q, k_start, block_kv, seq_len=seq_len, causal=spec.causal, positions=masked,
            q_segments=q_seg, kv_segments=kv_seg, window_blocks=blocks, window_block=spec.window_block,
        )

    # Key blocks wholly inside the sequence and (causal) wholly at or before the first query need no
    # position mask; blocks past the diagonal are never visited. With a window, blocks before the first
    # query's window are never visited, and those before the last query's window start are masked.
    lo = full_lo = 0
    full = seq_len // block_kv
    hi = num_kv_blocks
    if spec.causal:
        full = jnp.minimum(full, jax.lax.div(q_start + 1, block_kv))
        hi = jnp.minimum(hi, _cdiv(q_start + block_q, block_kv))
    if blocks is not None:
        lo = jax.lax.div(base.window_start(q_start, blocks, spec.window_block), block_kv)
        full_lo = _cdiv(base.window_start(q_start + block_q - 1, blocks, spec.window_block), block_kv)
    return mask, (lo, full_lo, full, hi)


def _window_ref(refs: list, spec: base.Spec) -> tuple[list, object]:
    """Splits the window's ``(1,)`` block count off ``refs`` (after q, k, v) when the call has a window."""
    return (refs[1:], refs[0][0]) if spec.window else (refs, None)


def _forward_kernel(*refs, spec: base.Spec, seq_len: int, block_q: int, block_kv: int, num_kv_blocks: int, segments: bool):
    q_ref, k_ref, v_ref, *refs = refs
    refs, blocks = _window_ref(refs, spec)
    q_seg_ref, kv_seg_ref, *outs = refs if segments else (None, None, *refs)
    o_ref, lse_ref, *row_max_ref = outs
    q_start = pl.program_id(0) * block_q
    q = q_ref[...]
    mask, bounds = _query_side(q_seg_ref, kv_seg_ref, q_start, block_q, block_kv, spec, seq_len, num_kv_blocks, blocks)

    def body(j, carry, masked):
        k_start = j * block_kv
        k, v = k_ref[pl.ds(k_start, block_kv), :], v_ref[pl.ds(k_start, block_kv), :]
        return base.online_softmax_step(carry, base.dot_nt(q, k) * spec.scale2, v, mask(k_start, masked))

    m, l, acc = base.split_loop(*bounds, body, base.initial_carry(block_q, o_ref.shape[-1]))
    o_ref[...] = (acc / l).astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log2(l))[:, 0]
    if row_max_ref:
        row_max_ref[0][...] = (m / base.LOG2E)[:, 0]


def _dq_kernel(*refs, spec: base.Spec, seq_len: int, block_q: int, block_kv: int, num_kv_blocks: int, segments: bool):
    q_ref, k_ref, v_ref, *refs = refs
    refs, blocks = _window_ref(refs, spec)
    q_seg_ref, kv_seg_ref, *refs = refs if segments else (None, None, *refs)
    do_ref, lse_ref, delta_ref, dq_ref = refs
    q_start = pl.program_id(0) * block_q
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    mask, bounds = _query_side(q_seg_ref, kv_seg_ref, q_start, block_q, block_kv, spec, seq_len, num_kv_blocks, blocks)

    def body(j, dq, masked):
        k_start = j * block_kv
        k, v = k_ref[pl.ds(k_start, block_kv), :], v_ref[pl.ds(k_start, block_kv), :]
        p = base.probabilities(base.dot_nt(q, k) * spec.scale2, lse, mask(k_start, masked))
        ds = p * (base.dot_nt(do, v) - delta)
        return dq + base.dot_nn(ds.astype(k.dtype), k)

    dq = base.split_loop(*bounds, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * spec.sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(
    *refs, spec: base.Spec, seq_len: int, block_q: int, block_kv: int, num_q_blocks: int, group: int, segments: bool
):
    q_ref, k_ref, v_ref, *refs = refs
    refs, blocks = _window_ref(refs, spec)
    q_seg_ref, kv_seg_ref, *refs = refs if segments else (None, None, *refs)
    do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    k_start = pl.program_id(0) * block_kv
    k, v = k_ref[...], v_ref[...]
    kv_seg = None if kv_seg_ref is None else kv_seg_ref[...][None, :]

    # Query blocks wholly inside the sequence and (causal) wholly at or after the last key need no
    # position mask; query blocks wholly before the first key are never visited.
    lo, full_lo = (jax.lax.div(k_start, block_q), _cdiv(k_start + block_kv - 1, block_q)) if spec.causal else (0, 0)
    full_hi, hi = seq_len // block_q, num_q_blocks
    if blocks is not None:  # query blocks past the last key's window are never visited; those past the first key's are masked
        hi = jnp.minimum(hi, _cdiv(base.window_end(k_start + block_kv - 1, blocks, spec.window_block), block_q))
        full_hi = jnp.minimum(full_hi, jax.lax.div(base.window_end(k_start, blocks, spec.window_block), block_q))

    def over_heads(g, carry):
        def body(i, carry, masked):
            dk, dv = carry
            q_start = i * block_q
            rows = pl.ds(q_start, block_q)
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            lse, delta = lse_ref[g, rows][:, None], delta_ref[g, rows][:, None]
            q_seg = None if q_seg_ref is None else q_seg_ref[rows][:, None]
            mask = base.allowed(
                q_start, block_q, k_start, block_kv, seq_len=seq_len, causal=spec.causal, positions=masked,
                q_segments=q_seg, kv_segments=kv_seg, window_blocks=blocks, window_block=spec.window_block,
            )
            p = base.probabilities(base.dot_nt(q, k) * spec.scale2, lse, mask)
            ds = p * (base.dot_nt(do, v) - delta)
            return dk + base.dot_tn(ds.astype(q.dtype), q), dv + base.dot_tn(p.astype(do.dtype), do)

        return base.split_loop(lo, full_lo, full_hi, hi, body, carry)

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    dk, dv = jax.lax.fori_loop(0, group, over_heads, zeros)
    dk_ref[...] = (dk * spec.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _segment_args(segment_ids, q_len: int, kv_len: int, q_spec: pl.BlockSpec, kv_spec: pl.BlockSpec):
    """Segment ids padded for the query and the key side, with their block specs (nothing without ids).

    ``segment_ids``: one ``(batch, seq)`` array for both sides, or a ``(query ids, key ids)`` pair.
    """
    if segment_ids is None:
        return (), []
    q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
    return (base.pad_axis(q_ids, 1, q_len), base.pad_axis(kv_ids, 1, kv_len)), [q_spec, kv_spec]


def _window_args(spec: base.Spec, blocks) -> tuple[tuple, list]:
    """The window's block count as a ``(1,)`` int32 operand in ``[1, window / window_block]`` (None: all of
    them), with its block spec; nothing without a window."""
    if not spec.window:
        return (), []
    most = spec.window // spec.window_block
    count = jnp.clip(jnp.asarray(most if blocks is None else blocks, jnp.int32), 1, most).reshape(1)
    return (count,), [pl.BlockSpec((1,), lambda *_: (0,))]


def forward(q, k, v, segment_ids, spec: base.Spec, window_blocks=None):
    """Returns ``(out, row_max or None, residuals)``; row_max ``(batch, heads, seq)`` in natural units.
    ``window_blocks``: a traced window in blocks, at most ``spec.window / spec.window_block`` (None: that)."""
    b, t, h, d = q.shape
    kv_heads, dv = k.shape[2], v.shape[3]
    dp, dvp = _padded_dim(d), _padded_dim(dv)
    sizes, params = _sizes_and_params(spec, dp, dvp, q.dtype)
    bq, bk = _block(sizes.block_q, t, "block_q"), _block(sizes.block_kv, t, "block_kv")
    tq, tk = base.round_up(t, bq), base.round_up(t, bk)
    backends.check_int32_offsets("flash_attention", _INT32_FIX, jax.ShapeDtypeStruct((b, max(tq, tk), h, max(dp, dvp)), q.dtype))
    group = h // kv_heads

    q_map = lambda i, bi, hi: (bi, i, hi, 0)  # noqa: E731
    kv_map = lambda i, bi, hi: (bi, 0, hi // group, 0)  # noqa: E731
    stat_map = lambda i, bi, hi: (bi, hi, i)  # noqa: E731
    seg_args, seg_specs = _segment_args(
        segment_ids, tq, tk, pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, i)), pl.BlockSpec((None, tk), lambda i, bi, hi: (bi, 0))
    )
    win_args, win_specs = _window_args(spec, window_blocks)
    stat = jax.ShapeDtypeStruct((b, h, tq), jnp.float32)
    out_shape = [jax.ShapeDtypeStruct((b, tq, h, dvp), q.dtype), stat] + [stat] * spec.return_row_max
    out_specs = [pl.BlockSpec((None, bq, None, dvp), q_map)] + [pl.BlockSpec((None, None, bq), stat_map)] * (
        1 + spec.return_row_max
    )
    kernel = functools.partial(
        _forward_kernel, spec=spec, seq_len=t, block_q=bq, block_kv=bk, num_kv_blocks=tk // bk, segments=bool(seg_args)
    )
    out, lse, *row_max = pl.pallas_call(
        kernel,
        grid=(tq // bq, b, h),
        in_specs=[
            pl.BlockSpec((None, bq, None, dp), q_map),
            pl.BlockSpec((None, tk, None, dp), kv_map),
            pl.BlockSpec((None, tk, None, dvp), kv_map),
            *win_specs,
            *seg_specs,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=spec.interpret,
        name="flash_attention_fwd",
    )(
        base.pad_axis(base.pad_axis(q, 1, tq), 3, dp),
        base.pad_axis(base.pad_axis(k, 1, tk), 3, dp),
        base.pad_axis(base.pad_axis(v, 1, tk), 3, dvp),
        *win_args,
        *seg_args,
    )
    out = out[:, :t, :, :dv]
    row_max = row_max[0][:, :, :t] if row_max else None
    return out, row_max, (q, k, v, segment_ids, out, lse[:, :, :t], *((window_blocks,) if spec.window else ()))


def backward(residuals, d_out, spec: base.Spec):
    """``(dq, dk, dv)`` from `forward`'s residuals and the output cotangent."""
    q, k, v, segment_ids, out, lse, *window_blocks = residuals  # the window's count only with spec.window
    win_args, win_specs = _window_args(spec, window_blocks[0] if window_blocks else None)
    b, t, h, d = q.shape
    kv_heads, dv = k.shape[2], v.shape[3]
    group = h // kv_heads
    dp, dvp = _padded_dim(d), _padded_dim(dv)
    sizes, params = _sizes_and_params(spec, dp, dvp, q.dtype, masked=segment_ids is not None or bool(spec.window))
    delta = base.row_delta(out, d_out)

    def padded(x, seq, dim):
        return base.pad_axis(base.pad_axis(x, 1, seq), 3, dim)

    # dQ: grid over (query blocks, batch, query heads), like the forward pass.
    bq, bk = _block(sizes.block_q_dq, t, "block_q_dq"), _block(sizes.block_kv_dq, t, "block_kv_dq")
    tq, tk = base.round_up(t, bq), base.round_up(t, bk)
    backends.check_int32_offsets("flash_attention", _INT32_FIX, jax.ShapeDtypeStruct((b, max(tq, tk), h, max(dp, dvp)), q.dtype))
    q_map = lambda i, bi, hi: (bi, i, hi, 0)  # noqa: E731
    kv_map = lambda i, bi, hi: (bi, 0, hi // group, 0)  # noqa: E731
    stat_map = lambda i, bi, hi: (bi, hi, i)  # noqa: E731
    seg_args, seg_specs = _segment_args(
        segment_ids, tq, tk, pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, i)), pl.BlockSpec((None, tk), lambda i, bi, hi: (bi, 0))
    )
    dq = pl.pallas_call(
        functools.partial(
            _dq_kernel, spec=spec, seq_len=t, block_q=bq, block_kv=bk, num_kv_blocks=tk // bk, segments=bool(seg_args)
        ),
        grid=(tq // bq, b, h),
        in_specs=[
            pl.BlockSpec((None, bq, None, dp), q_map),
            pl.BlockSpec((None, tk, None, dp), kv_map),
            pl.BlockSpec((None, tk, None, dvp), kv_map),
            *win_specs,
            *seg_specs,
            pl.BlockSpec((None, bq, None, dvp), q_map),
            pl.BlockSpec((None, None, bq), stat_map),
            pl.BlockSpec((None, None, bq), stat_map),
        ],
        out_specs=pl.BlockSpec((None, bq, None, dp), q_map),
        out_shape=jax.ShapeDtypeStruct((b, tq, h, dp), q.dtype),
        compiler_params=params,
        interpret=spec.interpret,
        name="flash_attention_dq",
    )(
        padded(q, tq, dp), padded(k, tk, dp), padded(v, tk, dvp), *win_args, *seg_args,
        padded(d_out, tq, dvp), base.pad_axis(lse, 2, tq), base.pad_axis(delta, 2, tq),
    )

    # dK, dV: grid over (key blocks, batch, kv heads); each program reads the whole query side of its group.
    bq, bk = _block(sizes.block_q_dkv, t, "block_q_dkv"), _block(sizes.block_kv_dkv, t, "block_kv_dkv")
    tq, tk = base.round_up(t, bq), base.round_up(t, bk)
    backends.check_int32_offsets("flash_attention", _INT32_FIX, jax.ShapeDtypeStruct((b, max(tq, tk), h, max(dp, dvp)), q.dtype))
    group_map = lambda j, bi, ki: (bi, 0, ki, 0)  # noqa: E731
    kv_map = lambda j, bi, ki: (bi, j, ki, 0)  # noqa: E731
    stat_map = lambda j, bi, ki: (bi, ki, 0)  # noqa: E731
    seg_args, seg_specs = _segment_args(
        segment_ids, tq, tk, pl.BlockSpec((None, tq), lambda j, bi, ki: (bi, 0)), pl.BlockSpec((None, bk), lambda j, bi, ki: (bi, j))
    )
    dk, dv_ = pl.pallas_call(
        functools.partial(
            _dkdv_kernel, spec=spec, seq_len=t, block_q=bq, block_kv=bk, num_q_blocks=tq // bq, group=group,
            segments=bool(seg_args),
        ),
        grid=(tk // bk, b, kv_heads),
        in_specs=[
            pl.BlockSpec((None, tq, group, dp), group_map),
            pl.BlockSpec((None, bk, None, dp), kv_map),
            pl.BlockSpec((None, bk, None, dvp), kv_map),
            *win_specs,
            *seg_specs,
            pl.BlockSpec((None, tq, group, dvp), group_map),
            pl.BlockSpec((None, group, tq), stat_map),
            pl.BlockSpec((None, group, tq), stat_map),
        ],
        out_specs=[pl.BlockSpec((None, bk, None, dp), kv_map), pl.BlockSpec((None, bk, None, dvp), kv_map)],
        out_shape=[jax.ShapeDtypeStruct((b, tk, kv_heads, dp), k.dtype), jax.ShapeDtypeStruct((b, tk, kv_heads, dvp), v.dtype)],
        compiler_params=params,
        interpret=spec.interpret,
        name="flash_attention_dkdv",
    )(
        padded(q, tq, dp), padded(k, tk, dp), padded(v, tk, dvp), *win_args, *seg_args,
        padded(d_out, tq, dvp), base.pad_axis(lse, 2, tq), base.pad_axis(delta, 2, tq),
    )
    return dq[:, :t, :, :d], dk[:, :t, :, :d], dv_[:, :t, :, :dv]
