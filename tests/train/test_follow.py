"""In-situ training: `train --follow` takes in shards written while it runs."""
import subprocess
import sys

import pytest

from converge.apps.gw.app import GWApp
from converge.apps.gw.config import GWConfig
from converge.data.follow import DatasetFollower, FollowTimeout
from converge.simulate.runner import SimulateConfig, run_ensemble
from converge.train.loop import TrainConfig, train

CFG = GWConfig(channels=(4, 4, 8), hidden=8)


def test_training_takes_in_shards_written_between_epochs(tmp_path):
    app, data = GWApp(), tmp_path / "data"
    sim = SimulateConfig(samples=64, seed=5, shard_size=16, workers=1)
    run_ensemble(app, CFG, sim, data, progress=False, max_shards=1)  # the ensemble has only begun
    follower = DatasetFollower.wait(data, poll_s=0.01)
    assert not follower.complete and follower.planned_samples == 64
    tcfg = TrainConfig(epochs=3, batch_size=8, precision="fp32", patience=10)
    train(app, CFG, tcfg, follower.refresh(), tmp_path / "run", progress=False, stop_after=1, follow=follower)
    assert follower.refresh() is None  # nothing new yet
    run_ensemble(app, CFG, sim, data, progress=False)  # the rest lands while training goes on
    rest = train(app, CFG, tcfg, follower.store.load(shards=[0]), tmp_path / "run", resume=True,
                 progress=False, follow=follower)
    seen = [h["n_train_samples"] for h in rest.history]
    assert follower.complete and seen[0] < seen[1] == seen[2]
    full, _ = app.make_datasets(CFG, follower.store.load(), tcfg.seed, tcfg.val_fraction)
    assert seen[1] == len(full)  # every stored sample but the validation split


def test_waiting_for_a_dataset_that_never_comes_says_so(tmp_path):
    with pytest.raises(FollowTimeout, match="no dataset yet"):
        DatasetFollower.wait(tmp_path / "nothing", timeout_s=0.05, poll_s=0.01)


def test_follow_with_data_or_nproc_is_refused(tmp_path):
    cmd = [sys.executable, "-m", "converge", "train", "gw", "--out", str(tmp_path / "r"), "--follow", str(tmp_path),
           "--data", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--data DIR, or with --follow" in res.stdout + res.stderr
