"""Routed SwiGLU mixture of experts: router, dropless and capacity dispatch, expert parallelism.

For a token ``x`` with router logits ``z = W_r^T x`` (float32) and scores ``s = softmax(z)`` or
``s = sigmoid(z)``:

    S     = top_k(s + b)                       (b: per-expert bias that only chooses, never weighs)
    g_e   = r s_e                for e in S    (optionally r s_e / sum_{e' in S} s_e', DeepSeek)
    y     = sum_{e in S} g_e SwiGLU_e(x) + sum_{shared} SwiGLU_shared(x)

with ``r`` = ``model.router_scale`` (DeepSeek-V2's ``routed_scaling_factor``, 16 in the full model).
Group-limited routing (``model.router_groups`` = G, ``router_topk_groups`` = M < G; DeepSeek-V2's
``group_limited_greedy``, arXiv:2405.04434 section 2.2.2): the experts form G contiguous groups, group
``j`` scores ``max_{e in j} (s_e + b_e)``, and ``S`` is the top k of the M best groups' experts only.
(Switch, arXiv:2101.03961; Mixtral, arXiv:2401.04088; DeepSeekMoE, arXiv:2401.06066; the bias ``b``
is DeepSeek-V3's auxiliary-loss-free balancing, arXiv:2412.19437, updated by `update_router_bias`
outside the gradient. DeepSeek-V2 has no bias; with one, the groups are ranked by the biased scores,
as they choose, and V3's sum-of-top-2 group score is not implemented.)

Dispatch (the expert weights are stacked ``(experts, embed, mlp)``):

- dropless: the ``T k`` token slots are sorted by expert, each expert's contiguous rows go through
  grouped matmuls, and the outputs are unsorted and combined with the gate weights. Nothing is
  dropped. ``model.moe_matmul`` picks the grouped matmul: ``ragged_dot`` (`jax.lax.ragged_dot`,
  partitioned by GSPMD), ``gmm`` (the Pallas kernel `kernels_pallas.gmm.gmm`, run per shard inside
  `jax.shard_map`; on a CPU in interpret mode, slow, for tests), ``tokamax`` (`tokamax.ragged_dot`, the
  optional package, per shard too) or ``auto``; the op chooses
  (`kernels_pallas.gmm.api.grouped_matmul`). The Triton kernel has not yet been compiled
  or timed on a GPU (docs/benchmarks.md, section 8): set ``ragged_dot`` if it fails there.
- capacity (``capacity_factor > 0``): expert ``e`` takes at most ``C = ceil(cf T k / E)`` slots, in
  order of priority (all first choices, then all second choices, ... as in Switch/GShard), by the
  position ``cumsum`` gives each slot within its expert; slots past ``C`` are dropped (output 0) and
  counted. In training and evaluation only: decoding from a KV cache is dropless (``decoding=True``).
- expert parallel: under a mesh with an ``expert`` axis the dropless dispatch runs per shard inside
  `jax.shard_map`: each device routes its own tokens, sends each slot to the device that holds its
  expert with an all-to-all, runs its local experts and sends the results back. On GPU and TPU the
  all-to-all is `jax.lax.ragged_all_to_all`: slots sorted by expert, each device sends exactly its
  slots for each peer (`ragged_dispatch`). On CPU, where ``ragged_all_to_all`` has no lowering, it is
  a dense all-to-all of worst-case buffers (every slot to one device), ``ep`` times the slot traffic.
  Both receive into ``ep`` times the slot memory, the worst case.

The layer also returns the statistics the balancing losses need (`balancing_losses`), per sequence
so the loss can be taken over the global batch or per micro-batch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas.gmm import api as gmm_api
from lm.config import ModelConfig
from lm.layers import SwiGLU, swiglu_gate
from sharding import axes, partition


class Router(nnx.Module):
    """fp32 router: ``kernel`` ``(embed, experts)`` and the selection-only ``bias`` ``(experts,)``."""

    def __init__(self, d_model: int, n_experts: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
        self.kernel = nnx.Param(init(rngs.params(), (d_model, n_experts), jnp.float32), out_sharding=("embed", "experts"))
        self.bias = nnx.Param(jnp.zeros((n_experts,), jnp.float32), out_sharding=("experts",))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x.astype(jnp.float32) @ self.kernel[...]


def route(
    logits: jax.Array, bias: jax.Array, k: int, score: str, normalize: bool, scale: float = 1.0, groups: int = 1,
    topk_groups: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-``k`` experts per row of ``logits`` ``(T, E)``, from the ``topk_groups`` best of ``groups`` groups.

    Returns ``(experts (T, k) int32, gates (T, k) float32, probs (T, E))``; ``gates`` are ``scale`` times the
    (optionally renormalised) scores; ``probs`` are the router probabilities the balancing loss uses (softmax
    scores, or sigmoid scores normalised per token). The other groups' experts are masked to ``-inf`` before the
    top-k; transformers' DeepSeek-V2 masks them to 0, which chooses the same experts as softmax scores are > 0.
    """
    scores = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    choice = scores + jax.lax.stop_gradient(bias)
    if 0 < topk_groups < groups:
        per_group = choice.reshape(*choice.shape[:-1], groups, -1)
        _, best = jax.lax.top_k(jnp.max(per_group, axis=-1), topk_groups)
        kept = jnp.any(best[..., None] == jnp.arange(groups), axis=-2)  # (T, groups)
        choice = jnp.where(kept[..., None], per_group, -jnp.inf).reshape(choice.shape)
    _, experts = jax.lax.top_k(choice, k)
    gates = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    if scale != 1.0:
        gates = gates * scale
    probs = scores if score == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
    return experts.astype(jnp.int32), gates, probs


