"""Document masks (`model.document_separator`, `data.document_mask`): no token attends across a document start."""

import dataclasses

import jax
import numpy as np
import pytest

from experiments import cli, run_spec, trainer
from experiments.configs import default
from lm import config as config_lib
from lm import model as model_lib

SEP = 7
DOC_A = [SEP, 11, 12, 13, 14, 15]
DOC_B = [SEP, 21, 22, 23, 24, 25, 26, 27, 28, 29]


def _logits(cfg, tokens):
    model_def = model_lib.define(cfg)
    params = model_lib.init_params(model_def, seed=0)
    return np.asarray(jax.jit(lambda p, t: model_lib.apply(model_def, p, t))(params, np.asarray([tokens], np.int32))[0])


CASES = {
    "xla": {"attention": "xla"},
    "pallas": {"attention": "pallas"},  # the Pallas kernel in interpret mode on a CPU
    "mla": {"attention": "xla", "attention_type": "mla"},
    "unrolled_remat": {"attention": "xla", "scan_layers": False, "remat": "full"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_packed_document_sees_only_itself(case):
    cfg = config_lib.from_preset("tiny", vocab_size=64, n_layers=2, document_separator=SEP, **CASES[case])
    packed = _logits(cfg, DOC_A + DOC_B)
    alone = _logits(cfg, DOC_B)  # RoPE scores depend on relative positions only, so the offset does not matter
    np.testing.assert_allclose(packed[len(DOC_A) :], alone, rtol=2e-4, atol=2e-4)
    unmasked = _logits(dataclasses.replace(cfg, document_separator=None), DOC_A + DOC_B)
    np.testing.assert_allclose(unmasked[: len(DOC_A)], packed[: len(DOC_A)], rtol=2e-4, atol=2e-4)  # the first document is causal anyway
    assert np.abs(unmasked[len(DOC_A) :] - alone).max() > 1e-3  # without the mask the second document sees the first


def test_data_document_mask_sets_the_models_separator(tmp_path):
    config = default.get_config()
    assert run_spec.model_config(config).document_separator is None
    config.data.document_mask = True
    assert run_spec.model_config(config).document_separator == 257  # the byte corpus' EOS
    config.data.separator_id = 400
    with pytest.raises(cli.UsageError, match="document separator id 400 lies outside model.vocab_size=320"):
        trainer.run(config, tmp_path)
