import math

import pytest

from experiments import speedup

# Validation loss every 100 tokens; the baseline ends at 2.0.
BASELINE = [(100, 4.0), (200, 3.0), (300, 2.5), (400, 2.0)]


def test_x_to_target_interpolates_between_evaluations():
    assert speedup.x_to_target(BASELINE, 2.0) == 400
    assert speedup.x_to_target(BASELINE, 2.75) == pytest.approx(250)
    assert speedup.x_to_target(BASELINE, 2.2) == pytest.approx(360)


def test_x_to_target_takes_the_first_crossing_and_the_first_point():
    bumpy = [(100, 3.0), (200, 1.5), (300, 2.5), (400, 1.0)]
    assert speedup.x_to_target(bumpy, 2.0) == pytest.approx(100 + 100 * (1.0 / 1.5))
    assert speedup.x_to_target(bumpy, 5.0) == 100  # already there at the first evaluation


def test_x_to_target_is_none_when_never_reached_or_diverged():
    assert speedup.x_to_target(BASELINE, 1.9) is None
    assert speedup.x_to_target([(100, math.nan), (200, math.inf)], 2.0) is None
    # A non-finite evaluation before the crossing: no interpolation through it.
    assert speedup.x_to_target([(100, math.nan), (200, 1.0)], 2.0) == 200


def test_faster_optimizer_gets_its_token_ratio():
    # Reaches 2.0 halfway between 200 (2.2) and 300 (1.8): at 250 tokens, so 400 / 250 = 1.6x.
    fast = [(100, 3.0), (200, 2.2), (300, 1.8), (400, 1.7)]
    s = speedup.speedup(BASELINE, fast)
    assert s.target == 2.0 and s.baseline_x == 400
    assert s.x == pytest.approx(250)
    assert s.value == pytest.approx(1.6)
    assert float(str(s).removesuffix("x")) == pytest.approx(s.value, abs=0.005)  # the table prints the value


def test_baseline_against_itself_is_one():
    assert speedup.speedup(BASELINE, BASELINE).value == 1.0


def test_optimizer_that_never_reaches_the_target_gets_only_a_bound():
    slow = [(100, 4.5), (200, 3.5), (300, 2.9), (400, 2.4)]
    s = speedup.speedup(BASELINE, slow)
    assert s.x is None and s.value is None
    assert s.upper_bound == 1.0
    bound, note = str(s).removeprefix("<").split("x ", 1)
    assert float(bound) == pytest.approx(s.upper_bound, abs=0.005) and note == "(not reached)"
    # A baseline that reached its final loss early (non-monotone) bounds the speedup below 1.
    early = [(100, 3.0), (200, 1.9), (300, 2.1), (400, 2.0)]
    assert speedup.speedup(early, slow).upper_bound == pytest.approx((100 + 100 / 1.1) / 400)


def test_time_axis_works_the_same():
    base_seconds = [(t / 1000, loss) for t, loss in BASELINE]  # 1000 tokens/s
    other = [(t / 500, loss) for t, loss in BASELINE]  # same tokens, half the throughput
    assert speedup.speedup(base_seconds, other).value == pytest.approx(0.5)


def test_mean_curve_and_bad_inputs():
    a = [(100, 3.0), (200, 2.0)]
    b = [(110, 3.2), (210, 2.4)]
    assert speedup.mean_curve([a, b]) == [pytest.approx((105, 3.1)), pytest.approx((205, 2.2))]
    with pytest.raises(ValueError, match="same number of points"):
        speedup.mean_curve([a, a[:1]])
    with pytest.raises(ValueError, match="diverged baseline"):
        speedup.speedup([(100, math.nan)], a)
    with pytest.raises(ValueError, match="non-empty"):
        speedup.speedup([], a)