GroupedMatmul = gmm_api.GroupedMatmul


def grouped_swiglu(
    rows: jax.Array, group: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, matmul: GroupedMatmul = jax.lax.ragged_dot
) -> jax.Array:
    """Row ``r`` through expert ``group[r]``'s SwiGLU; rows with ``group[r] >= E`` give 0.

    Sorts rows by expert, runs three grouped matmuls (``matmul``, `jax.lax.ragged_dot`'s signature), unsorts.
    """
    n_experts = w_gate.shape[0]
    order = jnp.argsort(group, stable=True)
    sizes = jnp.bincount(group, length=n_experts + 1)[:n_experts].astype(jnp.int32)  # rows past the groups: 0
    xs = rows[order]
    hidden = swiglu_gate(matmul(xs, w_gate, sizes), matmul(xs, w_up, sizes))
    ys = matmul(hidden, w_down, sizes)
    return jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)


def dropless(
    x: jax.Array, experts: jax.Array, gates: jax.Array, w_gate, w_up, w_down, matmul: GroupedMatmul = jax.lax.ragged_dot
) -> jax.Array:
    """``sum_j gates[t, j] SwiGLU_{experts[t, j]}(x[t])`` for ``x`` ``(T, d)``, no token dropped."""
    t, k = experts.shape
    slots = grouped_swiglu(jnp.repeat(x, k, axis=0), experts.reshape(-1), w_gate, w_up, w_down, matmul)
    return jnp.einsum("tkd,tk->td", slots.reshape(t, k, -1), gates.astype(slots.dtype))


def capacity(n_tokens: int, k: int, n_experts: int, factor: float) -> int:
    """Slots per expert: ``ceil(factor * T k / E)``."""
    return max(1, math.ceil(factor * n_tokens * k / n_experts))


