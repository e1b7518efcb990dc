"""The float32 precision of the kernels' dots follows `jax.default_matmul_precision` (what tests/conftest.py sets).

Pallas Triton lowers a float32 ``dot_general`` of precision DEFAULT (or HIGH) to ``tl.dot`` in TF32 and one of
HIGHEST in IEEE float32 (`jax._src.pallas.triton.lowering._dot_general_lowering`); `jax.lax.dot_general` fills
in the default precision at trace time. So a GPU test run at ``highest`` checks the kernels in IEEE float32,
at the bounds a CPU run uses, and a training run keeps TF32.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import backends
from kernels_pallas.attention import flash_attention
from kernels_pallas.gmm import api as gmm_api


def _attention_grads(q, k, v):
    return jax.grad(lambda q, k, v: flash_attention(q, k, v, backend="triton").sum(), argnums=(0, 1, 2))(q, k, v)


def _gmm_grads(lhs, rhs, group_sizes):
    return jax.grad(lambda a, b: gmm_api.gmm(a, b, group_sizes, backend="triton", interpret=False).sum(), argnums=(0, 1))(lhs, rhs)


F32 = jnp.float32
CASES = {
    "attention": (_attention_grads, [jax.ShapeDtypeStruct((1, 64, 2, 32), F32)] * 3),
    "gmm": (_gmm_grads, [jax.ShapeDtypeStruct((64, 32), F32), jax.ShapeDtypeStruct((2, 32, 16), F32), jax.ShapeDtypeStruct((2,), jnp.int32)]),
}


@pytest.mark.parametrize("kernel", CASES)
@pytest.mark.parametrize("precision, expected", [("default", "DEFAULT"), ("highest", "HIGHEST")])
def test_every_kernel_dot_takes_the_default_matmul_precision(kernel, precision, expected):
    fn, args = CASES[kernel]
    with jax.default_matmul_precision(precision), backends.gpu_target():
        jaxpr = str(jax.make_jaxpr(fn)(*args))
    assert "pallas_call" in jaxpr
    precisions = re.findall(r"precision=\(Precision\.(\w+), Precision\.(\w+)\)", jaxpr)
    assert len(precisions) == jaxpr.count("dot_general[") > 0
    assert set(precisions) == {(expected, expected)}
