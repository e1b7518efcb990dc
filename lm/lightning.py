"""MiniMax-01's lightning attention layer and the hybrid stack's layer plan.

A lightning layer (MiniMax-01, arXiv:2501.08313, Sec. 2.2; MiniMax-AI/MiniMax-01's modeling code):

    q, k, v = silu(x W_qkv)                    (n_heads heads of head_dim each, no RoPE, no 1/sqrt(d))
    o_t     = q_t S_t,   S_t = lambda_h S_{t-1} + k_t^T v_t         (`kernels_pallas.lightning`)
    y       = W_out (sigmoid(x W_gate) * RMSNorm(o))

with the decay rate of head ``h`` (0-based) in layer ``l`` of ``L``: ``s = 2^(-8 (h + 1) / H) *
(1 - l / (L - 1) + 1e-5)`` (ALiBi's slopes, weakening with depth), ``lambda = exp(-s)``. The op runs
it in blocks (Lightning Attention-2, arXiv:2401.04658): intra-block ``[(Q K^T) * M] V``, inter-block
through the running state, work O(T d^2) and, by its explicit backward, memory flat in the blocks.

``model.attention_type=lightning`` makes every layer lightning; ``model.softmax_attention_every=k``
makes every k-th layer (``l + 1`` a multiple of ``k``: 7 lightning then 1 softmax for MiniMax-01's
``k = 8``, as its ``attn_type_list``) the model's grouped-query softmax attention (`lm.attention`).
Document masks reset the state at each boundary. For decoding the cache holds each lightning layer's
``(heads, d, d)`` float32 state (`lm.kv_cache`) and the softmax layers' keys and values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas.lightning import api as lightning_api
from lm import kv_cache
from lm.config import ModelConfig
from lm.layers import RMSNorm, linear
from lm.parallel import context_attention
from sharding import partition

_Q = ("batch", "seq", "heads", "head_dim")

CONTEXT_PROBLEM = "model.attention_type=lightning does not run with the sequence split over a context axis; drop the context axis"


def is_softmax_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether ``layer`` of a lightning model keeps softmax attention (every ``softmax_attention_every``-th)."""
    every = cfg.softmax_attention_every
    return cfg.attention_type == "lightning" and every > 0 and (layer + 1) % every == 0


def is_lightning_layer(cfg: ModelConfig, layer: int) -> bool:
    return cfg.attention_type == "lightning" and not is_softmax_layer(cfg, layer)


def slopes(n_heads: int, layer: int, n_layers: int) -> np.ndarray:
    """MiniMax-01's decay rates ``s_h`` of ``layer`` (module docstring), float32 ``(n_heads,)``."""
    base = 2.0 ** (-8.0 / n_heads)
    depth = 1.0 - layer / (n_layers - 1 + 1e-5) + 1e-5
    return (base ** (np.arange(n_heads) + 1.0) * depth).astype(np.float32)


def _implementation(cfg: ModelConfig) -> str:
    """The op's implementation for ``model.attention``: the Pallas kernel when named, else the op's ``auto``."""
    return "pallas" if cfg.attention == "pallas" else "auto"


