"""The gw app's part of active learning: which binaries to simulate for the detection CNN.

A gw training sample is one binary's whitened waveform (``app.simulate``); the
training loader puts it into fresh design-PSD noise at a fresh SNR every epoch.
So what active learning chooses here is *which binaries* (masses, orientation)
are worth a waveform, by how much the ensemble disagrees about them. A candidate
is its prior parameters (:func:`~converge.apps.gw.waveforms.sample_bbh_parameters`)
plus a ``noise_seed`` (its crop and noise) and an ``snr`` (used by the held-out set only).

Unlike DFT, a waveform costs milliseconds, and scoring a candidate needs it: the
ensemble can only disagree about a window holding the signal. The budget
therefore counts the waveforms added to the training set, which is what bounds a
detector's training in the field (each one enters every epoch), not simulator time.
Candidates are scored at one SNR, the middle of ``[snr_min, snr_max]``, so the
score ranks waveforms, not loudness.

Held out: for each test binary, its window at its ``snr`` (label 1) and a noise
window (label 0). Error = mean probability - label; spread = the members' std of
the probability; metrics: binary cross-entropy and error rate at probability 0.5.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ...simulate.sample import draw_parameters
from ...validate.active import HeldOut
from ...validate.ensemble import EnsembleModel, EnsemblePrediction
from .config import GWConfig
from .pipeline import crop_windows, scale_to_snr, whitened_noise

NOISE_SEED_RANGE = 2**31  # candidate noise seeds are drawn in [0, this)


def candidate_window(cfg: GWConfig, signal: np.ndarray, snr: float | None, noise_seed: int) -> np.ndarray:
    """One whitened window (window_samples,): ``signal`` (stored_samples,) cropped and scaled to ``snr``
    in design-PSD noise, both drawn from ``noise_seed``; ``snr`` None: the noise alone."""
    g = torch.Generator().manual_seed(int(noise_seed))
    noise = whitened_noise(cfg, 1, g)[0]  # (T,)
    if snr is None:
        return noise.numpy()
    span = len(signal) - cfg.window_samples
    offset = torch.randint(0, span + 1, (1,), generator=g)
    window = scale_to_snr(crop_windows(torch.as_tensor(signal, dtype=torch.float32)[None], offset,
                                       cfg.window_samples), torch.tensor([float(snr)]))[0]
    return (noise + window).numpy()


def binary_cross_entropy(probability: np.ndarray, label: np.ndarray, eps: float = 1e-7) -> np.ndarray:
    """``-[y log p + (1 - y) log(1 - p)]`` per window, p clipped to [eps, 1 - eps]."""
    p = np.clip(np.asarray(probability, dtype=np.float64), eps, 1 - eps)
    return -(label * np.log(p) + (1 - label) * np.log1p(-p))


class GWLearning:
    """Active learning's view of the gw app (:class:`~converge.validate.active.LearningProblem`)."""

    curve_metrics = ("bce", "error_rate")

    def __init__(self, app: Any, app_cfg: GWConfig, target_error: float = 0.1) -> None:
        self.app, self.app_cfg, self.target_error = app, app_cfg, float(target_error)
        self.score_snr = 0.5 * (app_cfg.snr_min + app_cfg.snr_max)

    @property
    def settings(self) -> dict[str, Any]:
        return {"score_snr": self.score_snr, "target_error_probability": self.target_error}

    def draw(self, seed: int, n: int) -> list[dict[str, float]]:
        """``n`` binaries from the app's prior, each with a noise seed and a held-out SNR."""
        rng = np.random.default_rng([seed, 7])  # the extras: a stream of their own, apart from the prior's
        cfg = self.app_cfg
        return [{**draw_parameters(self.app, cfg, seed, i), "noise_seed": float(rng.integers(NOISE_SEED_RANGE)),
                 "snr": float(rng.uniform(cfg.snr_min, cfg.snr_max))} for i in range(n)]

    def draw_test(self, seed: int, n: int) -> list[dict[str, float]]:
        """The held-out binaries: drawn as the candidates are, from the prior."""
        return self.draw(seed, n)

    def label(self, params: Mapping[str, float]) -> dict[str, np.ndarray]:
        """The waveform: the app's simulator."""
        return self.app.simulate(self.app_cfg, params)

    def inputs(self, params: Sequence[Mapping[str, float]]) -> dict[str, np.ndarray]:
        """Each candidate's window at ``score_snr``; makes its waveform (milliseconds, see the module doc)."""
        windows = [candidate_window(self.app_cfg, self.label(p)["signal"], self.score_snr, int(p["noise_seed"]))
                   for p in params]
        return {"strain": np.stack(windows).astype(np.float32)}  # (N, T)

    def disagreement(self, prediction: EnsemblePrediction, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """The members' std of the signal probability."""
        return np.asarray(prediction.std["probability"], dtype=np.float64)

    def descriptors(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError("gw: batch diversity has no descriptor (a window is mostly noise); "
                                  "use diversity 0")

    def held_out(self, ensemble: EnsembleModel, arrays: Mapping[str, np.ndarray],
                 params: Mapping[str, np.ndarray]) -> HeldOut:
        """Each test binary at its SNR (label 1) and a noise window (label 0), through the ensemble."""
        cfg, seeds = self.app_cfg, np.asarray(params["noise_seed"]).astype(np.int64)
        signal = [candidate_window(cfg, s, float(snr), int(seed))
                  for s, snr, seed in zip(arrays["signal"], params["snr"], seeds)]
        noise = [candidate_window(cfg, s, None, int(seed) + 1) for s, seed in zip(arrays["signal"], seeds)]
        label = np.repeat([1.0, 0.0], len(signal))  # (2N,)
        prediction = ensemble.predict({"strain": np.stack(signal + noise).astype(np.float32)})
        probability = np.asarray(prediction.mean["probability"], dtype=np.float64)
        spread = np.asarray(prediction.std["probability"], dtype=np.float64)
        metrics = {"n_test": int(len(label)), "bce": float(np.mean(binary_cross_entropy(probability, label))),
                   "error_rate": float(np.mean((probability > 0.5) != (label > 0.5))),
                   "mean_probability_spread": float(np.mean(spread))}
        return HeldOut(metrics, spread, probability - label, "signal probability", "probability")

    def after_training(self, ensemble_dir: Path, arrays: Mapping[str, np.ndarray]) -> None:
        """Nothing to add: gw has no out-of-distribution envelope."""
