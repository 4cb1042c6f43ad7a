"""Every aggregation rule rejects malformed updates and weights with a clear error."""

from __future__ import annotations

import numpy as np
import pytest

from strategies.federa.rule import aggregate_federa
from strategies.fedex_lora.rule import aggregate_fedex_lora
from strategies.fedit.rule import aggregate_fedit
from strategies.florg.rule import aggregate_florg, aggregate_florg_reference
from strategies.shared.averaging import weighted_average
from strategies.shared.validation import AggregationInputError

rng = np.random.default_rng(0)
A = [rng.standard_normal((2, 6)) for _ in range(3)]
B = [rng.standard_normal((9, 2)) for _ in range(3)]
PREV = rng.standard_normal((2, 6))


@pytest.mark.parametrize("fn", [aggregate_florg, aggregate_florg_reference])
def test_florg_rejects(fn):
    with pytest.raises(AggregationInputError, match=r"client 1\]: shape"):
        fn([A[0], A[1][:, :5], A[2]], None, PREV)
    bad = [a.copy() for a in A]
    bad[2][0, 0] = np.nan
    with pytest.raises(AggregationInputError, match=r"client 2\]: contains 1 NaN/Inf"):
        fn(bad, None, PREV)
    bad[2][0, 0] = np.inf
    with pytest.raises(AggregationInputError, match="NaN/Inf"):
        fn(bad, None, PREV)
    with pytest.raises(AggregationInputError, match="non-negative"):
        fn(A, [1, -1, 1], PREV)
    with pytest.raises(AggregationInputError, match="all zero"):
        fn(A, [0, 0, 0], PREV)
    with pytest.raises(AggregationInputError, match="3 client matrices"):
        fn(A, [1, 1], PREV)
    with pytest.raises(AggregationInputError, match="no client matrices"):
        fn([], None, PREV)
    with pytest.raises(AggregationInputError, match="exceeds k"):
        fn([np.ones((7, 6))], None, np.ones((7, 6)))
    with pytest.raises(AggregationInputError, match="prev_A: expected a 2-D"):
        fn(A, None, PREV.reshape(-1))


def test_lora_rules_reject():
    with pytest.raises(AggregationInputError, match="NaN"):
        aggregate_fedit([B[0] * np.nan] + B[1:], A, None)
    with pytest.raises(AggregationInputError, match="2 B matrices but 3 A"):
        aggregate_federa(B[:2], A, None)
    with pytest.raises(AggregationInputError, match="shape"):
        aggregate_fedex_lora(B, [A[0], A[1], A[2][:1]], None)
    with pytest.raises(AggregationInputError, match="non-negative"):
        aggregate_fedex_lora(B, A, [1, 2, -3])
    with pytest.raises(ValueError, match="residual_mode"):
        aggregate_fedex_lora(B, A, None, residual_mode="sparse")


def test_weighted_average_vectors_and_errors():
    out = weighted_average([np.ones(3), 3 * np.ones(3)], [1, 1], "bias")
    np.testing.assert_allclose(out, 2 * np.ones(3))
    assert out.shape == (3,)
    with pytest.raises(AggregationInputError, match="bias"):
        weighted_average([np.ones(3), np.ones(4)], None, "bias")
