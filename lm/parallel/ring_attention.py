"""Ring attention over the ``context`` axis, forward and a hand-written backward (`jax.custom_vjp`).

Runs inside the `jax.shard_map` of `lm.parallel.context_attention`, on zig-zag shards: device ``i`` of ``C``
holds chunks ``i`` (half 0) and ``2C-1-i`` (half 1) of ``2C``. Keys and values travel as *sources*
that ``expand(*params, *sources) -> (k, v)`` turns into keys and values per token (GQA: k and v
themselves; MLA: the latent and the RoPE key, `lm.parallel.context_attention.Compressed`).

Forward. Hop 0 attends the local block causally (within a zig-zag shard index order is position
order). On hop ``t = 1 .. C-1`` the sources of device ``j = (i - t) mod C`` have arrived from the
left neighbour (`jax.lax.ppermute`, sent before the hop's compute so the two can overlap) and every
block left is unmasked: for ``j < i`` both query halves see key half 0 (chunk ``j``); for ``j > i``
query half 1 sees both key halves. Each is a square ``S/2 x S/2`` block (so the Pallas kernels
serve), and the partial results merge by their log-sum-exp (`kernels_pallas.attention.partial`).
Only the merged output and lse are saved.

Backward. The saved ``(out, lse)`` make every block's probabilities final, so each block's dQ, dK,
dV are exact parts of the whole. The sources go around the ring once more; on each hop a device
turns its blocks' dK, dV into cotangents of the arriving sources (``expand``'s VJP) and adds them
to an accumulator that travels with them (dK/dV travel back around the ring, in source form: MLA's
latent size). After hop ``C-1`` one more ppermute brings every accumulator home. dQ and the
parameters' cotangents stay local (`jax.shard_map` sums the latter over devices).

The same hops serve all-gather attention (``transport="all_gather"``): hop ``t``'s sources are sliced
out of one all-gather instead of arriving by ppermute, and the sources' cotangents accumulate in a
whole-sequence buffer that one reduce-scatter brings home.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from kernels_pallas.attention import partial, reference


def _halves(x, axis: int = 1):
    if x is None:
        return None, None
    half = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, half, axis=axis), jax.lax.slice_in_dim(x, half, None, axis=axis)


def _cat(a, b):
    """Two query halves' results, ``(out, lse, row_max)`` or gradients, along the sequence."""
    return tuple(jnp.concatenate([x, y], axis=2 if x.ndim == 3 else 1) for x, y in zip(a, b, strict=True))


def _nothing(like: partial.Result) -> partial.Result:
    """The result of query rows that see no key: zero output, lse and row max ``-inf``."""
    out, lse, row_max = like
    return jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf), jnp.full_like(row_max, -jnp.inf)


def _hop_forward(block, q, k, v, q_seg, k_seg, past: jax.Array) -> partial.Result:
    """The partial result of the local queries over one arrived (non-local) key block (module docstring)."""
    (q0, q1), (k0, k1), (v0, v1) = _halves(q), _halves(k), _halves(v)
    (s0, s1), (ks0, ks1) = _halves(q_seg), _halves(k_seg)
    late_early = block(q1, k0, v0, s1, ks0)  # chunk 2C-1-i over the earlier key chunk: on every hop

    def from_the_past():
        return _cat(block(q0, k0, v0, s0, ks0), late_early)

    def from_the_future():
        return _cat(_nothing(late_early), partial.merge(late_early, block(q1, k1, v1, s1, ks1)))

    return jax.lax.cond(past, from_the_past, from_the_future)


def _hop_backward(block_grads, q, k, v, q_seg, k_seg, out, lse, d_out, past: jax.Array):
    """``(dq, dk, dv)`` of `_hop_forward`'s blocks, from the merged ``out`` and ``lse``."""
    (q0, q1), (k0, k1), (v0, v1) = _halves(q), _halves(k), _halves(v)
    (s0, s1), (ks0, ks1) = _halves(q_seg), _halves(k_seg)
    (o0, o1), (l0, l1), (d0, d1) = _halves(out), _halves(lse, 2), _halves(d_out)
    dq1, dk0, dv0 = block_grads(q1, k0, v0, s1, ks0, o1, l1, d1)

    def from_the_past():
        dq0, dk0_, dv0_ = block_grads(q0, k0, v0, s0, ks0, o0, l0, d0)
        return _cat((dq0, dk0 + dk0_, dv0 + dv0_), (dq1, jnp.zeros_like(dk0), jnp.zeros_like(dv0)))

    def from_the_future():
        dq1_, dk1, dv1 = block_grads(q1, k1, v1, s1, ks1, o1, l1, d1)
        return _cat((jnp.zeros_like(dq1), dk0, dv0), (dq1 + dq1_, dk1, dv1))

    return jax.lax.cond(past, from_the_past, from_the_future)