class LightningAttention(nnx.Module):
    """One lightning attention layer (module docstring); ``layer`` sets its decay rates."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        dtype, width = cfg.compute_dtype, cfg.n_heads * cfg.head_dim
        self.cfg = cfg
        self.slopes = tuple(float(s) for s in slopes(cfg.n_heads, layer, cfg.n_layers))
        self.qkv_proj = linear(cfg.d_model, 3 * width, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.output_gate = linear(cfg.d_model, width, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(width, "heads", eps=cfg.norm_eps, dtype=dtype)
        self.out_proj = linear(width, cfg.d_model, ("heads", "embed"), dtype=dtype, rngs=rngs, scale=(2 * cfg.n_layers) ** -0.5)

    def _qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        qkv = jax.nn.silu(self.qkv_proj(x)).reshape(*x.shape[:2], cfg.n_heads, 3 * cfg.head_dim)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        return tuple(partition.constrain(t, _Q) for t in (q, k, v))

    def _output(self, x: jax.Array, out: jax.Array) -> jax.Array:
        gated = jax.nn.sigmoid(self.output_gate(x)) * self.norm(out.reshape(*x.shape[:2], -1))
        return self.out_proj(gated.astype(x.dtype))

    def _attend(self, q, k, v, segment_ids, state):
        cfg = self.cfg
        slope = jnp.asarray(self.slopes, jnp.float32)
        implementation = _implementation(cfg) if state is None else "auto"  # decoding: a few tokens, XLA

        def run(q, k, v, slope, *segments):
            return lightning_api.lightning_attention(
                q, k, v, slope, segment_ids=segments[0] if segments else None, state=state, block=cfg.lightning_block,
                implementation=implementation,
            )

        if implementation != "pallas":
            return run(q, k, v, slope, *(() if segment_ids is None else (segment_ids,)))
        # A Pallas call is opaque to GSPMD: per shard, batch and heads may be split, the sequence not.
        args, specs = [q, k, v, slope], [_Q, _Q, _Q, ("heads",)]
        if segment_ids is not None:
            args, specs = [*args, segment_ids], [*specs, ("batch", "seq")]
        out_logical = (_Q, ("batch", "heads", None, None))
        return partition.logical_shard_map(run, specs, out_logical, whole=("seq",))(*args)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None, order=None):
        """``(y, None)`` for ``x`` ``(batch, seq, d_model)`` (None: no softmax logits to track)."""
        if order is not None or context_attention.sequence_split():
            raise ValueError(CONTEXT_PROBLEM)
        q, k, v = self._qkv(x)
        out, _ = self._attend(q, k, v, segment_ids, None)
        return self._output(x, out), None

    def decode(self, x: jax.Array, cache: kv_cache.Cache, start: jax.Array) -> tuple[jax.Array, kv_cache.Cache]:
        """``x`` ``(batch, s, d_model)`` continuing from the layer's ``{"state": (batch, heads, d, d)}``."""
        del start  # the state holds the past whatever its length
        q, k, v = self._qkv(x)
        out, state = self._attend(q, k, v, None, cache["state"])
        return self._output(x, out), {"state": state}


def attention_macs_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Multiply-adds per token of the attention products over the stack (no causal savings, as for softmax):
    a lightning head ``2 d B`` (intra-block scores and values) ``+ 2 d^2`` (``q S`` and the state update),
    a softmax head ``2 d T``."""
    d, block = cfg.head_dim, min(cfg.lightning_block, seq_len)
    per_layer = [2 * d * seq_len if is_softmax_layer(cfg, layer) else 2 * d * block + 2 * d * d for layer in range(cfg.n_layers)]
    return cfg.n_heads * sum(per_layer)


def layer_slots(cfg: ModelConfig) -> list[tuple[str, int]]:
    """Per layer, the cache entry it uses and its index there: ``("state", i)`` or ``("kv", i)``."""
    counts = {"state": 0, "kv": 0}
    slots = []
    for layer in range(cfg.n_layers):
        kind = "kv" if is_softmax_layer(cfg, layer) else "state"
        slots.append((kind, counts[kind]))
        counts[kind] += 1
    return slots


def decode_blocks(cfg: ModelConfig, blocks, x: jax.Array, cache: kv_cache.Cache, start: jax.Array):
    """The unrolled hybrid stack's `decode`: each block reads and writes its own slot of the cache."""
    cache = dict(cache)
    for block, (kind, i) in zip(blocks, layer_slots(cfg), strict=True):
        names = ("state",) if kind == "state" else ("k", "v")
        x, layer_cache = block.decode(x, {n: cache[n][i] for n in names}, start)
        cache.update({n: cache[n].at[i].set(layer_cache[n]) for n in names})
    return x, cache
