"""MuonClip (optim/muon_clip.py): QK-clip on a toy attention, NumPy reference, errors, the sharded LM.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import optax
import pytest

from experiments import trainer
from experiments.configs import default
from optim import build
from optim.muon import muon
from optim.muon_clip import muon_clip, qk_clip, scale_by_qk_clip


def toy_attention(layers=2, d=16, heads=4, kv_heads=2, head_dim=4, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return {
        "blocks": {
            "attn": {
                "q_proj": {"kernel": jnp.float32(scale * rng.standard_normal((layers, d, heads * head_dim)))},
                "k_proj": {"kernel": jnp.float32(scale * rng.standard_normal((layers, d, kv_heads * head_dim)))},
            }
        }
    }


def attention_logits(attn, x, heads):
    """q.k / sqrt(hd), shape (layers, batch, heads, seq, seq); GQA: query head h reads kv head h // G."""
    q = jnp.einsum("bsd,lde->lbse", x, attn["q_proj"]["kernel"])
    k = jnp.einsum("bsd,lde->lbse", x, attn["k_proj"]["kernel"])
    hd = q.shape[-1] // heads
    q = q.reshape(*q.shape[:-1], heads, hd)
    k = k.reshape(*k.shape[:-1], -1, hd)
    k = jnp.repeat(k, heads // k.shape[-2], axis=-2)
    return jnp.einsum("lbshd,lbthd->lbhst", q, k) / np.sqrt(hd)


def max_logits(attn, x, heads):
    """Per-layer, per-query-head max over the batch: the model's ``attn_max_logits``."""
    return jnp.max(attention_logits(attn, x, heads), axis=(1, 3, 4))


def np_qk_clip(params, logits, tau):
    """Kimi K2's QK-clip (arXiv:2507.20534) on stacked q/k kernels; GQA puts the factor on q."""
    params = jax.tree.map(np.array, params)
    attn = params["blocks"]["attn"]
    q, k = attn["q_proj"]["kernel"], attn["k_proj"]["kernel"]
    heads = logits.shape[-1]
    hd = q.shape[-1] // heads
    gamma = np.where(logits > tau, tau / logits, 1.0)
    if k.shape[-1] == q.shape[-1]:
        attn["q_proj"]["kernel"] = q * np.repeat(np.sqrt(gamma), hd, axis=-1)[:, None, :]
        attn["k_proj"]["kernel"] = k * np.repeat(np.sqrt(gamma), hd, axis=-1)[:, None, :]
    else:
        attn["q_proj"]["kernel"] = q * np.repeat(gamma, hd, axis=-1)[:, None, :]
    return params


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_qk_clip_caps_exceeding_heads_at_tau_and_leaves_others(kv_heads):
    params = toy_attention(kv_heads=kv_heads)
    x = jnp.float32(np.random.default_rng(1).standard_normal((3, 5, 16)))
    before = max_logits(params["blocks"]["attn"], x, 4)
    tau = float(jnp.median(before))
    clipped = qk_clip(params, before, tau)
    after = max_logits(clipped["blocks"]["attn"], x, 4)
    over = np.asarray(before > tau)
    assert over.any() and not over.all()
    np.testing.assert_allclose(np.asarray(after)[over], tau, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(after)[~over], np.asarray(before)[~over], rtol=1e-6)
    ref.assert_trees_close(clipped, np_qk_clip(params, np.asarray(before, np.float64), tau), rtol=1e-6, atol=0)
    if kv_heads < 4:  # a shared key head is never rescaled
        np.testing.assert_array_equal(
            clipped["blocks"]["attn"]["k_proj"]["kernel"], params["blocks"]["attn"]["k_proj"]["kernel"]
        )


def test_unrolled_layers_take_their_row_of_the_logits():
    stacked = toy_attention(kv_heads=4)
    unrolled = {
        "blocks": {str(i): {"attn": jax.tree.map(lambda a, i=i: a[i], stacked["blocks"]["attn"])} for i in range(2)}
    }
    logits = jnp.float32([[150.0, 50.0, 120.0, 80.0], [90.0, 300.0, 101.0, 10.0]])
    want = qk_clip(stacked, logits, 100.0)["blocks"]["attn"]
    got = qk_clip(unrolled, logits, 100.0)["blocks"]
    for i in range(2):
        ref.assert_trees_close(got[str(i)]["attn"], jax.tree.map(lambda a, i=i: a[i], want), rtol=0, atol=0)


def test_matches_numpy_reference_step_by_step():
    params = ref.f32(ref.model_tree(0, heads=4, kv_heads=2, scale=0.1))
    grads_seq = ref.grads_sequence(params)
    logits_seq = [
        np.float32(np.random.default_rng(50 + t).uniform(50, 150, (2, 4))).astype(np.float64) for t in range(6)
    ]
    lr, adam_lr, wd, tau = 0.05, 0.01, 0.1, 100.0
    direction = ref.muon_direction(beta=0.95, form="ema", nesterov=True, coeffs="jordan", steps=0, scale="moonlight")
    expected = ref.run_matrix_family(
        params,
        grads_seq,
        direction,
        lr=lr,
        adam_lr=adam_lr,
        wd=wd,
        post_step=lambda t, p: np_qk_clip(p, logits_seq[t], tau),
    )
    tx = muon_clip(lr, tau=tau, weight_decay=wd, adam_lr_ratio=adam_lr / lr)
    extra = [{"attn_max_logits": jnp.float32(s)} for s in logits_seq]
    ref.assert_trees_close(ref.run_jax(tx, params, grads_seq, extra), expected)


def train_toy(tx, steps=60, tau_in_loop=True):
    """Trains q/k to align (loss = -mean logit); returns the max logit seen at every step."""
    params = toy_attention(layers=1, scale=0.3, seed=2)
    x = jnp.float32(np.random.default_rng(3).standard_normal((4, 6, 16)))

    def loss(p):
        return -jnp.mean(attention_logits(p["blocks"]["attn"], x, 4))

    @jax.jit
    def step(p, s):
        logits = max_logits(p["blocks"]["attn"], x, 4)
        g = jax.grad(loss)(p)
        extra = {"attn_max_logits": logits} if tau_in_loop else {}
        u, s = tx.update(g, s, p, **extra)
        return optax.apply_updates(p, u), s, jnp.max(logits)

    state = tx.init(params)
    seen = []
    for _ in range(steps):
        params, state, top = step(params, state)
        seen.append(float(top))
    return np.array(seen)


def test_toy_attention_whose_logits_blow_up_is_held_at_tau():
    tau = 10.0
    free = train_toy(muon(0.1, weight_decay=0.0), tau_in_loop=False)
    held = train_toy(muon_clip(0.1, tau=tau, weight_decay=0.0))
    assert free[-1] > 5 * tau  # without QK-clip the logits keep growing
    assert held.max() < 1.2 * tau  # with it they exceed tau by one step's growth at most (~1.1x here)
    assert held[-10:].min() > 0.9 * tau  # and are held there, not collapsed


def test_errors_name_the_fix():
    params = toy_attention()
    grads = jax.tree.map(jnp.zeros_like, params)
    tx = muon_clip(0.01)
    state = tx.init(params)
    with pytest.raises(ValueError, match="track_attn_logits"):
        tx.update(grads, state, params)
    with pytest.raises(ValueError, match="pass params"):
        scale_by_qk_clip().update(grads, None, attn_max_logits=jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="does not match"):
        tx.update(grads, state, params, attn_max_logits=jnp.ones((3, 4)))
    normed = {"blocks": {"attn": dict(params["blocks"]["attn"], q_norm={"scale": jnp.ones((2, 4))})}}
    with pytest.raises(ValueError, match="qk_norm=False"):
        qk_clip(normed, jnp.ones((2, 4)))
    with pytest.raises(ValueError, match=r"no query \(q_proj or q_up\)"):
        qk_clip({"w": jnp.ones((4, 4))}, jnp.ones((4,)))


def test_num_clipped_counts_the_heads_over_tau():
    params = toy_attention()
    grads = jax.tree.map(jnp.ones_like, params)
    logits = jnp.float32([[150.0, 50.0, 120.0, 80.0], [90.0, 300.0, 101.0, 10.0]])
    assert int(jax.jit(scale_by_qk_clip(100.0).update)(grads, None, params, attn_max_logits=logits)[1].num_clipped) == 4


@pytest.mark.devices(8)
def test_sharded_lm_run_feeds_the_models_logits_to_the_clip(tmp_path):
    """End to end: `tiny` LM on an fsdp:8 mesh, the model's aux logits reach QK-clip through the
    training loop (with a tau low enough to clip from the first step), gather-to-owner Newton-Schulz."""
    config = default.get_config()
    config.optimizer = default.optimizer_config("muon_clip", learning_rate=1e-2)
    config.optimizer.warmup_steps = 0
    config.optimizer.muon_clip.tau = 1.0
    config.optimizer.muon_clip.ns_sharding = "owner"
    config.model.track_attn_logits = True
    config.mesh = "fsdp:8"
    config.steps, config.data.seq_len, config.batch_size = 3, 32, 16
    config.eval_every, config.eval_batches, config.checkpoint_every = 3, 1, 3
    summary = trainer.run(config, tmp_path)
    assert summary["steps"] == 3 and np.isfinite(summary["final_train_loss"])


def test_cautious_masks_muons_update_but_not_the_clip():
    """``optimizer.cautious`` with muon_clip: cautious Muon first, then QK-clip lands on tau exactly."""
    params = toy_attention(scale=3.0)
    grads = jax.tree.map(lambda p: jnp.float32(np.random.default_rng(1).standard_normal(p.shape)), params)
    logits = jnp.float32([[150.0, 50.0, 120.0, 80.0], [90.0, 300.0, 101.0, 10.0]])
    config = default.optimizer_config("muon_clip", learning_rate=0.01)
    config.warmup_steps, config.grad_clip_norm, config.cautious = 0, 0.0, True
    built = build.build(config, total_steps=10)
    updates, _ = jax.jit(built.update)(grads, built.init(params), params, attn_max_logits=logits)
    got = optax.apply_updates(params, updates)

    from optim.cautious import cautious

    schedule = build.learning_rate_fn(config, 10)
    inner = cautious(muon(schedule, weight_decay=0.1))
    masked, _ = inner.update(grads, inner.init(params), params)
    want = np_qk_clip(optax.apply_updates(params, masked), np.asarray(logits), 100.0)
    for path in (("q_proj",), ("k_proj",)):
        np.testing.assert_allclose(
            got["blocks"]["attn"][path[0]]["kernel"], want["blocks"]["attn"][path[0]]["kernel"], rtol=2e-5, atol=1e-6
        )
    assert "cautious" not in config.muon_clip  # the common key, not a family key


@pytest.mark.parametrize("q_lora_rank", [0, 12], ids=["q_proj", "q_down_up"])
def test_mla_heads_over_tau_land_on_tau_and_the_shared_rope_key_is_left_alone(q_lora_rank):
    """Kimi K2's MLA rule on `lm.mla`: no-RoPE query/key columns by sqrt(gamma), RoPE query columns by gamma."""
    from flax import nnx

    from lm import config as config_lib
    from lm.mla import MultiHeadLatentAttention

    cfg = config_lib.ModelConfig(
        d_model=32, n_heads=4, head_dim=8, attention_type="mla", kv_lora_rank=16, q_lora_rank=q_lora_rank,
        rope_head_dim=4, v_head_dim=6, track_attn_logits=True, attention="xla",
    )  # fmt: skip
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda p: 4.0 * p, nnx.to_pure_dict(state))  # logits of a few units, not ~0
    x = jax.random.normal(jax.random.key(1), (2, 7, 32))

    @jax.jit
    def run(params):
        new_state = nnx.State(state)
        nnx.replace_by_pure_dict(new_state, params)
        return nnx.merge(graphdef, new_state)(x)[1]

    before = run(params)
    tau = float(jnp.median(before))
    clipped = jax.jit(qk_clip, static_argnums=2)(params, before, tau)
    after = run(clipped)
    over = np.asarray(before > tau)
    assert over.any() and not over.all()
    np.testing.assert_allclose(np.asarray(after)[over], tau, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(after)[~over], np.asarray(before)[~over], rtol=1e-5)
    # By hand: head h of the query kernel is 8 no-RoPE columns then 4 RoPE ones; k_up has 8 per head.
    gamma = np.where(over, tau / np.asarray(before), 1.0)
    q_name = "q_up" if q_lora_rank else "q_proj"
    q_factor = np.concatenate([np.repeat(np.sqrt(gamma)[:, None], 8, 1), np.repeat(gamma[:, None], 4, 1)], 1).reshape(-1)
    np.testing.assert_allclose(clipped[q_name]["kernel"], params[q_name]["kernel"] * q_factor, rtol=1e-6)
    np.testing.assert_allclose(clipped["k_up"]["kernel"], params["k_up"]["kernel"] * np.repeat(np.sqrt(gamma), 8), rtol=1e-6)
    for untouched in ("k_rope_proj", "v_up", "kv_down", "o_proj", *(("q_down",) if q_lora_rank else ())):
        np.testing.assert_array_equal(clipped[untouched]["kernel"], params[untouched]["kernel"])
