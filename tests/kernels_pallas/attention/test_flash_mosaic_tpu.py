"""The Mosaic TPU flash-attention kernels in TPU interpret mode on CPU, forward and backward.

`pltpu.InterpretParams` simulates VMEM, the block DMAs and the grid's ``arbitrary`` axes; with
``uninitialized_memory="nan"`` every fresh buffer (outputs, VMEM scratch) starts as NaN, and
out-of-bounds block reads raise. Tiles are smaller than a TPU allows (multiples of 8 / 128) so that
short sequences span several, including block-sparse causal skipping.
"""

import flash_check
import pytest
from flash_check import Case
from jax.experimental.pallas import tpu as pltpu


CASES = [
    Case(seq=27, batch=1, blocks=(8, 16)),  # ragged, causal (tiles above the diagonal skipped), GQA 2
    Case(seq=21, batch=1, kv_heads=1, v_head_dim=16, causal=False, segments=True, dtype="bfloat16", blocks=(16, 8)),  # GQA 4
]


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_matches_reference_forward_and_backward(case):
    params = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
    flash_check.compare(case, interpret=params, backend="mosaic_tpu")
