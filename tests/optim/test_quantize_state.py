"""quantize_state: leaves, the quantized step, bytes, sharding (its tiny LM run: tests/experiments/test_tiny_lm_runs.py)."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs import default
from optim import adamw, build, labels, lion, memory
from optim import quantization as qz
from optim.quantize_state import QuantizedState, quantize_state
from sharding import partition


def _tree():
    return {
        "embed": {"embedding": jnp.zeros((300, 16))},  # 4800 elements, but an embedding table
        "blocks": {"w": jnp.zeros((2, 64, 64)), "norm": jnp.zeros((8, 512))},
        "small": jnp.zeros((16, 16)),  # under 4096 elements
        "bias": jnp.zeros((5000,)),
    }


def test_which_leaves_are_quantized_and_how():
    params = _tree()
    s8 = jax.eval_shape(quantize_state(optax.adamw(1e-3), 8).init, params)
    adam = s8.view()[0]
    assert isinstance(s8, QuantizedState) and adam.count.dtype == jnp.int32
    for k in ("w", "norm"):
        mu, nu = adam.mu["blocks"][k], adam.nu["blocks"][k]
        assert (type(mu), mu.code, mu.bits) == (qz.BlockQuantized, "signed", 8)
        assert (type(nu), nu.code, nu.codes.dtype) == (qz.BlockQuantized, "unsigned", jnp.uint8)
    assert adam.mu["embed"]["embedding"].dtype == jnp.float32 and adam.nu["small"].dtype == jnp.float32

    adam4 = jax.eval_shape(quantize_state(optax.adamw(1e-3), 4).init, params).view()[0]
    w_mu, w_nu, b_nu = adam4.mu["blocks"]["w"], adam4.nu["blocks"]["w"], adam4.nu["bias"]
    assert (type(w_mu), w_mu.code, w_mu.tile, w_mu.codes.shape) == (qz.BlockQuantized, "signed", (8, 16), (2, 64, 32))
    assert (type(w_nu), w_nu.code) == (qz.Rank1Quantized, "linear")
    assert (w_nu.row.shape, w_nu.col.shape) == ((2, 64, 1), (2, 1, 64))
    assert (type(b_nu), b_nu.code, b_nu.absmax.shape) == (qz.BlockQuantized, "linear", (40,))  # 1-D: blocks of 128

    everything = quantize_state(optax.adam(1e-3), 8, mask=lambda p: jax.tree.map(lambda _: True, p))
    forced = jax.eval_shape(everything.init, params).view()[0]
    assert qz.is_quantized(forced.mu["embed"]["embedding"]) and qz.is_quantized(forced.mu["small"])


def test_step_is_dequantize_update_requantize():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(64, 96)), jnp.float32)}
    inner = optax.adamw(1e-2)
    for bits in (8, 4):
        tx = quantize_state(inner, bits)
        state = tx.init(params)
        step = jax.jit(tx.update)
        for t in range(3):
            grads = {"w": jnp.asarray(rng.normal(size=(64, 96)), jnp.float32)}
            fp32 = jax.tree.map(
                lambda x: qz.dequantize(x) if qz.is_quantized(x) else x, state.view(), is_leaf=qz.is_quantized
            )
            want_updates, want_inner = inner.update(grads, fp32, params)
            updates, state = step(grads, state, params)
            np.testing.assert_allclose(updates["w"], want_updates["w"], rtol=1e-6, atol=1e-9)
            mu, nu = state.view()[0].mu["w"], state.view()[0].nu["w"]
            want_mu = qz.quantize_blockwise(want_inner[0].mu["w"], bits=bits, block_size=mu.tile[0] * mu.tile[1])
            if bits == 8:
                want_nu = qz.quantize_blockwise(want_inner[0].nu["w"], bits=8, code="unsigned")
            else:
                want_nu = qz.quantize_rank1(want_inner[0].nu["w"], bits=4, code="linear")
            for got, want in ((mu, want_mu), (nu, want_nu)):  # jit and eager differ in the last bit (FMA)
                assert jax.tree.structure(got) == jax.tree.structure(want)
                assert np.mean(np.asarray(got.codes) == np.asarray(want.codes)) > 0.995
                for a, b in zip(jax.tree.leaves(got)[1:], jax.tree.leaves(want)[1:], strict=True):
                    np.testing.assert_allclose(a, b, rtol=1e-6)
        assert int(state.count) == 3


def test_quantized_adam_tracks_fp32_on_a_noisy_quadratic():
    rng = np.random.default_rng(1)
    target = jnp.asarray(rng.normal(size=(64, 128)), jnp.float32)
    scale = jnp.linspace(0.5, 2.0, 128)

    def loss(w):
        return jnp.sum((w - target) ** 2 * scale) / 64

    def final_loss(tx):
        params = {"w": jnp.zeros((64, 128))}
        state = tx.init(params)

        @jax.jit
        def step(params, state, key):
            g = jax.grad(loss)(params["w"]) + 0.03 * scale * jax.random.normal(key, (64, 128))
            updates, state = tx.update({"w": g}, state, params)
            return optax.apply_updates(params, updates), state

        for t in range(100):
            params, state = step(params, state, jax.random.key(t))
        return float(loss(params["w"]))

    schedule = optax.cosine_decay_schedule(3e-2, 100, alpha=0.01)
    fp32 = final_loss(optax.adam(schedule))
    assert fp32 < 0.2 * float(loss(jnp.zeros((64, 128))))
    assert final_loss(quantize_state(optax.adam(schedule), 8)) / fp32 < 1.02
    assert final_loss(quantize_state(optax.adam(schedule), 8, stochastic_rounding=True, seed=3)) / fp32 < 1.02
    # 4 bits: a 4-bit first moment rounds small EMA steps away; ~1.15x here, the LM test below is the real check.
    assert final_loss(quantize_state(optax.adam(schedule), 4)) / fp32 < 1.3


def _small_tree():
    """The `small` preset (d=512, L=8, H=8, K=4, hd=64, F=1152, vocab=259, tied) as shapes only."""
    d, n, h, k, hd, f, vocab = 512, 8, 8, 4, 64, 1152, 259

    def s(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    return {
        "embed": {"embedding": s(vocab, d)},
        "blocks": {
            "attn_norm": {"scale": s(n, d)},
            "attn": {
                "q_proj": {"kernel": s(n, d, h * hd)},
                "k_proj": {"kernel": s(n, d, k * hd)},
                "v_proj": {"kernel": s(n, d, k * hd)},
                "o_proj": {"kernel": s(n, h * hd, d)},
            },
            "mlp_norm": {"scale": s(n, d)},
            "mlp": {
                "gate_proj": {"kernel": s(n, d, f)},
                "up_proj": {"kernel": s(n, d, f)},
                "down_proj": {"kernel": s(n, f, d)},
            },
        },
        "final_norm": {"scale": s(d)},
    }


def _bytes_per_param_without_embeddings(tx):
    """State bytes per parameter, embedding tables (kept in fp32 by default) excluded from both counts."""
    params = _small_tree()
    state = jax.eval_shape(tx.init, params)
    kept = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state) if not labels.is_embedding_path(path)]
    n = sum(p.size for path, p in jax.tree_util.tree_leaves_with_path(params) if not labels.is_embedding_path(path))
    return memory.state_bytes(kept) / n


def test_state_bytes_per_parameter_on_the_small_tree():
    assert _bytes_per_param_without_embeddings(adamw.adamw(1e-3)) == pytest.approx(8.0, abs=1e-5)
    assert _bytes_per_param_without_embeddings(quantize_state(adamw.adamw(1e-3), 8)) <= 2.05
    assert _bytes_per_param_without_embeddings(quantize_state(adamw.adamw(1e-3), 4)) <= 1.10
    assert _bytes_per_param_without_embeddings(quantize_state(lion.lion(1e-3), 8)) <= 1.03


def test_state_bytes_is_exact():
    state = {
        "a": jnp.zeros((3, 5), jnp.bfloat16),
        "b": np.zeros(7, np.int64),
        "c": 1.0,
        "d": jax.ShapeDtypeStruct((9,), jnp.int4),
    }
    assert memory.state_bytes(state) == 3 * 5 * 2 + 7 * 8 + 8 + 5
    q = qz.quantize_blockwise(jnp.zeros((40, 70)), bits=4, block_size=128)
    assert memory.state_bytes(q) == 40 * 35 + 5 * 5 * 4


@pytest.mark.devices(8)
@pytest.mark.parametrize("bits", [8, 4])
def test_sharded_state_is_one_eighth_per_device_and_matches_unsharded(bits):
    rng = np.random.default_rng(2)
    params = {
        "q": rng.normal(size=(2, 128, 64)).astype(np.float32),  # fsdp on the rows
        "o": rng.normal(size=(2, 64, 256)).astype(np.float32),  # fsdp on the last axis: 32 columns per device
    }
    grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
    tx = quantize_state(optax.adamw(1e-2), bits)
    want_updates, want_state = jax.jit(tx.update)(grads, tx.init(params), params)

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        shard = {
            "q": jax.NamedSharding(mesh, jax.P(None, "fsdp", None)),
            "o": jax.NamedSharding(mesh, jax.P(None, None, "fsdp")),
        }
        sp, sg = jax.device_put(params, shard), jax.device_put(grads, shard)
        state_sh = partition.state_shardings(jax.eval_shape(tx.init, sp), sp, shard)
        state = jax.jit(tx.init, out_shardings=state_sh)(sp)
        updates, new_state = jax.jit(tx.update, out_shardings=(shard, state_sh))(sg, state, sp)

    quantized = [x for x in jax.tree.leaves(new_state.view(), is_leaf=qz.is_quantized) if qz.is_quantized(x)]
    assert len(quantized) == 4
    arrays = jax.tree.leaves(quantized)  # codes, absmax, rank-1 row and column maxima
    total = sum(a.nbytes for a in arrays)
    assert all(8 * sum(a.addressable_shards[i].data.nbytes for a in arrays) == total for i in range(8))
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_array_equal(a, b)
    for k in params:
        np.testing.assert_allclose(updates[k], want_updates[k], rtol=1e-6, atol=1e-9)


def test_wraps_injected_hyperparams_and_rejects_bad_bits():
    params = {"w": jnp.ones((64, 64))}
    tx = quantize_state(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3), 8)
    updates, state = jax.jit(tx.update)({"w": jnp.ones((64, 64))}, tx.init(params), params)
    assert float(state.view().hyperparams["learning_rate"]) == pytest.approx(1e-3)
    assert qz.is_quantized(state.view().inner_state[0].mu["w"])
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quantize_state(optax.adam(1e-3), 3)
    config = default.get_config().optimizer
    config.state_bits = 2
    with pytest.raises(ValueError, match="state_bits"):
        build.build(config, 100)


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_kronecker_factors_stay_fp32_while_moments_are_quantized(name):
    """Shampoo's / SOAP's (n, b, b) statistics, roots and bases are not parameter-shaped: never quantized."""
    from optim import blocking, shampoo, soap

    params = {"w": jnp.ones((128, 96)), "v": jnp.ones((64, 128))}
    inner = shampoo.scale_by_shampoo(block_size=64) if name == "shampoo" else soap.scale_by_soap()
    tx = quantize_state(inner, 8)
    state = tx.init(params)
    is_stack = lambda x: isinstance(x, blocking.BlockStacks)  # noqa: E731
    stacks = [n for n in jax.tree.leaves(state.view(), is_leaf=is_stack) if is_stack(n)]
    assert stacks and all(v.dtype == jnp.float32 and v.ndim == 3 for s in stacks for v in s.values())
    moments = [n for n in jax.tree.leaves(state.view(), is_leaf=qz.is_quantized) if qz.is_quantized(n)]
    assert len(moments) == 4  # momentum + graft second moment (shampoo) / mu + nu (soap), per parameter
    updates, state = jax.jit(tx.update)(jax.tree.map(lambda p: 0.1 * p, params), state, params)
    assert all(np.isfinite(u).all() for u in jax.tree.leaves(updates))
