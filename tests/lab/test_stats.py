"""The evidence statistics on hand-computed cases."""

import math

import pytest

from florg_lab.stats import mean_interval, paired_difference, verdict


def test_mean_interval_matches_the_hand_computation():
    # values 1..5: mean 3, sd = sqrt(2.5) = 1.58114, se = 0.70711,
    # t_{0.975, 4} = 2.776445 (tables), half-width = 1.963243
    interval = mean_interval([1, 2, 3, 4, 5])
    assert interval.mean == pytest.approx(3.0)
    assert interval.low == pytest.approx(3 - 1.963243, abs=1e-6)
    assert interval.high == pytest.approx(3 + 1.963243, abs=1e-6)
    assert interval.n == 5


def test_ninety_percent_interval_is_narrower():
    # t_{0.95, 4} = 2.131847: half-width 1.507443
    interval = mean_interval([1, 2, 3, 4, 5], level=0.90)
    assert interval.high - interval.mean == pytest.approx(1.507443, abs=1e-6)


def test_one_value_has_no_interval_and_no_verdict():
    interval = mean_interval([0.7])
    assert interval.mean == 0.7 and math.isnan(interval.low)
    assert verdict(interval) == "inconclusive"


def test_paired_difference_uses_the_per_seed_differences():
    a = [0.80, 0.75, 0.78, 0.82, 0.79]
    b = [0.70, 0.74, 0.79, 0.72, 0.69]
    # differences 0.10, 0.01, -0.01, 0.10, 0.10: mean 0.06, squared deviations sum to
    # 0.0122, sd = sqrt(0.0122 / 4) = 0.055227, se = 0.024698,
    # half-width = 2.776445 * 0.024698 = 0.068573
    paired = paired_difference(a, b)
    assert paired.difference.mean == pytest.approx(0.06)
    assert paired.difference.high - paired.difference.mean == pytest.approx(0.068573, abs=1e-6)
    assert (paired.wins, paired.losses, paired.ties) == (4, 1, 0)
    assert verdict(paired.difference) == "inconclusive"  # the interval reaches below 0


def test_verdicts():
    assert verdict(mean_interval([0.05, 0.06, 0.07])) == "holds"
    assert verdict(mean_interval([-0.05, -0.06, -0.07])) == "does not hold"


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no values"):
        mean_interval([])
    with pytest.raises(ValueError, match="NaN"):
        mean_interval([0.5, float("nan")])
    with pytest.raises(ValueError, match="differ in length"):
        paired_difference([0.1, 0.2], [0.1])