class _Ring:
    """Hop ``t``'s sources arrive from the left neighbour; their gradients travel with them and come home."""

    def __init__(self, axes):
        shards = jax.lax.axis_size(axes)
        self._axes, self._step = axes, [(i, (i + 1) % shards) for i in range(shards)]

    def _send(self, tree):
        return jax.tree.map(lambda x: jax.lax.ppermute(x, self._axes, self._step), tree)

    def first(self, tree):
        return self._send(tree)

    def at(self, state, t):
        return state

    def next(self, state):
        return self._send(state)

    def grads_start(self, d_local):
        return self._send(d_local)

    def grads_add(self, acc, d_t, t):
        return self._send(jax.tree.map(jnp.add, acc, d_t))  # after the hop's compute: it carries this hop's part

    def grads_home(self, acc):
        return acc


class _Gathered:
    """Every source is all-gathered once; hop ``t`` slices device ``(i - t) mod C``'s block out of it.

    The gradients of the blocks accumulate in a whole-sequence buffer that one reduce-scatter brings
    home (the transpose of the all-gather).
    """

    def __init__(self, axes):
        self._axes, self._shards = axes, jax.lax.axis_size(axes)

    def _index(self):
        return jax.lax.axis_index(self._axes)  # traced where it is used: `ring`'s custom_vjp closes over no tracer

    def _block(self, t):
        return (self._index() - t) % self._shards

    def first(self, tree):
        return jax.tree.map(lambda x: jax.lax.all_gather(x, self._axes, axis=1, tiled=True), tree)

    def at(self, state, t):
        size = lambda x: x.shape[1] // self._shards  # noqa: E731
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, self._block(t) * size(x), size(x), axis=1), state)

    def next(self, state):
        return state

    def _add(self, acc, d, block):
        def one(a, x):
            here = jax.lax.dynamic_slice_in_dim(a, block * x.shape[1], x.shape[1], axis=1)
            return jax.lax.dynamic_update_slice_in_dim(a, here + x, block * x.shape[1], axis=1)

        return jax.tree.map(one, acc, d)

    def grads_start(self, d_local):
        zeros = jax.tree.map(lambda x: jnp.zeros((x.shape[0], x.shape[1] * self._shards, *x.shape[2:]), x.dtype), d_local)
        return self._add(zeros, d_local, self._index())

    def grads_add(self, acc, d_t, t):
        return self._add(acc, d_t, self._block(t))

    def grads_home(self, acc):
        return jax.tree.map(lambda x: jax.lax.psum_scatter(x, self._axes, scatter_dimension=1, tiled=True), acc)


TRANSPORTS = {"ring": _Ring, "all_gather": _Gathered}


