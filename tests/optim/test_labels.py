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


def test_shapes_alone_decide_for_anonymous_trees():
    tree = {"w": jnp.zeros((3, 4)), "v": jnp.zeros((4,)), "thin": jnp.zeros((1, 9)), "stack": jnp.zeros((2, 3, 4))}
    assert labels.matrix_labels(tree) == {"w": "matrix", "v": "adam", "thin": "adam", "stack": "matrix"}
    assert labels.decay_mask(tree) == {"w": True, "v": False, "thin": True, "stack": True}
