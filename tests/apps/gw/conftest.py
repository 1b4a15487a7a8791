"""Shared fixtures of the gw search tests: small two-detector files and a tiny trained coherent run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from converge.apps.gw.app import GWApp
from converge.apps.gw.config import GWConfig
from converge.apps.gw.datafile import write_mlgwsc1
from converge.apps.gw.strainfile import make_network_strain
from converge.apps.gw.waveforms import sample_bbh_parameters

GPS0 = 1_238_166_018.0
FS = 2048
NET = GWConfig.mlgwsc1(1, channels=(4, 8, 8), hidden=8)


@pytest.fixture(scope="session")
def network_strain():
    """96 s of H1 + L1 design-PSD noise with two loud injections (geocentric merger times)."""
    rng = np.random.default_rng(5)
    injections = [{**sample_bbh_parameters(NET, rng), "gps_time": GPS0 + t, "snr": 25.0} for t in (30.3, 61.7)]
    injections[0].update(mass1=30.0, mass2=25.0)
    injections[1].update(mass1=20.0, mass2=14.0)
    data, placed = make_network_strain(NET, 96.0, injections, seed=3, gps_start=GPS0)
    return data, placed


@pytest.fixture(scope="session")
def network_file(tmp_path_factory, network_strain):
    path = tmp_path_factory.mktemp("net") / "fg.hdf"
    write_mlgwsc1(path, [(GPS0, network_strain[0])], FS)
    return path


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A coherent two-detector CNN trained for one short epoch (tests the plumbing, not the physics)."""
    from converge.train.loop import TrainConfig, train

    torch.manual_seed(0)
    app = GWApp()
    rng = np.random.default_rng(0)
    signals = np.stack([app.simulate(NET, app.sample_parameters(NET, rng))["signal"] for _ in range(16)])
    run = tmp_path_factory.mktemp("run")
    train(app, NET, TrainConfig(epochs=1, batch_size=16), {"signal": signals}, run, progress=False)
    return run


@pytest.fixture(scope="session")
def tiny_streaming_run(tmp_path_factory):
    """The tiny run with a CNN of valid convolutions (``conv_padding="valid"``), which searches stream."""
    from dataclasses import replace

    from converge.train.loop import TrainConfig, train

    torch.manual_seed(0)
    app, cfg = GWApp(), replace(NET, conv_padding="valid")
    rng = np.random.default_rng(0)
    signals = np.stack([app.simulate(cfg, app.sample_parameters(cfg, rng))["signal"] for _ in range(16)])
    run = tmp_path_factory.mktemp("stream-run")
    train(app, cfg, TrainConfig(epochs=1, batch_size=16), {"signal": signals}, run, progress=False)
    return run
