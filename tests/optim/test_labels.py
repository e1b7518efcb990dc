import jax
import jax.numpy as jnp

from lm import config as config_lib
from lm import model as model_lib
from optim import labels


def _flat(tree):
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_model_parameters_are_routed_by_role():
    for scan in (True, False):
        params = model_lib.define(config_lib.from_preset("tiny", qk_norm=True, tie_embeddings=False, scan_layers=scan)).abstract_params
        routed = _flat(labels.matrix_labels(params))
        matrices = {k for k, v in routed.items() if v == labels.MATRIX}
        assert matrices and all(k.endswith("kernel") and "lm_head" not in k for k in matrices)
        assert routed["embed/embedding"] == routed["lm_head/kernel"] == labels.ADAM
        assert all(v == labels.ADAM for k, v in routed.items() if k.endswith("scale"))
        assert len(matrices) == 7 * (1 if scan else 4)


def test_weight_decay_follows_the_role_layer_for_layer():
    """Scanned and unscanned MoE models get the same decay mask: kernels and embeddings decayed,
    norm scales (stacked ``(layers, d)`` when scanned) and the router bias never."""
    masks = {}
    for scan in (True, False):
        cfg = config_lib.from_preset("moe-tiny", n_layers=2, qk_norm=True, scan_layers=scan)
        params = model_lib.define(cfg).abstract_params
        if not scan:
            params = dict(params, blocks=jax.tree.map(lambda *x: x[0], *params["blocks"].values()))
        masks[scan] = _flat(labels.decay_mask(params))
    assert masks[True] == masks[False]
    assert masks[True]["blocks/attn_norm/scale"] is masks[True]["blocks/mlp/router/bias"] is False
    assert masks[True]["blocks/mlp/router/kernel"] is masks[True]["embed/embedding"] is True


def test_adamw_never_decays_a_stacked_norm_scale():
    """issue 34 item 1's reproduction: zero gradients, so any update is weight decay."""
    from optim import registry

    tx = registry.spec_class("adamw")(learning_rate=1e-2, weight_decay=0.1).transform()
    params = {"blocks": {"attn_norm": {"scale": jnp.ones((2, 8))}}, "final_norm": {"scale": jnp.ones((8,))}}
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(updates))


def test_shapes_alone_decide_for_anonymous_trees():
    tree = {"w": jnp.zeros((3, 4)), "v": jnp.zeros((4,)), "thin": jnp.zeros((1, 9)), "stack": jnp.zeros((2, 3, 4))}
    assert labels.matrix_labels(tree) == {"w": "matrix", "v": "adam", "thin": "adam", "stack": "matrix"}
    assert labels.decay_mask(tree) == {"w": True, "v": False, "thin": True, "stack": True}
