"""Ensembles: mean and spread against hand-made members; training resumes member by member."""
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import numpy as np
import pytest
import torch
from torch import nn

from converge.contract import App, ArraySpec, Monitor
from converge.data.sources import ArraySource, split_indices
from converge.train.loop import TrainConfig, load_model, train
from converge.validate.ensemble import (ENSEMBLE_FILE, EnsembleError, EnsembleModel, load_ensemble, member_config,
                                        member_dir, reduce_members, train_ensemble,
                                        train_member)


@dataclass(frozen=True)
class LinearConfig:
    pass


class LinearApp(App):
    """y = w . x + b: the smallest app the trainer and the ensemble accept."""

    name = "linear"
    config_cls = LinearConfig
    monitor = Monitor("val_loss", "min")

    def schema(self, cfg: Any) -> dict[str, ArraySpec]:
        return {"input": ArraySpec((3,), "float32"), "target": ArraySpec((), "float32")}

    def sample_parameters(self, cfg: Any, rng: np.random.Generator) -> dict[str, float]:
        return {}

    def simulate(self, cfg: Any, params: Mapping[str, float]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def make_model(self, cfg: Any) -> nn.Module:
        return nn.Linear(3, 1)

    def make_datasets(self, cfg, arrays, seed, val_fraction):
        tensors = {k: torch.as_tensor(v) for k, v in arrays.items()}
        train_idx, val_idx = split_indices(len(tensors["target"]), val_fraction, seed)
        return (ArraySource({k: v[train_idx] for k, v in tensors.items()}, seed=seed),
                ArraySource({k: v[val_idx] for k, v in tensors.items()}, seed=seed, shuffle=False))

    def forward(self, model, batch):
        return model(batch["input"]).squeeze(-1)

    def loss(self, cfg, output, batch):
        return (output - batch["target"]).pow(2).mean()

    def metrics(self, outputs, batches):
        return {"mse": float((outputs - batches["target"]).pow(2).mean())}

    def evaluate(self, run_dir: Path, data_dir: Path, out_dir: Path, **options: Any) -> dict:
        raise NotImplementedError

    def serve_predict(self, model, inputs):
        y = model(inputs["input"].float()).squeeze(-1)
        return {"y": y, "y2": 2 * y}


def linear(weight: float, bias: float = 0.0) -> nn.Linear:
    layer = nn.Linear(3, 1)
    with torch.no_grad():
        layer.weight.fill_(weight)
        layer.bias.fill_(bias)
    return layer


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def test_mean_and_spread_of_hand_made_members():
    ensemble = EnsembleModel(LinearApp(), [linear(1.0), linear(2.0), linear(3.0)])
    x = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [-2.0, 0.0, 0.0]])
    pred = ensemble.predict({"input": x})
    s = x.sum(1).double()  # each member gives w * s
    torch.testing.assert_close(pred.mean["y"], 2 * s)
    torch.testing.assert_close(pred.std["y"], s.abs())  # std of (1, 2, 3) with ddof=1 is 1
    torch.testing.assert_close(pred.std["y2"], 2 * s.abs())
    assert pred.members["y"].shape == (3, 3)
    # against NumPy's std with ddof=1 on random members
    members = [linear(w, b) for w, b in ((0.3, 1.0), (-0.7, 0.2), (1.1, -0.4), (0.0, 0.0))]
    x = torch.randn(7, 3)
    pred = EnsembleModel(LinearApp(), members).predict({"input": x})
    outs = np.stack([m(x).squeeze(-1).detach().numpy() for m in members]).astype(np.float64)
    np.testing.assert_allclose(pred.mean["y"].numpy(), outs.mean(0), rtol=1e-6)
    np.testing.assert_allclose(pred.std["y"].numpy(), outs.std(0, ddof=1), rtol=1e-5)


def test_chunked_prediction_equals_one_batch_and_forward_takes_a_transform():
    ensemble = EnsembleModel(LinearApp(), [linear(0.5, 0.1), linear(-0.2), linear(0.9, -1.0)])
    x = torch.randn(11, 3)
    whole, chunks = ensemble.predict({"input": x}), ensemble.predict({"input": x.numpy()}, batch_size=4)
    for key in ("y", "y2"):
        torch.testing.assert_close(whole.mean[key], chunks.mean[key])
        torch.testing.assert_close(whole.std[key], chunks.std[key])
        torch.testing.assert_close(whole.members[key], chunks.members[key])
    pred = ensemble.predict_forward({"input": x}, transform=torch.sigmoid)
    probs = torch.stack([torch.sigmoid(m(x).squeeze(-1)) for m in ensemble.members]).double()
    torch.testing.assert_close(pred.mean, probs.mean(0))
    torch.testing.assert_close(pred.std, probs.std(0))


def test_gw_spread_of_the_signal_probability():
    from converge.apps.gw.app import GWApp
    from converge.apps.gw.config import GWConfig

    app, cfg = GWApp(), GWConfig(channels=(4, 4, 8), hidden=8)
    members = []
    for seed in range(3):
        torch.manual_seed(seed)
        members.append(app.make_model(cfg).eval())
    strain = torch.randn(5, cfg.window_samples)
    pred = EnsembleModel(app, members).predict({"strain": strain})
    with torch.no_grad():
        probs = torch.stack([torch.sigmoid(m(strain).float()) for m in members]).double()
    torch.testing.assert_close(pred.mean["probability"], probs.mean(0))
    torch.testing.assert_close(pred.std["probability"], probs.std(0))
    assert torch.all(pred.std["probability"] > 0)


