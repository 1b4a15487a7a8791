"""CUDA paths: skipped on CPU-only machines, run on a GPU machine with `pytest -m gpu`."""
import numpy as np
import pytest
import torch

from converge.apps.gw.app import GWApp
from converge.apps.gw.config import GWConfig
from converge.apps.gw.waveforms import sample_bbh_parameters, whitened_signal
from converge.train.loop import TrainConfig, load_model, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_training_on_cuda_with_autocast(tmp_path, precision):
    cfg = GWConfig(channels=(8, 8, 16), hidden=16)
    rng = np.random.default_rng(0)
    arrays = {"signal": np.stack([whitened_signal(cfg, sample_bbh_parameters(cfg, rng)) for _ in range(64)])}
    res = train(GWApp(), cfg, TrainConfig(epochs=2, batch_size=32, precision=precision, device="cuda"), arrays,
                tmp_path, progress=False)
    assert np.isfinite(res.history[-1]["val_loss"])
    model, _ = load_model(GWApp(), tmp_path, device="cuda")
    with torch.inference_mode():
        assert model(torch.randn(4, cfg.window_samples, device="cuda")).shape == (4,)
