"""The Triton (GPU) flash-attention kernels in Pallas interpret mode on CPU, forward and backward.

The interpreter fills every kernel output with NaN before the run (test_flash_api checks that it
does), so a tile a kernel forgets to write fails the comparison. With a GPU as JAX's default
backend (tests/conftest.py) the same cases run compiled.
"""

import flash_check
import pytest
from flash_check import Case


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