def test_reduce_members_keeps_the_output_structure():
    outs = [Pair(torch.full((2,), float(k)), torch.full((2, 3), 2.0 * k)) for k in range(3)]
    pred = reduce_members(outs)
    assert isinstance(pred.mean, Pair) and isinstance(pred.std, Pair)
    torch.testing.assert_close(pred.mean.b, torch.full((2, 3), 2.0, dtype=torch.float64))
    torch.testing.assert_close(pred.std.a, torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="at least 2 members"):
        reduce_members(outs[:1])
    with pytest.raises(ValueError, match="at least 2 members"):
        EnsembleModel(LinearApp(), [linear(1.0)])
    with pytest.raises(TypeError, match="NamedTuple"):
        reduce_members([[torch.zeros(1)], [torch.zeros(1)]])


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    return {"input": x, "target": (x @ np.array([1.0, -2.0, 0.5]) + 0.3).astype(np.float32)}


CFG = TrainConfig(epochs=3, batch_size=8, lr=1e-2, precision="fp32", patience=10, device="cpu")


def stamp(path: Path) -> int:
    return path.stat().st_mtime_ns


def test_finished_members_are_not_retrained_and_more_can_be_added(arrays, tmp_path):
    app = LinearApp()
    record = train_ensemble(app, LinearConfig(), CFG, arrays, tmp_path, members=2)
    assert record["seeds"] == [0, 1] and record["members"] == 2
    before = {i: (stamp(member_dir(tmp_path, i) / "best.pt"), stamp(member_dir(tmp_path, i) / "done.json"))
              for i in range(2)}
    record = train_ensemble(app, LinearConfig(), CFG, arrays, tmp_path, members=3)
    for i in range(2):
        assert (stamp(member_dir(tmp_path, i) / "best.pt"), stamp(member_dir(tmp_path, i) / "done.json")) == before[i]
    assert record["members"] == 3 and (member_dir(tmp_path, 2) / "done.json").is_file()
    ensemble = load_ensemble(app, tmp_path)
    assert len(ensemble) == 3
    weights = [m.weight.detach().clone() for m in ensemble.members]
    assert not torch.equal(weights[0], weights[1])  # different seeds, different members
    with pytest.raises(EnsembleError, match="different train"):
        train_ensemble(app, LinearConfig(), replace(CFG, lr=1e-3), arrays, tmp_path, members=3)


def test_an_interrupted_member_resumes_where_it_stopped(arrays, tmp_path):
    app = LinearApp()
    train(app, LinearConfig(), member_config(CFG, 0), arrays, member_dir(tmp_path, 0), progress=False, stop_after=1)
    first = (member_dir(tmp_path, 0) / "metrics.jsonl").read_text().splitlines()
    assert len(first) == 1
    train_ensemble(app, LinearConfig(), CFG, arrays, tmp_path, members=2)
    lines = (member_dir(tmp_path, 0) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [0, 1, 2] and lines[0] == first[0]
    # the resumed member equals one trained without interruption
    train(app, LinearConfig(), member_config(CFG, 0), arrays, tmp_path / "straight", progress=False)
    straight = load_model(app, tmp_path / "straight", "last")[0]
    resumed = load_model(app, member_dir(tmp_path, 0), "last")[0]
    torch.testing.assert_close(resumed.weight, straight.weight, rtol=0, atol=0)


def test_load_refuses_a_member_changed_after_the_ensemble_was_recorded(arrays, tmp_path):
    app = LinearApp()
    train_ensemble(app, LinearConfig(), CFG, arrays, tmp_path, members=2)
    train(app, LinearConfig(), replace(member_config(CFG, 1), epochs=4), arrays, member_dir(tmp_path, 1),
          progress=False)
    with pytest.raises(EnsembleError, match="differs from the one recorded"):
        load_ensemble(app, tmp_path)
    (tmp_path / ENSEMBLE_FILE).unlink()
    with pytest.raises(EnsembleError, match="train_ensemble"):
        load_ensemble(app, tmp_path)


def test_members_trained_apart_equal_the_ensemble_and_are_not_retrained(arrays, tmp_path):
    """Side by side (one process or job per member) gives the members train_ensemble would train itself."""
    app = LinearApp()
    for i in (1, 0):  # in any order
        done = train_member(app, LinearConfig(), CFG, arrays, tmp_path / "apart", i)
        assert done["train"]["seed"] == i and done["epochs"] == CFG.epochs
    assert not (tmp_path / "apart" / ENSEMBLE_FILE).exists()  # only train_ensemble records the ensemble
    before = [stamp(member_dir(tmp_path / "apart", i) / "best.pt") for i in range(2)]
    record = train_ensemble(app, LinearConfig(), CFG, arrays, tmp_path / "apart", members=2)
    assert [stamp(member_dir(tmp_path / "apart", i) / "best.pt") for i in range(2)] == before
    train_ensemble(app, LinearConfig(), CFG, arrays, tmp_path / "together", members=2)
    apart, together = load_ensemble(app, tmp_path / "apart"), load_ensemble(app, tmp_path / "together")
    for a, b in zip(apart.members, together.members):
        torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)
    assert record["seeds"] == [0, 1]
    with pytest.raises(EnsembleError, match="different train"):
        train_member(app, LinearConfig(), replace(CFG, lr=1e-3), arrays, tmp_path / "apart", 0)
