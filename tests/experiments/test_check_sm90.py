"""experiments.check_sm90: the Triton kernels compiled for sm_90a on this host (skips without pip triton)."""

import jax.numpy as jnp
import pytest

from experiments import check_sm90


def test_problems_name_shared_memory_spills_and_compile_errors():
    ok = {"shared_bytes": 227 * 1024, "registers": 255, "spill_bytes": 0}
    assert check_sm90.problems(ok) == []
    assert check_sm90.problems({**ok, "shared_bytes": 288 * 1024, "spill_bytes": 60}) == [
        "288 KiB of shared memory > 227 KiB",
        "spills 60 B",
    ]
    assert check_sm90.problems({"error": "out of resource"}) == ["does not compile: out of resource"]


@pytest.mark.parametrize(
    "case",
    # What failed before the block sizes went by row bytes and gmm by item size (the list).
    [lambda: check_sm90._attention_case((256, 256), jnp.bfloat16), lambda: check_sm90._gmm_case(jnp.float32)],
    ids=["attention bf16 d256", "gmm fp32"],
)
def test_default_kernels_fit_an_h100_without_spills(case, tmp_path):
    pytest.importorskip("triton")
    fn, args = case()
    kernels = check_sm90.triton_kernels(fn, *args)
    assert len(kernels) == 3  # forward and both backward kernels
    for kernel in kernels:
        row = check_sm90.compile_sm90(kernel, str(tmp_path))
        assert row["registers"] > 0 and check_sm90.problems(row) == [], (kernel.name, row)
