"""The PyTorch twin of `experiments.bench_cpu_peer`: our weights map onto it one to one, and it computes our loss."""

import jax
import numpy as np
import pytest

from experiments import bench_cpu_peer, cli
from lm import config as model_config
from lm import model as model_lib

_SHAPE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=48, max_seq_len=64)


@pytest.fixture(scope="module", params=[True, False], ids=["scanned", "unrolled"])
def model(request):
    model_def = model_lib.define(model_config.ModelConfig(**_SHAPE, scan_layers=request.param))
    return model_def, model_lib.init_params(model_def, seed=0)


def test_twin_weights_are_ours_per_layer_in_torch_layout(model):
    model_def, params = model
    cfg = model_def.config
    weights = bench_cpu_peer.twin_weights(params, cfg)
    assert sum(w.size for w in weights.values()) == model_lib.count_params(model_def).total
    assert weights["1.k_proj"].shape == (cfg.n_kv_heads * cfg.head_dim, cfg.d_model)  # (out, in)
    layer = jax.tree.map(lambda a: a[1], params["blocks"]) if cfg.scan_layers else params["blocks"][1]
    np.testing.assert_array_equal(weights["1.down_proj"], np.asarray(layer["mlp"]["down_proj"]["kernel"]).T)
    np.testing.assert_array_equal(weights["embed"], np.asarray(params["embed"]["embedding"]))


@pytest.mark.parametrize(
    "overrides, field",
    [(dict(n_experts=4, experts_per_token=2), "n_experts"), (dict(qk_norm=True), "qk_norm"), (dict(tie_embeddings=False), "tie_embeddings")],
)
def test_a_model_the_twin_cannot_mirror_is_named(overrides, field):
    with pytest.raises(cli.UsageError, match=f"model.{field}"):
        bench_cpu_peer.check_twinnable(model_config.ModelConfig(**_SHAPE, **overrides))


def test_the_twin_computes_our_loss_on_our_weights(model):
    pytest.importorskip("torch", reason=bench_cpu_peer.TORCH_MISSING)
    model_def, params = model
    rows = np.random.default_rng(0).integers(0, model_def.config.vocab_size, (2, 17), dtype=np.int32)
    check = bench_cpu_peer.check_twin(model_def, params, rows)
    assert check["twin_params"] == check["params"]
    assert check["twin_loss"] == pytest.approx(check["loss"], rel=1e-5)
    assert check["loss"] == pytest.approx(np.log(model_def.config.vocab_size), rel=0.2)  # near-uniform at init


def test_the_product_shapes_cover_every_weight_matrix_of_the_step(model):
    """``--products`` times the layers' matrices: with the tied head counted once, their sizes add up
    to the parameter count less the norm scales (two per block and the final one)."""
    model_def, _ = model
    cfg = model_def.config
    shapes = bench_cpu_peer.layer_shapes(cfg)
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    assert sum(n_in * n_out * count for (n_in, n_out), count in shapes.items()) == model_lib.count_params(model_def).total - norms
    assert shapes[(cfg.d_model, cfg.mlp_dim)] == 2 * cfg.n_layers  # gate and up


def test_the_device_resolves_to_the_cpu_here_and_cuda_without_a_gpu_is_named():
    torch = pytest.importorskip("torch", reason=bench_cpu_peer.TORCH_MISSING)
    if torch.cuda.is_available() and jax.default_backend() in ("gpu", "cuda"):
        assert bench_cpu_peer.resolve_device("auto") == "cuda"
        return
    assert bench_cpu_peer.resolve_device("auto") == bench_cpu_peer.resolve_device("cpu") == "cpu"
    with pytest.raises(cli.UsageError, match="--device=cuda needs a GPU that PyTorch .* and JAX .* both see; use --device=cpu"):
        bench_cpu_peer.resolve_device("cuda")


def test_bfloat16_weights_map_to_float32_and_the_twin_steps_on_the_cpu(model):
    pytest.importorskip("torch", reason=bench_cpu_peer.TORCH_MISSING)
    model_def, params = model
    cfg = model_def.config
    bf16 = jax.tree.map(lambda a: a.astype(jax.numpy.bfloat16), params)
    weights = bench_cpu_peer.twin_weights(bf16, cfg)
    assert {w.dtype for w in weights.values()} == {np.dtype(np.float32)}
    rows = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 17), dtype=np.int32)
    assert bench_cpu_peer.twin_step(cfg, params, rows, learning_rate=1e-2, device="cpu")(2) > 0
