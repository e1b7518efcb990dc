"""model.attention: every implementation trains like `xla` (auto's choice: tests/kernels_pallas/attention/test_attention_choice.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import train_lib
from lm import attention as attention_lib
from lm import config as config_lib
from lm import model as model_lib
from lm.data import corpus
from optim.muon_clip import muon_clip
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib


def test_config_names_the_implementations():
    with pytest.raises(ValueError, match="model.attention='flash' must be one of auto, xla, cudnn, pallas"):
        config_lib.from_preset("tiny", attention="flash")


def _qkv(dtype=jnp.bfloat16, head_dim=64, v_head_dim=None):
    q = jnp.zeros((2, 16, 4, head_dim), dtype)
    k = jnp.zeros((2, 16, 2, head_dim), dtype)
    return q, k, jnp.zeros((2, 16, 2, v_head_dim or head_dim), dtype)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
def test_cudnn_matches_xla_with_max_logits():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(x.shape), jnp.bfloat16) for x in _qkv())
    out, max_logits = attention_lib.attend(q, k, v, implementation="cudnn", track_max_logits=True)
    ref_out, ref_max = attention_lib.attend(q, k, v, implementation="xla", track_max_logits=True)
    np.testing.assert_allclose(np.float32(out), np.float32(ref_out), atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(max_logits, ref_max, rtol=1e-5)


def _train_losses(attention, mesh_spec, *, steps=3, batch=8, seq_len=32):
    """`tiny` with MuonClip at tau=1: QK-clip is active from step 1, fed by the model's max logits."""
    cfg = config_lib.from_preset("tiny", attention=attention, track_attn_logits=True)
    model_def = model_lib.define(cfg)
    tx = muon_clip(1e-2, tau=1.0)
    mesh = mesh_lib.make_mesh(mesh_spec, jax.devices()[:1] if mesh_spec == "data:1" else None)
    rules = rules_lib.make_rules("tp")
    shardings = train_lib.make_shardings(model_def, tx, mesh, rules)
    stream = corpus.load("")["validation"]
    batches = np.asarray(stream[: steps * batch * (seq_len + 1)], np.int32).reshape(steps, batch, seq_len + 1)
    losses = []
    with jax.set_mesh(mesh), partition.use_rules(rules):
        state = train_lib.init_state(model_def, tx, 0, shardings)
        step = train_lib.jit_train_step(train_lib.make_train_step(model_def, tx), shardings)
        for tokens in batches:
            state, metrics = step(state, train_lib.global_batch(tokens, shardings))
            losses.append(float(metrics["loss"]))
    return np.array(losses)


@pytest.mark.devices(8)
def test_pallas_trains_like_xla_on_a_sharded_mesh():
    """Pallas on a data x fsdp x tensor mesh under tp rules (batch and heads sharded inside the attention,
    max logits reduced over the batch shards) against XLA on one device; interpret-mode kernels on CPU.
    Float32 attention agrees to ~1e-6, so the losses agree to 1e-5."""
    xla, pallas = _train_losses("xla", "data:1"), _train_losses("pallas", "data:2,fsdp:2,tensor:2")
    assert np.all(np.isfinite(xla)) and xla[-1] < xla[0]
    np.testing.assert_allclose(pallas, xla, rtol=1e-5)


@pytest.mark.devices(8)
def test_pallas_refuses_a_sharded_sequence():
    cfg = config_lib.from_preset("tiny", attention="pallas")
    model_def = model_lib.define(cfg)
    mesh = mesh_lib.make_mesh("data:2,seq:2,tensor:2")
    with jax.set_mesh(mesh), partition.use_rules(rules_lib.make_rules("sp")), pytest.raises(ValueError, match="'seq' whole"):
        jax.eval_shape(lambda p: model_lib.apply(model_def, p, jnp.zeros((4, 16), jnp.int32)), model_def.abstract_params)
