"""What every flash-attention backend shares: block sizes, the static call spec, and the block math.

FlashAttention-2 (Dao, arXiv:2307.08691). Logits are kept in base 2, ``s = log2(e) * sm_scale *
q k^T``, so every exponential is an ``exp2``. For one block of ``B_q`` query rows, the key/value
blocks ``j = 1..N`` are visited in order, carrying the running row max ``m``, row sum ``l`` and
unnormalised output ``acc`` (the online softmax, Alg. 1)::

    m_j   = max(m_{j-1}, rowmax(S_j))
    P_j   = exp2(S_j - m_j)
    l_j   = exp2(m_{j-1} - m_j) l_{j-1} + rowsum(P_j)
    acc_j = exp2(m_{j-1} - m_j) acc_{j-1} + P_j V_j
    O = acc_N / l_N,   lse = m_N + log2(l_N)       (lse saved for the backward pass)

Backward (Alg. 2), with ``delta_i = sum_d dO_id O_id`` and the probabilities recomputed from lse::

    P_ij  = exp2(S_ij - lse_i)
    dV_j  = sum_i P_ij dO_i
    dP_ij = dO_i . V_j
    dS_ij = P_ij (dP_ij - delta_i)
    dQ_i  = sm_scale sum_j dS_ij K_j,   dK_j = sm_scale sum_i dS_ij Q_i

Masked logits take a large *finite* negative value, so a block row with no allowed key gives
``exp2(0) = 1`` instead of ``inf - inf``; the first allowed key of a later block rescales that row's
garbage by ``exp2(MASK - m) = 0``. Every real query sees at least itself, so nothing survives.
Sequences are padded to whole blocks by the backends; pairs with a position ``>= seq_len`` are
masked, so a ragged length is exact (unlike jax issues #27224 and #23819).

A sliding window of ``n`` blocks of ``B`` tokens (`kernels_pallas.attention.window`; ``n`` may be a
traced count, at most the static ``W / B`` of `Spec.window`) adds ``i // B - j // B < n`` to the causal
mask; key positions ``[window_start(i), i]`` are then the ones query ``i`` sees, so a backend visits
only the key blocks that meet that range.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LOG2E = math.log2(math.e)
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (rows of queries / keys per program) for the forward and the two backward kernels.

    ``None`` takes the backend's default. A block larger than the padded sequence is shrunk to it.
    ``num_warps`` / ``num_stages`` tune the Triton backend only.
    """

    block_q: int | None = None
    block_kv: int | None = None
    block_q_dq: int | None = None
    block_kv_dq: int | None = None
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"BlockSizes.{field.name}={value!r} must be a positive int or None")

    def with_defaults(self, defaults: BlockSizes) -> BlockSizes:
        return BlockSizes(**{
            f.name: getattr(defaults, f.name) if getattr(self, f.name) is None else getattr(self, f.name)
            for f in dataclasses.fields(self)
        })


