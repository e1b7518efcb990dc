"""The MoE layer against a loop-over-experts reference, its balancing terms, and the bias update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import moe

E, K, D, F, T = 8, 2, 16, 24, 40


def _reference(x, kernel, bias, w_gate, w_up, w_down, *, score, normalize):
    """``sum_e [e in top_k] g_e SwiGLU_e(x)``, every expert run on every token, masked."""
    logits = x @ kernel
    scores = jax.nn.softmax(logits, -1) if score == "softmax" else jax.nn.sigmoid(logits)
    chosen = jnp.argsort(-(scores + bias), axis=-1)[:, :K]
    mask = jnp.zeros_like(scores).at[jnp.arange(x.shape[0])[:, None], chosen].set(1.0)
    gates = scores * mask
    if normalize:
        gates = gates / jnp.sum(gates, -1, keepdims=True)
    y = jnp.zeros_like(x)
    for e in range(E):
        expert = (jax.nn.silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]
        y = y + gates[:, e : e + 1] * expert
    return y


def _layer(x, kernel, bias, w_gate, w_up, w_down, *, score, normalize, capacity_factor=0.0):
    experts, gates, _ = moe.route(x @ kernel, bias, K, score, normalize)
    if capacity_factor > 0:
        return moe.with_capacity(x, experts, gates, w_gate, w_up, w_down, moe.capacity(T, K, E, capacity_factor))
    return moe.dropless(x, experts, gates, w_gate, w_up, w_down), jnp.int32(0)


@pytest.fixture(scope="module")
def inputs():
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (T, D))
    kernel = jax.random.normal(keys[1], (D, E))
    bias = 0.3 * jax.random.normal(keys[2], (E,))
    w = [jax.random.normal(k, s) / np.sqrt(s[1]) for k, s in zip(keys[3:], [(E, D, F), (E, D, F), (E, F, D)], strict=True)]
    return (x, kernel, bias, *w)


@pytest.mark.parametrize("score,normalize", [("softmax", False), ("sigmoid", True)])
def test_dropless_matches_loop_over_experts_forward_and_backward(inputs, score, normalize):
    ref = lambda *a: _reference(*a, score=score, normalize=normalize)  # noqa: E731
    got = lambda *a: _layer(*a, score=score, normalize=normalize)[0]  # noqa: E731
    np.testing.assert_allclose(jax.jit(got)(*inputs), ref(*inputs), rtol=1e-5, atol=1e-5)
    cotangent = jax.random.normal(jax.random.key(1), (T, D))
    argnums = (0, 1, 3, 4, 5)  # not the bias: it only chooses
    grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * cotangent), argnums=argnums))  # noqa: E731
    for g_got, g_ref in zip(grad(got)(*inputs), grad(ref)(*inputs), strict=True):
        np.testing.assert_allclose(g_got, g_ref, rtol=1e-4, atol=1e-5)


def test_capacity_mode_with_large_factor_equals_dropless(inputs):
    dropless, _ = jax.jit(lambda *a: _layer(*a, score="softmax", normalize=False))(*inputs)
    capped, dropped = jax.jit(lambda *a: _layer(*a, score="softmax", normalize=False, capacity_factor=E / K))(*inputs)
    assert int(dropped) == 0
    np.testing.assert_allclose(capped, dropless, rtol=1e-5, atol=1e-5)


def test_capacity_mode_drops_and_counts_the_overflow():
    # Every token picks experts 0 and 1 first; capacity 1.0 leaves each expert T K / E slots.
    x = jnp.ones((T, D))
    experts = jnp.tile(jnp.array([[0, 1]], jnp.int32), (T, 1))
    gates = jnp.full((T, K), 0.5)
    w = jnp.ones((E, D, F)), jnp.ones((E, D, F)), jnp.ones((E, F, D))
    cap = moe.capacity(T, K, E, 1.0)
    y, dropped = moe.with_capacity(x, experts, gates, *w, cap)
    assert int(dropped) == 2 * (T - cap)
    kept_rows = np.asarray(jnp.any(y != 0, axis=-1))
    assert kept_rows[:cap].all() and not kept_rows[cap:].any()  # the first tokens win


def test_switch_loss_at_perfect_balance_is_one_whatever_the_probabilities():
    counts = jnp.full((3, E), 5.0)
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(2), (3, E)), -1)
    np.testing.assert_allclose(moe.switch_loss(counts, probs), np.ones(3), rtol=1e-6)
    # All slots on one expert with all probability on it: the maximum, E.
    assert float(moe.switch_loss(jnp.eye(E)[0] * 7, jnp.eye(E)[0])) == pytest.approx(E)


def test_global_scope_counts_the_whole_batch_micro_batch_scope_each_sequence():
    # Sequence 0 sends everything to expert 0, sequence 1 to expert 1: balanced globally, not locally.
    counts = jnp.zeros((1, 2, E)).at[0, 0, 0].set(4.0).at[0, 1, 1].set(4.0)
    prob_sum = counts / K  # each token's probabilities sum to 1
    stats = {"expert_counts": counts, "router_prob_sum": prob_sum, "router_z": jnp.zeros((1,))}
    weights = moe.Balancing(balance_loss=1.0, router_z_loss=0.0, scope="global")
    glob, _ = moe.balancing_losses(stats, jnp.zeros((1, E)), weights)
    local, _ = moe.balancing_losses(stats, jnp.zeros((1, E)), moe.Balancing(1.0, 0.0, "micro_batch"))
    # global: f = P = (1/2, 1/2, 0...) -> E / 2; per sequence: f = P = e_i -> E.
    assert float(glob) == pytest.approx(E / 2) and float(local) == pytest.approx(E)
    # Counts of earlier micro-batches enter the global f.
    prior = jnp.zeros((1, E)).at[0, 2].set(8.0)
    with_prior, _ = moe.balancing_losses(stats, prior, weights)
    assert float(with_prior) == pytest.approx(E * (0.25 * 0.5 + 0.25 * 0.5))


def test_bias_update_matches_hand_computed_case():
    bias = jnp.array([[0.0, 0.1, -0.2, 0.0]])
    counts = jnp.array([[1.0, 5.0, 2.0, 4.0]])  # mean 3
    params = {"blocks": {"mlp": {"router": {"bias": bias, "kernel": jnp.ones((1, 2, 4))}}}, "embed": jnp.ones(3)}
    after_optimizer = jax.tree.map(lambda p: p - 1.0, params)  # what the optimizer did to the bias is ignored
    new = moe.update_router_bias(after_optimizer, params, counts, 0.01)
    np.testing.assert_allclose(new["blocks"]["mlp"]["router"]["bias"], [[0.01, 0.09, -0.19, -0.01]], rtol=1e-6)
    np.testing.assert_array_equal(new["blocks"]["mlp"]["router"]["kernel"], after_optimizer["blocks"]["mlp"]["router"]["kernel"])
    # Unrolled layers: one (E,) bias per MoE block, rows of counts in layer order.
    unrolled = {"blocks": {0: {"mlp": {"router": {"bias": jnp.zeros(4)}}}, 1: {"mlp": {"router": {"bias": jnp.zeros(4)}}}}}
    counts2 = jnp.array([[1.0, 5.0, 2.0, 4.0], [3.0, 3.0, 3.0, 3.0]])
    new = moe.update_router_bias(unrolled, unrolled, counts2, 0.5)
    np.testing.assert_allclose(new["blocks"][0]["mlp"]["router"]["bias"], [0.5, -0.5, 0.5, -0.5])
    np.testing.assert_allclose(new["blocks"][1]["mlp"]["router"]["bias"], np.zeros(4))


def test_parameter_counts_and_flops_count_routed_experts_by_use():
    from lm import config as config_lib
    from lm import loss, model

    dense, sparse = config_lib.from_preset("tiny"), config_lib.from_preset("moe-tiny")
    layers, d, f, n = sparse.n_layers, sparse.d_model, sparse.expert_mlp_dim, sparse.n_experts
    router = d * n + n
    experts = 3 * d * f * n
    assert model.param_counts(sparse).total == model.param_counts(dense).total + layers * (experts + router - 3 * d * dense.mlp_dim)
    # k f = the dense mlp_dim: the active count is the dense model's plus the routers.
    assert model.param_counts(sparse).active == model.param_counts(dense).total + layers * router
    assert loss.flops_per_token(sparse, 128) == loss.flops_per_token(dense, 128) + 6 * layers * d * n
    mixtral = model.param_counts(config_lib.from_preset("mixtral-8x7b"))
    assert 46.6e9 < mixtral.total < 46.8e9 and 12.8e9 < mixtral.active < 13.0e9  # Mixtral's published 46.7B / 12.9B


def _numpy_route(logits, k, *, normalize, scale, groups, topk_groups, bias=None):
    """DeepSeek-V2's gate (transformers' ``DeepseekV2TopkRouter``) in NumPy: softmax, groups scored by their best
    expert, the other groups' scores set to 0, top k, gates optionally renormalised, times ``scale``."""
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    choice = scores + (0.0 if bias is None else bias)
    experts, gates = [], []
    for row, s in zip(choice, scores, strict=True):
        best = np.argsort(-row.reshape(groups, -1).max(-1), kind="stable")[:topk_groups]
        masked = np.where(np.isin(np.arange(row.size) // (row.size // groups), best), row, 0.0)
        top = np.argsort(-masked, kind="stable")[:k]
        g = s[top] / s[top].sum() if normalize else s[top]
        experts.append(top)
        gates.append(scale * g)
    return np.array(experts), np.array(gates)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("groups,topk_groups,k", [(4, 2, 3), (8, 3, 6), (2, 1, 4)])
def test_group_limited_scaled_routing_matches_a_numpy_transcription(groups, topk_groups, k, normalize):
    logits = np.random.default_rng(groups + k).normal(size=(64, 16)).astype(np.float32) * 2
    route = jax.jit(lambda z: moe.route(z, jnp.zeros(16), k, "softmax", normalize, 16.0, groups, topk_groups))
    experts, gates, probs = route(logits)
    want_experts, want_gates = _numpy_route(logits, k, normalize=normalize, scale=16.0, groups=groups, topk_groups=topk_groups)
    np.testing.assert_array_equal(np.asarray(experts), want_experts)
    np.testing.assert_allclose(np.asarray(gates), want_gates, rtol=1e-5)
    group_of = np.asarray(experts) // (16 // groups)
    assert max(len(set(row)) for row in group_of) <= topk_groups
    greedy, _, _ = moe.route(logits, jnp.zeros(16), k, "softmax", normalize)
    assert not np.array_equal(np.asarray(greedy), want_experts)  # the group limit changes some choices
    np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-5)  # the balancing terms see the unscaled scores


def test_groups_are_ranked_by_the_biased_scores():
    logits = np.random.default_rng(0).normal(size=(32, 16)).astype(np.float32)
    bias = np.where(np.arange(16) // 4 == 3, 1.0, 0.0).astype(np.float32)  # group 3 always wins a place
    experts, _, _ = moe.route(logits, jnp.asarray(bias), 2, "softmax", False, 1.0, 4, 1)
    np.testing.assert_array_equal(np.asarray(experts) // 4, 3)
    want, _ = _numpy_route(logits, 2, normalize=False, scale=1.0, groups=4, topk_groups=1, bias=bias)
    np.testing.assert_array_equal(np.asarray(experts), want)


def test_default_routing_is_unchanged_by_the_group_and_scale_arguments():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(16, 8)), jnp.float32)
    base = moe.route(logits, jnp.zeros(8), 2, "softmax", True)
    for args in ((1.0, 1, 0), (1.0, 4, 4), (1.0, 4, 0)):
        for a, b in zip(base, moe.route(logits, jnp.zeros(8), 2, "softmax", True, *args), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(router_scale=0.0), "model.router_scale=0.0 must be > 0"),
        (dict(router_groups=3), "model.router_groups=3 must be >= 1 and divide model.n_experts=8"),
        (dict(router_groups=4, router_topk_groups=5), r"model.router_topk_groups=5 must be in \[0, model.router_groups=4\]"),
        (dict(router_groups=4, router_topk_groups=1, experts_per_token=3), "experts_per_token=3 exceeds the 2 experts"),
        (dict(experts_per_token=9), r"model.experts_per_token=9 must be in \[1, model.n_experts=8\]$"),  # once, without groups
    ],
)
def test_router_group_settings_are_validated(changes, message):
    from lm import config as config_lib

    base = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64, n_experts=8, experts_per_token=2)
    assert config_lib.ModelConfig(**base, router_groups=4, router_topk_groups=1).routable_experts == 2
    with pytest.raises(ValueError, match=message):
        config_lib.ModelConfig(**base | changes)