def ring(
    q: jax.Array,
    sources: tuple[jax.Array, ...],
    params: tuple[jax.Array, ...],
    segment_ids: jax.Array | None,
    *,
    axes: tuple[str, ...],
    past: np.ndarray,
    expand: Callable[..., tuple[jax.Array, jax.Array]],
    transport: str = "ring",
    implementation: str = "xla",
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of this shard's queries over every shard's keys, hop by hop: ``(out, row_max)``.

    Args:
      q: ``(batch, S, heads, head_dim)``, this device's zig-zag shard (``S`` even).
      sources: this shard's key/value sources, each ``(batch, S, ...)``.
      params: what ``expand`` reads beside the sources (differentiable, replicated over ``axes``).
      segment_ids: ``(batch, S)`` int or None.
      axes: the mesh axes of the ring (inside `jax.shard_map`).
      past: ``(C, C)`` bool, ``[i, t]``: on hop ``t`` device ``i`` holds an earlier chunk pair
        (`lm.parallel.context_attention.ring_schedule`'s ``[:, :, 0, 0]``).
      expand: ``expand(*params, *sources) -> (k, v)``, per token.
      transport: how hop ``t`` gets device ``(i - t) mod C``'s sources: ``ring`` (`jax.lax.ppermute`
        from the left neighbour, gradients sent back around the ring) or ``all_gather`` (sliced out of
        one all-gather, gradients home by one reduce-scatter; the backward gathers again rather than
        keep the whole sequence's sources per layer).
      implementation: ``xla`` or ``pallas`` blocks (`kernels_pallas.attention.partial`).
      interpret: run the Pallas kernels in interpret mode (CPU).

    Returns:
      out ``(batch, S, heads, v_head_dim)`` float32; row_max ``(batch, heads, S)`` (a statistic, no gradient).
    """
    shards = jax.lax.axis_size(axes)
    past_here = jnp.asarray(past)[jax.lax.axis_index(axes)]  # an argument of `run`: custom_vjp closes over no tracer
    move = TRANSPORTS[transport](axes)
    options = {"implementation": implementation, "interpret": interpret}
    block = lambda causal: lambda q, k, v, qs, ks: partial.forward(q, k, v, qs, ks, causal=causal, **options)  # noqa: E731
    grads = lambda causal: lambda *a: partial.backward(*a, causal=causal, **options)  # noqa: E731

    def keys(params, sources):
        return expand(*params, *sources)

    def forward(q, sources, params, seg, past):
        k, v = keys(params, sources)
        result = block(True)(q, k, v, seg, seg)

        def hop(t, carry):
            result, state = carry
            src_t, seg_t = move.at(state, t)
            upcoming = move.next(state)  # independent of this hop's compute: a transfer can overlap it
            return partial.merge(result, _hop_forward(block(False), q, *keys(params, src_t), seg, seg_t, past[t])), upcoming

        result, state = jax.lax.fori_loop(1, shards - 1, hop, (result, move.first((sources, seg))))
        src_t, seg_t = move.at(state, shards - 1)
        return partial.merge(result, _hop_forward(block(False), q, *keys(params, src_t), seg, seg_t, past[shards - 1]))

    @jax.custom_vjp
    def run(q, sources, params, seg, past):
        out, _, row_max = forward(q, sources, params, seg, past)
        return out, row_max

    def run_fwd(q, sources, params, seg, past):
        out, lse, row_max = forward(q, sources, params, seg, past)
        out, lse = (checkpoint_name(x, reference.RESIDUAL_NAME) for x in (out, lse))  # what remat policies keep (`lm.remat`)
        return (out, row_max), (q, sources, params, seg, past, out, lse)

    def run_bwd(residuals, cotangents):
        q, sources, params, seg, past, out, lse = residuals
        d_out = cotangents[0]
        f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731

        def source_grads(src, dk, dv):
            (k, v), vjp = jax.vjp(keys, params, src)
            return f32(vjp((dk.astype(k.dtype), dv.astype(v.dtype))))

        k, v = keys(params, sources)
        dq, dk, dv = grads(True)(q, k, v, seg, seg, out, lse, d_out)
        d_params, d_src = source_grads(sources, dk, dv)

        def hop(t, carry, last: bool = False):
            dq, d_params, state, d_acc = carry
            src_t, seg_t = move.at(state, t)
            upcoming = state if last else move.next(state)
            k_t, v_t = keys(params, src_t)
            dq_t, dk_t, dv_t = _hop_backward(grads(False), q, k_t, v_t, seg, seg_t, out, lse, d_out, past[t])
            dp_t, ds_t = source_grads(src_t, dk_t, dv_t)
            return dq + dq_t, jax.tree.map(jnp.add, d_params, dp_t), upcoming, move.grads_add(d_acc, ds_t, t)

        carry = (dq, d_params, move.first((sources, seg)), move.grads_start(d_src))
        carry = jax.lax.fori_loop(1, shards - 1, hop, carry)
        dq, d_params, _, d_acc = hop(shards - 1, carry, last=True)
        cast = lambda grads, like: jax.tree.map(lambda g, x: g.astype(x.dtype), grads, like)  # noqa: E731
        return dq.astype(q.dtype), cast(move.grads_home(d_acc), sources), cast(d_params, params), None, None

    run.defvjp(run_fwd, run_bwd)
    out, row_max = run(q, tuple(sources), tuple(params), segment_ids, past_here)
    return out, jax.lax.stop_gradient(row_max)