def with_capacity(x: jax.Array, experts: jax.Array, gates: jax.Array, w_gate, w_up, w_down, cap: int):
    """Capacity-limited dispatch; returns ``(y (T, d), dropped slot count)``."""
    t, k = experts.shape
    n_experts = w_gate.shape[0]
    slot_expert = experts.T.reshape(-1)  # priority order: all first choices, then all second, ...
    one_hot = jax.nn.one_hot(slot_expert, n_experts, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1)
    kept = position < cap
    slot_token = jnp.tile(jnp.arange(t), k)
    buffer = jnp.zeros((n_experts, cap, x.shape[-1]), x.dtype)
    buffer = buffer.at[slot_expert, position].set(x[slot_token], mode="drop")
    buffer = partition.constrain(buffer, ("experts", None, "embed"))
    hidden = swiglu_gate(jnp.einsum("ecd,edf->ecf", buffer, w_gate), jnp.einsum("ecd,edf->ecf", buffer, w_up))
    out = jnp.einsum("ecf,efd->ecd", hidden, w_down)
    slots = out.at[slot_expert, position].get(mode="fill", fill_value=0)  # dropped slots read 0
    y = jnp.einsum("ktd,kt->td", slots.reshape(k, t, -1), gates.T.astype(out.dtype))
    return y, jnp.sum(~kept)


