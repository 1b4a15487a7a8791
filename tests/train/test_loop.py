"""The trainer: checkpoints round-trip bit for bit, --resume continues exactly."""
import json

import numpy as np
import pytest
import torch

from converge.apps.gw.app import GWApp
from converge.apps.gw.config import GWConfig
from converge.apps.gw.waveforms import sample_bbh_parameters, whitened_signal
from converge.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from converge.train.loop import TrainConfig, load_model, train

CFG = GWConfig(channels=(4, 4, 8), hidden=8)


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(3)
    return {"signal": np.stack([whitened_signal(CFG, sample_bbh_parameters(CFG, rng)) for _ in range(48)])}


def small(**kw):
    return TrainConfig(**{"epochs": 3, "batch_size": 16, "precision": "fp32", "patience": 10, **kw})


def test_checkpoint_round_trip_gives_bit_identical_outputs(arrays, tmp_path):
    app = GWApp()
    train(app, CFG, small(epochs=1), arrays, tmp_path, progress=False)
    model, _ = load_model(app, tmp_path, "last")
    x = torch.randn(5, CFG.window_samples)
    with torch.inference_mode():
        before = model(x)
    save_checkpoint(tmp_path / "copy.pt", {"model": model.state_dict(), "config": {"app": "gw",
                    "app_config": json.loads(json.dumps(__import__("dataclasses").asdict(CFG)))}})
    again, _ = load_model(app, tmp_path, "copy")
    with torch.inference_mode():
        assert torch.equal(before, again(x))


def test_resume_continues_at_the_next_epoch_and_matches_an_uninterrupted_run(arrays, tmp_path):
    app = GWApp()
    full = train(app, CFG, small(), arrays, tmp_path / "full", progress=False)
    # "killed" after two epochs: a run configured for 3 epochs that we stop by training only 2
    train(app, CFG, small(epochs=3), arrays, tmp_path / "cut", progress=False, stop_after=2)
    assert load_checkpoint(tmp_path / "cut" / "last.pt")["epoch"] == 1
    resumed = train(app, CFG, small(), arrays, tmp_path / "cut", resume=True, progress=False)
    assert resumed.epochs_run == 1 and [h["epoch"] for h in resumed.history] == [0, 1, 2]
    a = load_checkpoint(tmp_path / "full" / "last.pt")["model"]
    b = load_checkpoint(tmp_path / "cut" / "last.pt")["model"]
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert full.history[-1]["val_loss"] == pytest.approx(resumed.history[-1]["val_loss"], rel=0, abs=0)
    lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [0, 1, 2]


class KilledAt(GWApp):
    """The gw app, but the process "dies" as epoch ``at`` starts."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_epoch_start(self, source, epoch, epochs):
        if epoch == self.at:
            raise KeyboardInterrupt(f"killed at epoch {epoch}")
        super().on_epoch_start(source, epoch, epochs)


def test_sparse_checkpoints_resume_from_the_last_write_and_match_every_epoch_checkpoints(arrays, tmp_path):
    app = GWApp()
    dense = train(app, CFG, small(epochs=5), arrays, tmp_path / "dense", progress=False)
    with pytest.raises(KeyboardInterrupt):  # epochs 0-2 ran; only epoch 1 was written (every 2nd)
        train(KilledAt(3), CFG, small(epochs=5, checkpoint_every=2), arrays, tmp_path / "sparse", progress=False)
    assert load_checkpoint(tmp_path / "sparse" / "last.pt")["epoch"] == 1
    resumed = train(app, CFG, small(epochs=5, checkpoint_every=2), arrays, tmp_path / "sparse", resume=True,
                    progress=False)
    assert resumed.epochs_run == 3 and [h["epoch"] for h in resumed.history] == [0, 1, 2, 3, 4]
    assert load_checkpoint(tmp_path / "sparse" / "last.pt")["epoch"] == 4  # the last epoch is always written
    for which in ("last", "best"):  # best.pt holds the best epoch's model, kept in memory until the next write
        a = load_checkpoint(tmp_path / "dense" / f"{which}.pt")
        b = load_checkpoint(tmp_path / "sparse" / f"{which}.pt")
        assert a["epoch"] == b["epoch"] and a["best_epoch"] == b["best_epoch"] == dense.best_epoch
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key]), (which, key)
    with pytest.raises(Exception, match="checkpoint_every=0: must be >= 1"):
        small(checkpoint_every=0)


@pytest.mark.parametrize("dies_in", ["_log_epoch", "save_checkpoint"])
def test_a_kill_at_either_write_of_an_epoch_resumes_with_every_epoch_logged_once(arrays, tmp_path, monkeypatch,
                                                                                  dies_in):
    """Epoch 1's metrics line and its checkpoint are two writes: a kill at either one (before its write) must
    resume to a metrics.jsonl of exactly [0, 1, 2]. Writing the checkpoint first lost epoch 1's line."""
    import converge.train.loop as loop

    real = getattr(loop, dies_in)

    def dying(*a, **kw):
        record = a[-1]  # _log_epoch(run_dir, writer, record) / save_checkpoint(path, payload)
        if record.get("epoch") == 1 and not str(a[0]).endswith("best.pt"):
            raise KeyboardInterrupt(f"killed in {dies_in} of epoch 1")
        return real(*a, **kw)

    monkeypatch.setattr(loop, dies_in, dying)
    with pytest.raises(KeyboardInterrupt):
        train(GWApp(), CFG, small(), arrays, tmp_path, progress=False)
    monkeypatch.setattr(loop, dies_in, real)
    assert load_checkpoint(tmp_path / "last.pt")["epoch"] == 0  # epoch 1's checkpoint never landed
    resumed = train(GWApp(), CFG, small(), arrays, tmp_path, resume=True, progress=False)
    assert resumed.epochs_run == 2
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [0, 1, 2]


def test_training_learns_loud_signals(arrays, tmp_path):
    cfg = GWConfig(channels=(8, 8, 16), hidden=16, snr_min=15.0, snr_max=30.0, curriculum_snr=15.0)
    res = train(GWApp(), cfg, small(epochs=4, lr=3e-3), arrays, tmp_path, progress=False)
    assert res.history[-1]["accuracy"] > 0.9


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_cpu(arrays, tmp_path, precision):
    res = train(GWApp(), CFG, small(epochs=1, precision=precision), arrays, tmp_path, progress=False)
    assert np.isfinite(res.history[0]["train_loss"])


def test_corrupt_and_foreign_checkpoints_are_refused(tmp_path, arrays):
    bad = tmp_path / "last.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt or not a converge checkpoint"):
        load_checkpoint(bad)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train(GWApp(), CFG, small(), arrays, tmp_path / "empty", resume=True, progress=False)


def test_resume_with_other_epochs_is_refused(arrays, tmp_path):
    train(GWApp(), CFG, small(epochs=2), arrays, tmp_path, progress=False, stop_after=1)
    with pytest.raises(CheckpointError, match="started with --epochs 2, not 5"):
        train(GWApp(), CFG, small(epochs=5), arrays, tmp_path, resume=True, progress=False)


def test_resume_with_other_app_config_is_refused(arrays, tmp_path):
    train(GWApp(), CFG, small(epochs=1), arrays, tmp_path, progress=False)
    with pytest.raises(CheckpointError, match="different app_config"):
        train(GWApp(), GWConfig(channels=(4, 4, 4), hidden=8), small(), arrays, tmp_path, resume=True,
              progress=False)
