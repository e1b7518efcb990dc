"""The Triton (GPU) flash-attention kernels in Pallas interpret mode on CPU, forward and backward.

The interpreter fills every kernel output with NaN before the run (test_flash_api checks that it
does), so a tile a kernel forgets to write fails the comparison. With a GPU as JAX's default
backend (tests/conftest.py) the same cases run compiled.
"""

import flash_check
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flash_check import Case

from kernels_pallas.attention import api
from kernels_pallas.attention import window as window_lib

CASES = [
    Case(seq=37),  # ragged: three 16-row tiles, the last one 5 rows long; GQA 2; causal
    Case(seq=1, heads=2, kv_heads=2),  # one token; one query head per kv head
    # GQA 4, a v head dim of its own (48, padded to 64 inside), packed documents, a set sm_scale,
    # query tiles wider than key tiles
    Case(seq=40, kv_heads=1, head_dim=64, v_head_dim=48, causal=False, sm_scale=0.3, segments=True, blocks=(32, 16)),
    Case(seq=64, heads=2, kv_heads=1, head_dim=128, dtype="bfloat16", blocks=(16, 32)),  # whole tiles, no padding
    Case(seq=45, segments=True, dtype="bfloat16"),  # causal packed documents, ragged
]


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_matches_reference_forward_and_backward(case):
    flash_check.compare(case, interpret=flash_check.INTERPRET, backend="triton")


# A sliding window (kernels_pallas/attention/window.py) against the banded XLA attention: a band of 3 blocks of
# 8 tokens with a traced window of 2 (a window growing in training), so its edges cut through the 16-row
# tiles; ragged, packed documents, GQA 2. The last query tile skips the first key tile (forward, dQ) and the
# first key tile skips the last query tile (dK/dV).
def test_sliding_window_matches_the_banded_xla_attention_forward_and_backward():
    case = Case(seq=45, heads=2, kv_heads=1, segments=True, batch=1)
    x = flash_check.inputs(case)
    seg, block_sizes = x["segment_ids"], case.block_sizes

    def kernel(q, k, v, limit):
        return api.flash_attention(
            q, k, v, segment_ids=seg, window=24, window_block=8, window_limit=limit, block_sizes=block_sizes,
            interpret=flash_check.INTERPRET, backend="triton",
        )  # fmt: skip

    def banded(q, k, v, limit):
        return window_lib.attention(q, k, v, segment_ids=seg, window=24, block=8, limit=limit)

    def with_grads(f, limit):
        out, pullback = jax.vjp(lambda q, k, v: f(q, k, v, limit), x["q"], x["k"], x["v"])
        return out, *pullback(x["d_out"])

    got, want = (jax.jit(with_grads, static_argnums=0)(f, jnp.int32(2)) for f in (kernel, banded))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=flash_check.TOLERANCE[case.dtype], rtol=flash_check.TOLERANCE[case.dtype], err_msg=name)