def expert_parallel_dropless(
    x, experts, gates, w_gate, w_up, w_down, *, ep: int, matmul: GroupedMatmul = jax.lax.ragged_dot
) -> jax.Array:
    """`dropless` for one shard inside `jax.shard_map`: local tokens, the local ``E / ep`` experts.

    Slot ``s`` goes to device ``experts[s] // (E / ep)`` of the ``expert`` axis at row
    ``position[s]`` of that device's send buffer; the reply comes back to the same row.
    """
    t, k = experts.shape
    local = w_gate.shape[0]
    slot_expert = experts.reshape(-1)
    dest = slot_expert // local
    one_hot = jax.nn.one_hot(dest, ep, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1)
    rows = t * k  # worst case: every slot to one device
    send = jnp.zeros((ep, rows, x.shape[-1]), x.dtype).at[dest, position].set(jnp.repeat(x, k, axis=0))
    send_expert = jnp.full((ep, rows), local, jnp.int32).at[dest, position].set(slot_expert % local)
    recv = jax.lax.all_to_all(send, axes.EXPERT, 0, 0, tiled=True)
    recv_expert = jax.lax.all_to_all(send_expert, axes.EXPERT, 0, 0, tiled=True)
    out = grouped_swiglu(recv.reshape(ep * rows, -1), recv_expert.reshape(-1), w_gate, w_up, w_down, matmul)
    back = jax.lax.all_to_all(out.reshape(ep, rows, -1), axes.EXPERT, 0, 0, tiled=True)
    slots = back[dest, position]
    return jnp.einsum("tkd,tk->td", slots.reshape(t, k, -1), gates.astype(slots.dtype))


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def ragged_dispatch(x, experts, gates, w_gate, w_up, w_down, *, ep: int, matmul: GroupedMatmul = jax.lax.ragged_dot) -> jax.Array:
    """`expert_parallel_dropless` with `jax.lax.ragged_all_to_all` (GPU, TPU): only the real slots travel.

    With ``S[i, j]`` the slots device ``i`` sends to device ``j`` (gathered over the ``expert`` axis),
    device ``i``'s slice for ``j`` lands on ``j`` after those of the senders before ``i``, at row
    ``sum_{i' < i} S[i', j]``; the results return along the same slices to where they came from.
    """
    t, k = experts.shape
    local = w_gate.shape[0]
    rows = t * k
    slot_expert = experts.reshape(-1)
    order = jnp.argsort(slot_expert, stable=True)  # by global expert, hence by destination device
    send = jnp.repeat(x, k, axis=0)[order]
    send_expert = (slot_expert % local)[order][:, None]
    send_sizes = jnp.bincount(slot_expert // local, length=ep).astype(jnp.int32)
    sizes = jax.lax.all_gather(send_sizes, axes.EXPERT)  # (ep, ep)
    me = jax.lax.axis_index(axes.EXPERT)
    input_offsets, recv_sizes = _exclusive_cumsum(send_sizes), sizes[:, me]
    output_offsets = _exclusive_cumsum(sizes)[me]  # where my slice lands on each receiver
    recv_offsets = _exclusive_cumsum(recv_sizes)  # where each sender's slice lands here
    forward = (input_offsets, send_sizes, output_offsets, recv_sizes)
    recv = jax.lax.ragged_all_to_all(send, jnp.zeros((ep * rows, x.shape[-1]), x.dtype), *forward, axis_name=axes.EXPERT)
    recv_expert = jax.lax.ragged_all_to_all(send_expert, jnp.full((ep * rows, 1), local, jnp.int32), *forward, axis_name=axes.EXPERT)
    out = grouped_swiglu(recv, recv_expert[:, 0], w_gate, w_up, w_down, matmul)
    sender_offsets = _exclusive_cumsum(sizes, axis=1)[:, me]  # each sender's input_offsets for me
    back = jax.lax.ragged_all_to_all(
        out, jnp.zeros((rows, out.shape[-1]), out.dtype), recv_offsets, recv_sizes, sender_offsets, send_sizes, axis_name=axes.EXPERT
    )
    slots = jnp.zeros_like(back).at[order].set(back, unique_indices=True)
    return jnp.einsum("tkd,tk->td", slots.reshape(t, k, -1), gates.astype(slots.dtype))


RAGGED_ALL_TO_ALL_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def _expert_parallel_size() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axes.EXPERT not in partition.logical_mesh_axes("experts"):
        return 1
    return mesh.shape[axes.EXPERT]


class MoE(nnx.Module):
    """The routed SwiGLU MoE layer of a block (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        n, d, f = cfg.n_experts, cfg.d_model, cfg.expert_mlp_dim or cfg.mlp_dim
        self.k, self.score, self.normalize = cfg.experts_per_token, cfg.router_score, cfg.normalize_router_weights
        self.scale, self.groups, self.topk_groups = cfg.router_scale, cfg.router_groups, cfg.router_topk_groups
        self.capacity_factor, self.matmul = cfg.capacity_factor, cfg.moe_matmul
        self.dtype = cfg.compute_dtype
        self.router = Router(d, n, rngs=rngs)

        def stacked(fan_in: int, fan_out: int, names: tuple[str, ...], scale: float = 1.0) -> nnx.Param:
            init = nnx.initializers.variance_scaling(scale**2, "fan_in", "truncated_normal", batch_axis=(0,))
            return nnx.Param(init(rngs.params(), (n, fan_in, fan_out), jnp.float32), out_sharding=names)

        out_scale = (2 * cfg.n_layers) ** -0.5
        self.w_gate = stacked(d, f, ("experts", "embed", "mlp"))
        self.w_up = stacked(d, f, ("experts", "embed", "mlp"))
        self.w_down = stacked(f, d, ("experts", "mlp", "embed"), out_scale)
        self.shared = (
            SwiGLU(d, cfg.n_shared_experts * f, out_scale=out_scale, dtype=self.dtype, rngs=rngs) if cfg.n_shared_experts else None
        )

    def __call__(self, x: jax.Array, *, decoding: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``x`` ``(batch, seq, embed)`` -> ``(y, stats)``; ``stats`` as `balancing_losses` takes them.

        ``decoding`` (from a KV cache) dispatches dropless whatever ``capacity_factor`` is, so a sample's
        tokens never depend on the other samples of its batch or on how its prompt was split between
        prefill and steps.
        """
        b, s, d = x.shape
        logits = self.router(x)  # (b, s, E) float32
        n_experts = logits.shape[-1]
        routing = (self.k, self.score, self.normalize, self.scale, self.groups, self.topk_groups)
        experts, gates, probs = route(logits.reshape(b * s, -1), self.router.bias[...], *routing)
        weights = tuple(w[...].astype(self.dtype) for w in (self.w_gate, self.w_up, self.w_down))
        flat = x.reshape(b * s, d)
        dropped = jnp.zeros((), jnp.float32)
        ep = _expert_parallel_size()
        matmul, is_kernel = gmm_api.grouped_matmul(self.matmul)
        if self.capacity_factor > 0 and not decoding:
            cap = capacity(b * s, self.k, n_experts, self.capacity_factor)
            y, n_dropped = with_capacity(flat, experts, gates, *weights, cap)
            dropped = n_dropped.astype(jnp.float32)
        elif ep > 1 or is_kernel:
            y = self._per_shard(x, experts.reshape(b, s, -1), gates.reshape(b, s, -1), weights, ep, matmul).reshape(b * s, d)
        else:
            y = dropless(flat, experts, gates, *weights)
        y = y.reshape(b, s, d).astype(x.dtype)
        if self.shared is not None:
            y = y + self.shared(x)
        counts = jnp.sum(jax.nn.one_hot(experts, n_experts, dtype=jnp.float32), axis=1).reshape(b, s, n_experts)
        stats = {
            "expert_counts": jax.lax.stop_gradient(jnp.sum(counts, axis=1)),  # (b, E) slots per expert
            "router_prob_sum": jnp.sum(probs.reshape(b, s, -1), axis=1),  # (b, E)
            "router_z": jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
            "dropped_slots": dropped,
        }
        return y, stats

    def _per_shard(self, x, experts, gates, weights, ep, matmul):
        """Dropless dispatch inside `jax.shard_map`: with all-to-all when ``ep > 1``, else on each shard's tokens."""

        exchange = ragged_dispatch if gmm_api.platform() in RAGGED_ALL_TO_ALL_PLATFORMS else expert_parallel_dropless

        def per_shard(x, experts, gates, w_gate, w_up, w_down):
            b, s, d = x.shape
            args = (x.reshape(b * s, d), experts.reshape(b * s, -1), gates.reshape(b * s, -1), w_gate, w_up, w_down)
            y = exchange(*args, ep=ep, matmul=matmul) if ep > 1 else dropless(*args, matmul=matmul)
            return y.reshape(b, s, d)

        tokens = ("batch", "seq", "embed")
        slots = ("batch", "seq", None)
        stack = ("experts", None, None)
        run = partition.logical_shard_map(per_shard, (tokens, slots, slots, stack, stack, stack), tokens, whole=("embed",))
        return run(x, experts, gates, *weights)


# ------------------------------------------------------------------------------------- balancing


@dataclasses.dataclass(frozen=True)
class Balancing:
    """How the train step balances the experts (config ``moe.*``).

    Attributes:
      balance_loss: weight of the Switch load-balancing loss.
      router_z_loss: weight of the router z-loss ``mean_t logsumexp(z_t)^2`` (ST-MoE, arXiv:2202.08906).
      scope: ``global``: expert loads counted over the global batch (all data-parallel shards and
        every gradient-accumulation micro-batch so far, arXiv:2501.11873); ``micro_batch``: counted
        per sequence, the local balancing that paper compares against.
      bias_rate: step ``gamma`` of the auxiliary-loss-free bias update (0: off).
    """

    balance_loss: float = 0.01
    router_z_loss: float = 0.001
    scope: str = "global"
    bias_rate: float = 0.0

    def __post_init__(self):
        if self.scope not in ("global", "micro_batch"):
            raise ValueError(f"moe.balance_scope={self.scope!r} must be 'global' or 'micro_batch'")


def switch_loss(counts: jax.Array, prob_mean: jax.Array) -> jax.Array:
    """``E sum_i f_i P_i`` over the last axis; ``f_i`` the fraction of slots sent to expert ``i``.

    ``f`` is a count (no gradient); the loss reaches the router through ``P_i``, the mean router
    probability of expert ``i``. At perfect balance (``f_i = 1/E``) it is ``sum_i P_i = 1`` whatever
    the probabilities.
    """
    n_experts = counts.shape[-1]
    f = counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)
    return n_experts * jnp.sum(f * prob_mean, axis=-1)


