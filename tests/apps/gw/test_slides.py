"""Time-slide bookkeeping and FAR arithmetic, on cases worked by hand."""
from __future__ import annotations

import numpy as np
import pytest

from converge.apps.gw.slides import (
    SECONDS_PER_MONTH,
    SECONDS_PER_YEAR,
    SlideError,
    background_seconds,
    check_slide_step,
    far_per_second,
    far_table,
    pairing_offsets,
    slid_index,
    slide_shifts,
    unslid_index,
)


def test_slides_never_pair_a_stretch_with_itself_nor_repeat_a_pairing():
    valid, step = (100, 1100), 7  # V = 1000 samples
    shifts = slide_shifts(141, step, 1000)  # (141 + 1) * 7 = 994 fits; 142 would need 1001
    assert shifts[0] == 7 and shifts[-1] == 987
    assert pairing_offsets(shifts, 1000).min() >= step  # every slide is >= one step from zero lag, cyclically
    p = np.arange(*valid)
    seen = set()
    for s in shifts:
        q = slid_index(p, valid, int(s))
        assert np.all((q >= 100) & (q < 1100))  # stays in the analysed samples
        assert len(np.unique(q)) == len(p)  # a permutation: all of the second detector, once
        assert np.all(np.minimum((q - p) % 1000, (p - q) % 1000) >= step)  # never a sample with itself
        pairs = set(zip(p.tolist(), q.tolist()))
        assert not pairs & seen  # no pairing repeats across slides
        seen |= pairs
        np.testing.assert_array_equal(unslid_index(q, valid, int(s)), p)


def test_slides_that_do_not_fit_are_refused():
    with pytest.raises(SlideError, match="slides up to 142 of 7 samples need 1001 samples per segment, but a "
                                         "segment has 1000"):
        slide_shifts(142, 7, 1000)
    with pytest.raises(SlideError, match="slides up to 142 of 7 samples need 1001"):
        slide_shifts(42, 7, 1000, first=101)
    with pytest.raises(SlideError, match="slide 0 is the foreground"):
        slide_shifts(3, 7, 1000, first=0)
    with pytest.raises(SlideError, match="slide step 0.5 s is too short: a statistic over 1 s"):
        check_slide_step(0.5, 1.0)
    check_slide_step(2.0, 1.0)


def test_slides_in_groups_are_the_slides_of_one_run():
    whole = slide_shifts(30, 5, 1000)
    groups = np.concatenate([slide_shifts(10, 5, 1000, first=1), slide_shifts(20, 5, 1000, first=11)])
    np.testing.assert_array_equal(groups, whole)


def test_one_day_with_thirty_slides_gives_thirty_days():
    assert background_seconds(30, 86400.0) == 30 * 86400.0
    assert len(slide_shifts(30, 2 * 2048, (20000 - 4) * 2048)) == 30


def test_far_arithmetic_by_hand():
    background = np.array([1.0, 2.0, 2.0, 3.0, 5.0])  # over T = 10 s
    # events at 0.5 (all 5 louder or equal), 2 (4: 2, 2, 3, 5), 4 (1: 5), 5 (1: itself counts), 6 (none)
    far = far_per_second(np.array([0.5, 2.0, 4.0, 5.0, 6.0]), background, 10.0)
    np.testing.assert_allclose(far, [0.5, 0.4, 0.1, 0.1, 0.0])
    table = far_table(np.array([4.0]), background, 10.0)
    assert table["far_per_month"][0] == pytest.approx(0.1 * 30 * 86400)
    assert table["far_per_year"][0] == pytest.approx(0.1 * 365.25 * 86400)
    assert SECONDS_PER_MONTH == 2_592_000 and SECONDS_PER_YEAR == 31_557_600
    with pytest.raises(ValueError, match="run --slides N >= 1"):
        far_per_second(np.ones(1), background, 0.0)
