"""Trusting the surrogate: ensembles and their spread, calibration, active learning, out-of-distribution checks.

- :mod:`.ensemble`: train K members, load them, mean and spread of their outputs;
- :mod:`.calibration`: spread against the actual error on held-out data, and the trust threshold;
- :mod:`.active`: query-by-committee active learning against a random baseline;
- :mod:`.chem_learning`: the chem app's candidates, labels and spreads;
- :mod:`.ood`: whether a structure lies inside the chem training set's envelope.
"""
from .calibration import calibrate, load_calibration, spread_threshold, write_calibration
from .ensemble import EnsembleModel, EnsemblePrediction, load_ensemble, reduce_members, train_ensemble
from .ood import TrainingEnvelope, check_in_distribution, fit_envelope, load_envelope, save_envelope

__all__ = [
    "EnsembleModel", "EnsemblePrediction", "TrainingEnvelope", "calibrate", "check_in_distribution", "fit_envelope",
    "load_calibration", "load_ensemble", "load_envelope", "reduce_members", "save_envelope", "spread_threshold",
    "train_ensemble", "write_calibration",
]
