"""Background by time slides, and false-alarm rates from it.

Slides. Within each segment, the samples a search analyses are ``[a, b)`` (``V = b - a`` of
them). Slide ``k = 1 .. N`` pairs the first detector's sample ``p`` with the second detector's
sample ``a + ((p - a + s_k) mod V)``, ``s_k = k * step``: the second detector's data is shifted
cyclically within the segment, so each slide is a full ``V`` samples of background. Zero lag
(``k = 0``) is the foreground and never part of the background; the shifts are all distinct and
at least ``step`` away from zero lag modulo ``V`` (``(N + 1) step <= V``), so no slide pairs a
stretch with itself or repeats another slide's pairing (:func:`pairing_offsets`). The step must
exceed the longest stretch a statistic depends on plus the light travel time between the
detectors (10 ms for H1-L1), so that no coincident signal survives a slide.

FAR. With ``T`` seconds of background and background events of ranking statistic ``b_i``, an
event of statistic ``x`` has ``FAR(x) = #{i: b_i >= x} / T`` per second; 0 means louder than
all background, i.e. below ``1 / T``. Per month: times :data:`SECONDS_PER_MONTH` (the challenge's
30-day month, ``contributions/sensitivity_plot.py``); per year: times :data:`SECONDS_PER_YEAR`.
"""
from __future__ import annotations

import numpy as np

SECONDS_PER_MONTH = 30 * 86400.0
SECONDS_PER_YEAR = 365.25 * 86400.0  # Julian year
LIGHT_TRAVEL_H1_L1_S = 0.010012846  # pycbc Detector("H1").light_travel_time_to_detector(Detector("L1"))


class SlideError(ValueError):
    """Time slides that cannot fit the data, or a step too short to separate the detectors."""


def slide_shifts(n_slides: int, step: int, n_valid: int, first: int = 1) -> np.ndarray:
    """Shifts ``s_k = k step`` [samples], ``k = first .. first + n_slides - 1``, checked to fit ``n_valid`` samples
    (slides in groups, e.g. 1-40 then 41-80, are together the same background as one run of them all)."""
    if n_slides < 0 or step < 1 or first < 1:
        raise SlideError(f"slides={n_slides}, step={step} samples, first={first}: need slides >= 0, a step of "
                         ">= 1 sample and a first slide >= 1 (slide 0 is the foreground)")
    last = first + n_slides - 1
    if (last + 1) * step > n_valid:
        raise SlideError(f"slides up to {last} of {step} samples need {(last + 1) * step} samples per segment, "
                         f"but a segment has {n_valid} analysable samples; lower --slides or --slide-step")
    return np.arange(first, last + 1, dtype=np.int64) * step


def check_slide_step(step_s: float, span_s: float, light_travel_s: float = LIGHT_TRAVEL_H1_L1_S) -> None:
    """Refuse a step [s] shorter than the stretch ``span_s`` a statistic sees plus the light travel time."""
    if step_s < span_s + light_travel_s:
        raise SlideError(f"slide step {step_s:g} s is too short: a statistic over {span_s:g} s plus the "
                         f"{light_travel_s * 1e3:.0f} ms light travel time needs a step of at least "
                         f"{span_s + light_travel_s:g} s")


def slid_index(positions: np.ndarray, valid: tuple[int, int], shift: int) -> np.ndarray:
    """Second-detector samples paired with first-detector ``positions`` in the slide of ``shift`` samples."""
    a, b = valid
    return a + np.mod(np.asarray(positions, dtype=np.int64) - a + shift, b - a)


def unslid_index(samples: np.ndarray, valid: tuple[int, int], shift: int) -> np.ndarray:
    """Inverse of :func:`slid_index`: where the second detector's ``samples`` land on the first one's axis."""
    a, b = valid
    return a + np.mod(np.asarray(samples, dtype=np.int64) - a - shift, b - a)


def pairing_offsets(shifts: np.ndarray, n_valid: int) -> np.ndarray:
    """Cyclic distance [samples] between a pairing and zero lag, for each slide: ``min(s mod V, V - s mod V)``."""
    r = np.mod(np.asarray(shifts, dtype=np.int64), n_valid)
    return np.minimum(r, n_valid - r)


def background_seconds(n_slides: int, valid_seconds: float) -> float:
    """Background time of ``n_slides`` slides over ``valid_seconds`` of analysed data (each slide: all of it)."""
    return float(n_slides) * float(valid_seconds)


def far_per_second(stats: np.ndarray, background_stats: np.ndarray, background_s: float) -> np.ndarray:
    """``#{background >= x} / T`` for each ``x`` of ``stats`` (module docstring)."""
    if not background_s > 0:
        raise ValueError(f"background duration {background_s} s: need a positive duration (run --slides N >= 1)")
    bg = np.sort(np.asarray(background_stats, dtype=np.float64))
    louder = len(bg) - np.searchsorted(bg, np.asarray(stats, dtype=np.float64), side="left")
    return louder / float(background_s)


def far_table(stats: np.ndarray, background_stats: np.ndarray, background_s: float) -> dict[str, np.ndarray]:
    """FAR per month and per year of each event (``far_per_month``, ``far_per_year``)."""
    far = far_per_second(stats, background_stats, background_s)
    return {"far_per_month": far * SECONDS_PER_MONTH, "far_per_year": far * SECONDS_PER_YEAR}
