"""kernels_pallas.gmm.api.grouped_matmul: which grouped matmul ``model.moe_matmul`` runs per platform."""

import logging

import jax
import pytest

from kernels_pallas.gmm import api


@pytest.mark.parametrize(
    "platform, choice, kernel",
    [("cpu", "auto", None), ("tpu", "auto", "mosaic_tpu"), ("cuda", "auto", "triton"), ("cpu", "gmm", "triton"), ("cuda", "ragged_dot", None)],
)
def test_auto_takes_the_kernel_where_the_platform_compiles_one(monkeypatch, platform, choice, kernel):
    monkeypatch.setattr(api, "platform", lambda: platform)
    matmul, is_kernel = api.grouped_matmul(choice)
    assert is_kernel == (kernel is not None)
    if kernel:
        assert matmul.keywords == {"backend": kernel, "interpret": platform == "cpu"}
    else:
        assert matmul is jax.lax.ragged_dot


def test_an_unknown_matmul_is_named(monkeypatch):
    with pytest.raises(ValueError, match="unknown model.moe_matmul 'cutlass'; use one of auto, ragged_dot, gmm"):
        api.grouped_matmul("cutlass")


def test_every_platform_order_ends_in_ragged_dot():
    for platform, order in api.MATMUL_ORDER.items():
        assert set(order) <= set(api.MATMULS) and order[-1] == "ragged_dot", platform


def test_auto_logs_a_fallback_once(monkeypatch, caplog):
    """A platform whose order lists the kernel but which cannot compile it falls back to ragged_dot, said once."""
    monkeypatch.setattr(api, "platform", lambda: "cpu")
    monkeypatch.setitem(api.MATMUL_ORDER, "cpu", ("gmm", "ragged_dot"))
    monkeypatch.setattr(api, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger=api.__name__):
        for _ in range(2):
            assert api.grouped_matmul("auto") == (jax.lax.ragged_dot, False)
    assert [r.getMessage() for r in caplog.records] == [
        "model.moe_matmul=auto chose ragged_dot: the Pallas gmm kernel does not compile for cpu (interpret mode only, for tests)"
    ]