def batch_counts(stats: dict[str, jax.Array], axis_name: str | None = None) -> jax.Array:
    """``(layers, E)`` slots per expert over the whole batch: this shard's rows, summed over the mesh axis
    ``axis_name`` when each replica of a replica-local step (inside its `jax.shard_map`) sees only its own."""
    counts = jnp.sum(stats["expert_counts"], axis=1)
    return counts if axis_name is None else jax.lax.psum(counts, axis_name)


def balancing_losses(
    stats: dict[str, jax.Array], prior_counts: jax.Array, cfg: Balancing, axis_name: str | None = None
) -> tuple[jax.Array, dict]:
    """The weighted balancing + router z losses of one micro-batch, and their metrics.

    Args:
      stats: the MoE layers' statistics stacked over layers: ``expert_counts`` and
        ``router_prob_sum`` ``(layers, batch, E)``, ``router_z`` ``(layers,)``.
      prior_counts: ``(layers, E)`` slots per expert in the step's earlier micro-batches (global scope).
      cfg: the weights and scope.
      axis_name: the replica axis of a replica-local step: the global scope's expert fractions are
        then those of every replica's rows (`batch_counts`), and the mean over replicas of this loss
        is the whole batch's (the loss is linear in each replica's mean router probabilities).
    """
    counts, prob_sum = stats["expert_counts"], stats["router_prob_sum"]
    tokens = jnp.sum(prob_sum, axis=-1, keepdims=True)  # router probabilities sum to 1 per token
    if cfg.scope == "global":
        balance = switch_loss(prior_counts + batch_counts(stats, axis_name), jnp.sum(prob_sum, axis=1) / jnp.sum(tokens, axis=1))
    else:
        balance = switch_loss(counts, prob_sum / tokens)
    balance = jnp.mean(balance)
    z = jnp.mean(stats["router_z"])
    loss = cfg.balance_loss * balance + cfg.router_z_loss * z
    return loss, {"moe_balance_loss": balance, "router_z_loss": z}


