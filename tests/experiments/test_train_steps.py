import numpy as np
import pytest

from experiments import cli, train_steps


def test_parse_batch_shape():
    assert train_steps.parse_batch_shape(" 8x128") == (8, 128)
    with pytest.raises(cli.UsageError):
        train_steps.parse_batch_shape("0x128")


def test_random_tokens_uniform_and_zipf():
    uniform = train_steps.random_tokens(50304, (16, 1024), "uniform")
    assert uniform.dtype == np.int32 and uniform.min() >= 0 and uniform.max() < 50304 and np.bincount(uniform.ravel()).max() < 10
    zipf = train_steps.random_tokens(50304, (16, 1024), "zipf")
    counts = np.bincount(zipf.ravel(), minlength=50304) / zipf.size
    harmonic = np.sum(1.0 / np.arange(1, 50305))
    np.testing.assert_allclose(counts[:3], 1 / (np.arange(1, 4) * harmonic), rtol=0.1)  # id k at 1 / ((k + 1) H_V)
    with pytest.raises(ValueError, match="not one of"):
        train_steps.random_tokens(8, (2,), "normal")
