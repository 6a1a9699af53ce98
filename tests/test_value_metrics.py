"""Rank statistics of value probes against hand-computed values."""

import math

import numpy as np
import pytest

from caspo.value.metrics import calibration_bins, rankdata, roc_auc, spearman, value_metrics, within_group_deltas


def test_rankdata_averages_ties():
    assert rankdata([10, 20, 20, 30]).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert rankdata([3, 1, 3, 3]).tolist() == [3.0, 1.0, 3.0, 3.0]


def test_spearman_with_ties_by_hand():
    # ranks x = 1, 2.5, 2.5, 4 and y = 1, 3, 2, 4; centred: (-1.5, 0, 0, 1.5), (-1.5, .5, -.5, 1.5)
    # Σxy = 4.5, Σx² = 4.5, Σy² = 5  ->  ρ = 4.5 / sqrt(22.5)
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(22.5))
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 4, 9]) == pytest.approx(1.0)  # monotone, not linear
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert math.isnan(spearman([1], [2]))


def test_roc_auc_by_hand():
    # positives 0.35 and 0.8 against negatives 0.1 and 0.4: 3 of 4 pairs ordered
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    # a tie between a positive and a negative counts one half: (0.5 + 1 + 1 + 1) / 4
    assert roc_auc([0.5, 0.5, 0.2, 0.9], [1, 0, 0, 1]) == pytest.approx(0.875)
    assert math.isnan(roc_auc([0.1, 0.2], [1, 1]))


def test_within_group_deltas_follow_positions():
    values = [5.0, 1.0, 3.0, 10.0, 20.0]
    targets = [0.5, 0.1, 0.3, 1.0, 0.0]
    groups = [0, 0, 0, 1, 1]
    positions = [9, 2, 5, 4, 8]  # group 0 in order: 1.0 (2), 3.0 (5), 5.0 (9)
    dv, dt = within_group_deltas(values, targets, groups, positions)
    assert dv.tolist() == [2.0, 2.0, 10.0]
    assert np.allclose(dt, [0.2, 0.2, -1.0])


def test_calibration_bins():
    bins = calibration_bins([0.05, 0.08, 0.95, 1.0], [0.0, 1.0, 1.0, 1.0], bins=10)
    assert [(b["lo"], b["n"]) for b in bins] == [(0.0, 2), (0.9, 2)]
    assert bins[0]["predicted"] == pytest.approx(0.065) and bins[0]["target"] == 0.5


def test_value_metrics_accuracy_and_majority_baseline():
    beta = 10.0
    values = np.array([-20.0, -5.0, 5.0, 30.0])  # σ(V/β) > 1/2 for the last two
    m = value_metrics(values, p_hat=[0.0, 0.25, 0.5, 1.0], outcome=[0, 0, 0, 1], groups=[0, 0, 1, 1],
                      positions=[1, 2, 1, 2], beta=beta)
    assert m["n"] == 4 and m["spearman"] == pytest.approx(1.0)
    assert m["within_response_pairs"] == 2 and m["within_response_spearman"] == pytest.approx(1.0)
    assert m["auc_outcome"] == pytest.approx(1.0)
    assert m["accuracy_outcome"] == pytest.approx(0.75) and m["majority_baseline"] == pytest.approx(0.75)