def load_metrics(counts: jax.Array, dropped: jax.Array) -> dict[str, jax.Array]:
    """Per-step load metrics from ``counts`` ``(layers, E)`` and the dropped slot count.

    ``expert_load_max``: the largest ``load_i / mean_i load`` over experts and layers (1 = balanced).
    """
    load = counts / jnp.maximum(jnp.mean(counts, axis=-1, keepdims=True), 1e-9)
    return {"expert_load_max": jnp.max(load), "dropped_fraction": dropped / jnp.maximum(jnp.sum(counts), 1.0)}


def bias_step(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's update: ``b_i <- b_i + gamma sign(mean_j c_j - c_i)`` (raise under-loaded experts)."""
    return bias + rate * jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts)


def _is_router_bias(path: Any) -> bool:
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    return names[-2:] == ["router", "bias"]


def update_router_bias(new_params: Any, old_params: Any, counts: jax.Array, rate: float) -> Any:
    """``new_params`` with every router bias set to `bias_step` of its value in ``old_params``.

    The biases are not trained by gradient: whatever the optimizer did to them is replaced.
    ``counts`` is ``(moe_layers, E)``, the step's slots per expert in layer order.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(new_params)
    old = jax.tree.leaves(old_params)
    leaves, row = [], 0
    for (path, leaf), before in zip(flat, old, strict=True):
        if _is_router_bias(path):
            rows = leaf.shape[0] if leaf.ndim == 2 else 1
            step = bias_step(before.reshape(rows, -1), counts[row : row + rows], rate).reshape(leaf.shape)
            leaves.append(step.astype(leaf.dtype))
            row += rows
        else:
            leaves.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, leaves)
