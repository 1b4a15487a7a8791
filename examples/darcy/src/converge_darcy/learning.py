"""The darcy app's part of active learning: which permeability fields are worth a solve.

A candidate is its parameters ``{"permeability_seed"}``, drawn from the app's
prior as ``converge simulate`` draws them; its permeability field costs a
spectral transform (no solve), so thousands are cheap to score. Labelling one is
the app's simulator. The held-out set is drawn the same way (the surrogate must
answer for the prior).

Scores and errors are on the scale of the relative L2 error:

- disagreement (and spread) per field: ``||std||_2 / ||mean||_2`` of the members'
  pressure (:func:`~converge_darcy.app.relative_spread`);
- error per field: ``||mean - u||_2 / ||u||_2``, the ensemble mean's relative L2
  error (>= 0; calibration compares it with the spread);
- descriptors for batch diversity: the permeability averaged over 8 x 8 blocks
  (of the field's nodes, the last blocks absorbing any remainder), so two fields
  are close when their phases lie alike at that scale.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from converge.simulate.sample import draw_parameters
from converge.validate.active import HeldOut
from converge.validate.ensemble import EnsembleModel, EnsemblePrediction

from .app import permeability_of, relative_spread
from .config import DarcyConfig

DESCRIPTOR_BLOCKS = 8  # blocks per side of the coarse permeability descriptor


def block_average(fields: np.ndarray, blocks: int = DESCRIPTOR_BLOCKS) -> np.ndarray:
    """Mean of each field (N, X, Y) over ``blocks`` x ``blocks`` near-equal blocks: (N, blocks * blocks)."""
    fields = np.asarray(fields, dtype=np.float64)
    rows = np.array_split(np.arange(fields.shape[1]), blocks)
    cols = np.array_split(np.arange(fields.shape[2]), blocks)
    return np.stack([fields[:, r][:, :, c].mean(axis=(1, 2)) for r in rows for c in cols], axis=1)


class DarcyLearning:
    """Active learning's view of the darcy app (:class:`~converge.validate.active.LearningProblem`)."""

    curve_metrics = ("relative_l2",)

    def __init__(self, app: Any, app_cfg: DarcyConfig, target_error: float = 0.02) -> None:
        self.app, self.app_cfg, self.target_error = app, app_cfg, float(target_error)

    @property
    def settings(self) -> dict[str, Any]:
        return {"target_error_relative_l2": self.target_error}

    def draw(self, seed: int, n: int) -> list[dict[str, float]]:
        """``n`` candidates from the prior: sample ``i`` draws as ``converge simulate --seed SEED`` would."""
        return [draw_parameters(self.app, self.app_cfg, seed, i) for i in range(n)]

    def draw_test(self, seed: int, n: int) -> list[dict[str, float]]:
        """The held-out fields: from the prior, as the candidates are."""
        return self.draw(seed, n)

    def inputs(self, params: Sequence[Mapping[str, float]]) -> dict[str, np.ndarray]:
        """The candidates' permeability fields (N, n, n) float32, without a solve."""
        fields = [permeability_of(self.app_cfg, p["permeability_seed"]) for p in params]
        return {"permeability": np.stack(fields).astype(np.float32)}

    def label(self, params: Mapping[str, float]) -> dict[str, np.ndarray]:
        """One solve: the app's simulator."""
        return self.app.simulate(self.app_cfg, params)

    def disagreement(self, prediction: EnsemblePrediction, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """The members' relative spread of the pressure per candidate."""
        return relative_spread(prediction.mean["pressure"].numpy(), prediction.std["pressure"].numpy())

    def descriptors(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """Block-averaged permeability (N, 64): alike fields are close (batch diversity)."""
        return block_average(inputs["permeability"])

    def held_out(self, ensemble: EnsembleModel, arrays: Mapping[str, np.ndarray],
                 params: Mapping[str, np.ndarray]) -> HeldOut:
        """Relative L2 error of the ensemble mean and the relative spread, per test field."""
        prediction = ensemble.predict({"permeability": np.asarray(arrays["permeability"], dtype=np.float32)})
        mean = prediction.mean["pressure"].numpy()  # (N, n, n) float64
        true = np.asarray(arrays["pressure"], dtype=np.float64)
        error = np.linalg.norm((mean - true).reshape(len(true), -1), axis=1) / np.linalg.norm(
            true.reshape(len(true), -1), axis=1)
        spread = relative_spread(mean, prediction.std["pressure"].numpy())
        metrics = {"n_test": int(len(true)), "relative_l2": float(np.mean(error)),
                   "relative_l2_median": float(np.median(error)), "mean_relative_spread": float(np.mean(spread))}
        return HeldOut(metrics, spread, error, "relative L2 error of u", "fraction")

    def after_training(self, ensemble_dir: Path, arrays: Mapping[str, np.ndarray]) -> None:
        """Nothing to add: darcy records no training envelope."""