@dataclasses.dataclass(frozen=True)
class Spec:
    """The static part of one flash-attention call (hashable: a `custom_vjp` non-diff argument)."""

    causal: bool
    sm_scale: float
    block_sizes: BlockSizes
    interpret: Any  # False, True, or a backend's interpret parameters
    return_row_max: bool
    window: int = 0  # sliding window in tokens (causal only), the most a traced window may reach; 0: none
    window_block: int = 1  # the window's granularity in tokens (`kernels_pallas.attention.window`)

    @property
    def scale2(self) -> float:
        """Multiplies ``q k^T`` into base-2 logits."""
        return self.sm_scale * LOG2E


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pads ``x`` along ``axis`` to ``size`` (no copy when it already has that size)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def row_delta(out: jax.Array, d_out: jax.Array) -> jax.Array:
    """``delta_i = sum_d dO_id O_id`` in float32, ``(batch, heads, seq)`` from ``(batch, seq, heads, d)``."""
    return jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), d_out.astype(jnp.float32))


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b.T`` with a float32 result."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_tn(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a.T @ b`` with a float32 result."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` with a float32 result."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def window_start(q_pos: Any, blocks: Any, block: int) -> Any:
    """The first key position query ``q_pos`` sees under a window of ``blocks`` blocks of ``block`` tokens."""
    return jnp.maximum(0, (q_pos // block - (blocks - 1)) * block)


def window_end(k_pos: Any, blocks: Any, block: int) -> Any:
    """One past the last query position that sees key ``k_pos`` under the window (causal: from ``k_pos`` on)."""
    return (k_pos // block + blocks) * block


def allowed(
    q_start: Any,
    block_q: int,
    k_start: Any,
    block_kv: int,
    *,
    seq_len: int,
    causal: bool,
    positions: bool,
    q_segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
    window_blocks: Any = None,
    window_block: int = 1,
) -> jax.Array | None:
    """Which (query, key) pairs of a ``(block_q, block_kv)`` tile take part, or None for all.

    ``positions`` adds the position part (both inside ``seq_len``; causal order; inside a window of
    ``window_blocks`` blocks of ``window_block`` tokens, if any); blocks that a backend knows to lie wholly inside it skip that part. Segment ids,
    ``(block_q, 1)`` and ``(1, block_kv)``, always apply.
    """
    mask = None
    if positions:
        q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_kv), 0)
        k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_kv), 1)
        mask = (q_pos < seq_len) & (k_pos < seq_len)
        if causal:
            mask = mask & (q_pos >= k_pos)
        if window_blocks is not None:
            mask = mask & (q_pos // window_block - k_pos // window_block < window_blocks)
    if q_segments is not None:
        same = q_segments == kv_segments
        mask = same if mask is None else mask & same
    return mask


def online_softmax_step(
    carry: tuple[jax.Array, jax.Array, jax.Array], s: jax.Array, v: jax.Array, mask: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One key/value block of the online softmax; ``m, l`` are ``(block_q, 1)``, ``s`` base-2 logits."""
    m_prev, l_prev, acc_prev = carry
    if mask is not None:
        s = jnp.where(mask, s, MASK_VALUE)
    m = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp2(s - m)
    rescale = jnp.exp2(m_prev - m)
    l = rescale * l_prev + jnp.sum(p, axis=1, keepdims=True)
    acc = rescale * acc_prev + dot_nn(p.astype(v.dtype), v)
    return m, l, acc


def initial_carry(block_q: int, v_head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    return (
        jnp.full((block_q, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((block_q, 1), jnp.float32),
        jnp.zeros((block_q, v_head_dim), jnp.float32),
    )


def probabilities(s: jax.Array, lse: jax.Array, mask: jax.Array | None) -> jax.Array:
    """``P = exp2(S - lse)``, exactly zero where masked; ``lse`` is ``(block_q, 1)``."""
    p = jnp.exp2(s - lse)
    return p if mask is None else jnp.where(mask, p, 0.0)


def split_loop(
    lo: Any, full_lo: Any, full_hi: Any, hi: Any, body: Callable[[Any, Any, bool], Any], carry: Any
) -> Any:
    """Runs ``body(index, carry, masked)`` over ``[lo, hi)``: unmasked on ``[full_lo, full_hi)``, masked elsewhere.

    The bounds are clamped so the three ranges never overlap: only tiles that cross the causal
    diagonal or the end of the sequence pay for the mask.
    """
    full_lo = jnp.minimum(jnp.maximum(full_lo, lo), hi)
    full_hi = jnp.minimum(jnp.maximum(full_hi, full_lo), hi)
    carry = jax.lax.fori_loop(lo, full_lo, lambda i, c: body(i, c, True), carry)
    carry = jax.lax.fori_loop(full_lo, full_hi, lambda i, c: body(i, c, False), carry)
    return jax.lax.fori_loop(full_hi, hi, lambda i, c: body(i, c, True), carry)
