"""ParScale: P parallel streams of one decoder, their outputs mixed by learned dynamic weights.

Chen et al., "Parallel Scaling Law for Language Models" (arXiv:2505.10475); the authors' code is
QwenLM/ParScale, ``modeling_qwen2_parscale.py`` (``parscale_n`` streams, ``parscale_n_tokens`` prefix
tokens, ``parscale_attn_smooth``). With ``P = model.parscale`` streams, for an input ``x``::

    h_i    = f(x; prefix_i)                       i = 1..P, one decoder f with shared weights
    w      = softmax(W_2 SiLU(W_1 [h_1 ; ... ; h_P] + b_1) + b_2)       (P,), in float32
    w      = (1 - eps) w + eps / P                label smoothing, eps = model.parscale_smoothing
    logits = (sum_i w_i h_i) W_out

The input transformation of stream ``i`` is prefix tuning: every layer's attention sees ``T``
(``model.parscale_prefix_tokens``) learned keys and values ``prefix_i`` before the sequence's own,
with no position (no RoPE), visible to every query. ``h_i`` is the final RMSNorm's output; the head
is linear, so mixing those states is mixing the P streams' logits. The MLP reads the states
concatenated feature-major (``[h_1[0], ..., h_P[0], h_1[1], ...]``, the authors' ``b s (h n)``), so
their ``aggregate_layer`` weights are ours transposed.

Layout: the streams fold into the batch axis, example-major (row ``b P + i`` is stream ``i`` of
example ``b``), so the decoder runs unchanged on ``P B`` rows whose logical axis is ``batch``;
GSPMD shards them like any batch, each shard holding whole examples when ``B`` divides, and any
split of the batch into contiguous groups of ``P`` rows (microbatches, shards) keeps row ``r`` in
stream ``r mod P``. (Pipeline microbatches take strided rows and context parallelism splits the
sequence the prefix goes before: neither runs with ``P > 1``.)

Attention runs as the authors' does: ``T`` zero queries and the prefix keys and values go before the
sequence, causal attention over ``T + S`` positions (any ``model.attention`` implementation) then
gives each real query every prefix position and its causal past, and the zero queries' outputs are
dropped. Their logits (zeros) enter the tracked max logits. Decoding puts the prefix's logits before
the cache rows' (the cache itself is not copied). ``P = 1`` is the plain model: no prefix, no
aggregation, no parameters.

Initialisation (the authors load trained prefixes; their ``_init_weights`` leaves them unset):
prefix keys and values ``N(0, 1)``, the scale of a key or value of a normalised input under the
fan-in initialisation; the aggregation MLP fan-in truncated normal, biases zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lm.config import ModelConfig
from lm.layers import project
from lm.parallel import context_attention, pipeline
from sharding.partition import constrain

MESH_PROBLEM = (
    "model.parscale > 1 runs on meshes without a `stage` or `context` axis (a pipeline's strided microbatches lose the "
    "rows' streams; a split sequence cannot take the prefix first); drop those axes from --config.mesh"
)
STREAMS = "streams"  # logical axis of per-stream parameters: the prefixes, the aggregation's output
_ACTIVATION = ("batch", "seq", "embed")
_KV = ("batch", "seq", "kv_heads", "head_dim")


def expand(x: jax.Array, streams: int) -> jax.Array:
    """``(B, S, D) -> (B P, S, D)``: each example repeated for its ``P`` streams, example-major."""
    if pipeline.stage_count() > 1 or context_attention.sequence_split():
        raise ValueError(MESH_PROBLEM)
    return constrain(jnp.repeat(x, streams, axis=0), _ACTIVATION)


class Prefix(nnx.Module):
    """One layer's per-stream prefix keys and values, ``(P, T, kv_heads, head_dim)`` each."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        shape = (cfg.parscale, cfg.parscale_prefix_tokens, cfg.n_kv_heads, cfg.head_dim)
        names = (STREAMS, None, "kv_heads", "head_dim")
        init = nnx.initializers.normal(1.0)
        self.k = nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=names)
        self.v = nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=names)

    @property
    def tokens(self) -> int:
        return self.k[...].shape[1]

    def _rows(self, prefix: jax.Array, like: jax.Array) -> jax.Array:
        """``prefix`` tiled over ``like``'s rows (row ``r`` takes stream ``r mod P``), in its dtype."""
        streams = prefix.shape[0]
        if like.shape[0] % streams:
            raise ValueError(f"{like.shape[0]} rows are not whole groups of model.parscale={streams} streams")
        return jnp.tile(prefix.astype(like.dtype), (like.shape[0] // streams, 1, 1, 1))

    def rows(self, like: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The prefix keys and values ``(rows, T, kv_heads, head_dim)`` of ``like``'s rows (``(rows, ...)``)."""
        return constrain(self._rows(self.k[...], like), _KV), constrain(self._rows(self.v[...], like), _KV)

    def prepend(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values ``(rows, S, kv_heads, head_dim)`` with each row's stream prefix before them."""
        prefix_k, prefix_v = self.rows(k)
        return constrain(jnp.concatenate([prefix_k, k], axis=1), _KV), constrain(jnp.concatenate([prefix_v, v], axis=1), _KV)

    def extend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``q, k, v`` over ``T + S`` positions: ``T`` zero queries and the prefix before the sequence.

        Causal attention over them is the prefix-tuned attention of the ``S`` real queries (rows
        ``T ..`` of its output); the zero queries' rows are to be dropped.
        """
        q = jnp.concatenate([jnp.zeros((q.shape[0], self.tokens, *q.shape[2:]), q.dtype), q], axis=1)
        return (constrain(q, ("batch", "seq", "heads", "head_dim")), *self.prepend(k, v))


class Aggregator(nnx.Module):
    """The dynamic weighted sum of the P streams' final states, ``(B P, S, D) -> (B, S, D)``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        p, d = cfg.parscale, cfg.d_model
        self.streams, self.smoothing = p, cfg.parscale_smoothing
        self.hidden = _linear(p * d, d, (None, "embed"), cfg, rngs)
        self.weights = _linear(d, p, ("embed", STREAMS), cfg, rngs)

    def stream_weights(self, h: jax.Array) -> jax.Array:
        """Smoothed float32 weights ``(B, S, P)`` of the streams' states ``h`` ``(B P, S, D)``."""
        rows, s, d = h.shape
        b, p = rows // self.streams, self.streams
        features = h.reshape(b, p, s, d).transpose(0, 2, 3, 1).reshape(b, s, d * p)  # the authors' "b s (h n)"
        scores = self.weights(jax.nn.silu(self.hidden(features))).astype(jnp.float32)
        return jax.nn.softmax(scores, axis=-1) * (1 - self.smoothing) + self.smoothing / p

    def __call__(self, h: jax.Array) -> jax.Array:
        rows, s, d = h.shape
        w = self.stream_weights(h)
        streams = h.reshape(rows // self.streams, self.streams, s, d).astype(jnp.float32)
        return constrain(jnp.einsum("bpsd,bsp->bsd", streams, w).astype(h.dtype), _ACTIVATION)


def _linear(fan_in: int, fan_out: int, names: tuple[str | None, str | None], cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Linear:
    """Linear with a bias (the authors' ``torch.nn.Linear``), fan-in truncated-normal kernel, zero bias."""
    return nnx.Linear(
        fan_in,
        fan_out,
        dtype=cfg.compute_dtype,
        param_dtype=jnp.float32,
        kernel_init=nnx.with_partitioning(nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"), names),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), names[1:]),
        dot_general=project,
        rngs=rngs,
    )
