import pytest

from experiments import cli, train_steps


def test_parse_batch_shape():
    assert train_steps.parse_batch_shape(" 8x128") == (8, 128)
    with pytest.raises(cli.UsageError):
        train_steps.parse_batch_shape("0x128")
