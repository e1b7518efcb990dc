"""The platform-to-backend choice every kernel entry point shares."""

import jax
import pytest

from kernels_pallas import backends

KNOWN = ("triton", "mosaic_tpu")


@pytest.mark.parametrize(
    "target, backend, interpret, expected",
    [
        ("cuda", None, False, "triton"),
        ("rocm", None, False, "triton"),
        ("tpu", None, False, "mosaic_tpu"),
        ("cpu", None, True, "triton"),  # interpret mode: the Triton kernel, run by the Pallas interpreter
        ("cpu", "mosaic_tpu", True, "mosaic_tpu"),  # the TPU interpreter, when named
        ("cpu", "triton", False, "triton"),  # named: lowered for another platform from a CPU host
    ],
)
def test_each_platform_takes_its_backend_unless_one_is_named(target, backend, interpret, expected):
    assert backends.choose("op", target, backend, interpret, KNOWN, "use the reference") == expected


def test_nothing_to_run_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match="op: Pallas kernels do not compile for cpu: pass interpret=True .* or use the reference"):
        backends.choose("op", "cpu", None, False, KNOWN, "use the reference")
    with pytest.raises(ValueError, match="op: no backend 'cuda' for platform 'tpu'; pass backend= one of triton, mosaic_tpu"):
        backends.choose("op", "tpu", "cuda", False, KNOWN, "use the reference")


def test_the_platform_is_the_meshs_and_only_accelerators_compile():
    with jax.set_mesh(jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])):
        assert backends.platform() == jax.devices()[0].platform
        assert backends.device_kind() == jax.devices()[0].device_kind
    assert backends.compiles("gpu") and backends.compiles("tpu") and not backends.compiles("cpu")


def test_a_host_targets_an_abstract_h100():
    with backends.gpu_target((2,), ("data",)) as mesh:
        assert backends.platform() == "gpu" and backends.device_kind() == "NVIDIA H100 80GB HBM3"
        assert dict(mesh.shape) == {"data": 2}
    assert backends.platform() == jax.default_backend()


@pytest.mark.parametrize("shape, refused", [((2**16, 2**15), True), ((2**16, 2**15 - 1), False)])
def test_operands_of_2_to_the_31_elements_are_refused(shape, refused):
    x = jax.ShapeDtypeStruct(shape, "bfloat16")
    if refused:
        with pytest.raises(ValueError, match=r"op: an operand of shape \(65536, 32768\) has 2,147,483,648 >= 2\*\*31 elements.*; fix it"):
            backends.check_int32_offsets("op", "fix it", x)
    else:
        backends.check_int32_offsets("op", "fix it", x, None)
