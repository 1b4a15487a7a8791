"""simulate -> train --ensemble through the command line on a tiny chem set: members, spread, envelope."""
import os
import subprocess
import sys

import numpy as np
import torch

from converge.apps.chem.app import ChemApp
from converge.validate.ensemble import load_ensemble
from converge.apps.chem.ood import check_in_distribution, load_envelope


def converge(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "converge", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_ensemble_run_has_members_a_spread_and_an_envelope(tmp_path):
    data, run = tmp_path / "water", tmp_path / "run"
    converge("simulate", "chem", "--samples", 8, "--out", data, "--set", "app.molecule=water", "--workers", 2,
             "--shard-size", 4)
    converge("train", "chem", "--data", data, "--out", run, "--ensemble", 2, "--epochs", 3, "--batch-size", 4)
    assert (run / "ensemble.json").is_file() and all((run / f"member-{i}" / "best.pt").is_file() for i in (0, 1))
    ensemble = load_ensemble(ChemApp(), run)
    species = torch.tensor([[8, 1, 1]])
    coordinates = torch.tensor([[[0.0, 0.0, 0.12], [0.0, 0.76, -0.47], [0.0, -0.76, -0.47]]])
    prediction = ensemble.predict({"species": species, "coordinates": coordinates})
    assert prediction.std["energy"].shape == (1,) and float(prediction.std["energy"][0]) > 0  # members differ
    envelope = load_envelope(run)
    assert check_in_distribution(envelope, species.numpy()[0], coordinates.numpy()[0]) == []
    squeezed = coordinates.numpy()[0].copy()
    squeezed[1] = squeezed[0] + np.array([0.0, 0.5, 0.0])  # an O-H bond of 0.5 Å: never in training
    assert any("O-H" in reason for reason in check_in_distribution(envelope, species.numpy()[0], squeezed))
