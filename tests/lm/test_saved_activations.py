"""What the backward pass keeps: no float32 copies of bf16 activations, and no SwiGLU products.

`lm.layers.rms_norm`, `lm.layers.swiglu_gate` and `lm.loss.cross_entropy` recompute their elementwise
work in the backward pass. Left to autodiff they keep float32 copies of every normalised activation and
the loss's float32 ``exp(logits)``, and ``silu(gate)`` beside ``gate``: buffers that an unrolled XLA
program fuses away but a scan over layers must write per layer (`lm.remat`).
"""

import jax
import jax.numpy as jnp
import pytest

from lm import config as config_lib
from lm import model as model_lib
from lm.loss import cross_entropy

BATCH, SEQ = 3, 40  # distinct from every model width, so activations are recognisable by shape


def _residuals(cfg):
    model_def = model_lib.define(cfg)

    def residuals(params, tokens):
        loss = lambda p: cross_entropy(model_lib.apply(model_def, p, tokens[:, :-1]), tokens[:, 1:])[0]  # noqa: E731
        return jax.tree.leaves(jax.vjp(loss, params)[1])  # the pullback closes over the residuals

    return jax.eval_shape(residuals, model_def.abstract_params, jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32))


def _is_activation(shape):
    return any(shape[i : i + 2] == (BATCH, SEQ) for i in range(len(shape) - 1))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_bf16_backward_keeps_no_float32_activation(scan_layers):
    residuals = _residuals(config_lib.from_preset("tiny", dtype="bfloat16", scan_layers=scan_layers))
    kept32 = [r.shape for r in residuals if _is_activation(r.shape) and r.dtype == jnp.float32]
    assert kept32 == []
    assert any(_is_activation(r.shape) and r.dtype == jnp.bfloat16 for r in residuals)


def test_swiglu_keeps_its_two_projections_and_its_output_only():
    cfg = config_lib.from_preset("tiny", dtype="bfloat16", scan_layers=False)
    # (batch, seq, mlp), or (batch * seq, mlp) where a projection's input is kept flattened (`lm.layers.project`)
    hidden = [r for r in _residuals(cfg) if r.shape in ((BATCH, SEQ, cfg.mlp_dim), (BATCH * SEQ, cfg.mlp_dim))]
    assert len(hidden) == 3 * cfg.n_layers  # gate(x), up(x) and silu(gate) * up for the down projection
