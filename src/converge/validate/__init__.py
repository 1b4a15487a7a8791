"""Trusting the surrogate: ensembles and their spread, calibration, active learning, out-of-distribution checks.

- :mod:`.ensemble`: train K members, load them, mean and spread of their outputs;
- :mod:`.calibration`: spread against the actual error on held-out data, and the trust threshold;
- :mod:`.active`: query-by-committee active learning against a random baseline;
- :mod:`.queue`: simulator answers kept by the serving fallback, turned into a dataset.

What a candidate is, how it is labelled and which inputs lie outside the training data
are the app's part (``App.learning_problem``, ``App.distribution_check``).
"""
from .calibration import calibrate, load_calibration, spread_threshold, write_calibration
from .ensemble import EnsembleModel, EnsemblePrediction, load_ensemble, reduce_members, train_ensemble

__all__ = [
    "EnsembleModel", "EnsemblePrediction", "calibrate", "load_calibration", "load_ensemble", "reduce_members",
    "spread_threshold", "train_ensemble", "write_calibration",
]
