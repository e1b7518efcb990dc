"""Weighted mixtures (`lm.data.mixture`) and their use by `lm.data.input_pipeline`."""

import grain
import numpy as np
import pytest

from lm.data import batches, mixture


def test_parse_reads_globs_and_weights_and_rejects_bad_weights():
    assert mixture.parse("a/*.bin:0.7, b/x:y/*.bin:0.3") == [("a/*.bin", 0.7), ("b/x:y/*.bin", 0.3)]
    for bad in ("a/*.bin", "a:0", "a:-1", "a:nan", "a:inf", "a:x", ":0.5", ","):
        with pytest.raises(ValueError, match="data.mixture"):
            mixture.parse(bad)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 2], [0.123, 0.877]])
def test_every_prefix_holds_the_weights_within_one_period(weights):
    schedule = mixture.Schedule(weights)
    share = np.asarray(weights) / sum(weights)
    seen = np.zeros(len(weights), np.int64)
    for i in range(3 * schedule.period + 7):
        k, index = schedule.locate(i)
        assert index == seen[k]  # each source is read in order, nothing skipped or repeated
        seen[k] += 1
        np.testing.assert_array_equal(schedule.counts(i + 1), seen)
        assert np.all(np.abs(seen - (i + 1) * share) <= 1 + 1e-3 * (i + 1))


def test_mixture_batches_match_the_weights_and_resume_on_any_process_count():
    a = batches.Windows([np.zeros(4000, np.uint16)], 8)
    b = batches.Windows([np.ones(4000, np.uint16)], 8)
    shuffled = [grain.MapDataset.source(s).shuffle(seed=k) for k, s in enumerate((a, b))]
    mixed = grain.MapDataset.source(mixture.Mixture(shuffled, [0.7, 0.3]))
    it = batches.PackedBatches(mixed, 8, 16, seed=0, shuffle=False)
    rows = np.concatenate([next(it) for _ in range(100)])
    assert abs((rows[:, 0] == 0).mean() - 0.7) < 0.01
    state = it.get_state()
    expected = it.batch_at(state["step"])
    halves = [batches.PackedBatches(mixed, 8, 16, seed=0, shuffle=False, process_index=i, process_count=2) for i in range(2)]
    for h in halves:
        h.set_state(state)
    np.testing.assert_array_equal(np.concatenate([next(h) for h in halves]), expected)
