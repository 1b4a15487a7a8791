"""Calibration metrics on synthetic data with known answers, and the threshold rule."""
import json
import math

import numpy as np
import pytest
from scipy import stats

from converge.validate.calibration import (binned_rmse, calibrate, coverage, gaussian_coverage, load_calibration,
                                           spearman, spread_threshold, write_calibration)


@pytest.fixture(scope="module")
def gaussian():
    """Errors drawn from N(0, s^2) with s the spread: a perfectly calibrated spread."""
    rng = np.random.default_rng(1)
    spread = rng.uniform(0.1, 2.0, size=200_000)
    return spread, spread * rng.normal(size=spread.size)


def test_calibrated_spread_covers_like_a_gaussian(gaussian):
    spread, error = gaussian
    found = coverage(spread, error)
    expected = gaussian_coverage()
    assert expected == pytest.approx({"1": 0.6827, "2": 0.9545, "3": 0.9973}, abs=1e-4)
    for k in ("1", "2", "3"):
        assert found[k] == pytest.approx(expected[k], abs=0.004)  # binomial std at n=2e5 is ~0.001
    # each bin's RMSE is its root-mean-square spread (20,000 errors per bin: ~0.5% sampling error)
    binned = binned_rmse(spread, error, n_bins=10)
    assert sum(binned["count"]) == spread.size and len(binned["count"]) == 10
    rms_spread = [np.sqrt(np.mean(b**2)) for b in np.split(np.sort(spread), 10)]
    np.testing.assert_allclose(binned["rmse"], rms_spread, rtol=0.02)
    np.testing.assert_allclose(binned["spread"], [b.mean() for b in np.split(np.sort(spread), 10)])


def test_overconfident_spread_covers_too_little(gaussian):
    spread, error = gaussian
    found = coverage(spread / 2, error)  # the errors are twice what the spread says
    assert found["1"] == pytest.approx(math.erf(0.5 / math.sqrt(2)), abs=0.004)
    report = calibrate(spread / 2, error, target=1.0)
    assert report["rmse_over_rms_spread"] == pytest.approx(2.0, rel=0.01)


def test_spearman_matches_scipy_including_ties():
    rng = np.random.default_rng(2)
    x = rng.integers(0, 5, size=200).astype(float)  # many ties
    y = x + rng.normal(size=200)
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    assert spearman(np.arange(10.0), np.exp(np.arange(10.0))) == pytest.approx(1.0)
    assert spearman(np.arange(10.0), -np.arange(10.0)) == pytest.approx(-1.0)
    assert math.isnan(spearman(np.ones(5), np.arange(5.0)))


def test_threshold_keeps_the_trusted_exceedance_within_the_bound():
    spread = np.arange(100) / 100.0
    error = np.where(spread < 0.6, 0.0, 2.0)  # every error above target from spread 0.6 on
    # trusting s <= t with t = 0.65 lets in 6 bad of 66 (9.1% <= 10%); 0.66 would be 7 of 67 (10.4%)
    assert spread_threshold(spread, error, target=1.0, max_exceed=0.1) == pytest.approx(0.65)
    assert spread_threshold(spread, error, target=1.0, max_exceed=0.0) == pytest.approx(0.59)
    assert spread_threshold(spread, np.zeros(100), target=1.0) == pytest.approx(0.99)  # never beyond what was seen
    assert spread_threshold(spread, np.full(100, 5.0), target=1.0) == 0.0  # trust nothing
    # too few samples to claim anything
    assert spread_threshold(spread[:5], error[:5], target=1.0, min_count=10) == 0.0
    # tied spreads are trusted or refused together
    tied = np.array([0.1] * 5 + [0.2] * 10 + [0.3] * 5)
    err = np.array([0.0] * 5 + [0.0] * 9 + [2.0] + [2.0] * 5)
    assert spread_threshold(tied, err, target=1.0, max_exceed=0.1, min_count=3) == pytest.approx(0.2)
    assert spread_threshold(tied, err, target=1.0, max_exceed=0.05, min_count=3) == pytest.approx(0.1)


def test_report_is_written_with_the_run_and_states_the_consequences(tmp_path):
    spread = np.arange(100) / 100.0
    error = np.where(spread < 0.6, 0.1, 2.0)
    report = calibrate(spread, error, target=1.0, max_exceed=0.1)
    assert report["threshold"] == pytest.approx(0.65)
    assert report["trusted_fraction"] == pytest.approx(0.66)
    assert report["exceed_fraction_trusted"] == pytest.approx(6 / 66)
    assert report["exceed_fraction_all"] == pytest.approx(0.4)
    assert report["spearman"] > 0.8
    path = write_calibration(tmp_path, report, spread, error, "energy", "kcal/mol")
    assert json.loads(path.read_text())["units"] == "kcal/mol"
    assert load_calibration(tmp_path)["threshold"] == pytest.approx(0.65)
    assert (tmp_path / "calibration.png").stat().st_size > 1000
    # a constant spread cannot rank errors: no NaN or inf goes into the JSON
    flat = calibrate(np.zeros(20), np.ones(20), target=0.5)
    assert flat["spearman"] is None and flat["rmse_over_rms_spread"] is None and flat["threshold"] == 0.0
    json.loads(json.dumps(flat, allow_nan=False))


def test_bad_inputs_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="one of each"):
        coverage(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="NaN"):
        calibrate(np.array([1.0, np.nan]), np.ones(2), target=1.0)
    with pytest.raises(ValueError, match=">= 0"):
        coverage(-np.ones(3), np.ones(3))
    with pytest.raises(ValueError, match="target"):
        spread_threshold(np.ones(3), np.ones(3), target=0.0)
    with pytest.raises(FileNotFoundError, match="calibrate"):
        load_calibration("/nonexistent")
