"""Active learning: the selection rule, and a tiny chem run that finishes and resumes round by round."""
import json

import numpy as np
import pytest
import torch

from converge.apps.chem import ChemApp, ChemConfig
from converge.config import ConfigError
from converge.data.store import ShardStore
from converge.train.loop import TrainConfig
from converge.validate.active import (
    LearningConfig,
    median_distance,
    round_dir,
    run_active_learning,
    select_candidates,
    share_initial_round,
)
from converge.validate.curves import calls_to_reach, mean_curve
from converge.apps.chem.learning import (
    ChemLearning,
    atom_force_spread,
    energy_spread_per_atom,
    interatomic_distances,
    share_sequence,
)
from converge.validate.ensemble import EnsemblePrediction
from converge.apps.chem.ood import check_in_distribution, load_envelope


def test_qbc_picks_the_highest_disagreement():
    scores = np.array([0.1, 5.0, 0.3, 2.0, 0.2, 9.0, 2.0])
    picked = select_candidates(scores, 3, "qbc", np.random.default_rng(0))
    assert picked.tolist() == [5, 1, 3]  # highest first; the tie 3/6 goes to pool order
    assert set(select_candidates(scores, 4, "qbc", np.random.default_rng(0))) == {5, 1, 3, 6}
    # a candidate the ensemble cannot score (NaN, inf) is the most worth labelling
    assert select_candidates(np.array([1.0, np.nan, 3.0]), 1, "qbc", np.random.default_rng(0)).tolist() == [1]


def test_random_selection_ignores_scores_and_repeats_with_its_seed():
    scores = np.arange(100.0)
    a = select_candidates(scores, 10, "random", np.random.default_rng(7))
    b = select_candidates(-scores, 10, "random", np.random.default_rng(7))
    assert a.tolist() == b.tolist() and len(set(a.tolist())) == 10 and a.max() < 100
    assert a.tolist() != list(range(90, 100))
    with pytest.raises(ValueError, match="cannot select 5 of 3"):
        select_candidates(np.zeros(3), 5, "qbc", np.random.default_rng(0))
    with pytest.raises(ValueError, match="strategy"):
        select_candidates(np.zeros(3), 1, "greedy", np.random.default_rng(0))


def test_budget_split_and_settings_errors():
    assert LearningConfig(budget=10, rounds=4, pool_size=100).round_sizes() == [3, 3, 2, 2]
    with pytest.raises(ConfigError, match="every round labels at least one"):
        LearningConfig(budget=2, rounds=3)
    with pytest.raises(ConfigError, match="pool_size"):
        LearningConfig(budget=40, rounds=2, pool_size=10)
    with pytest.raises(ConfigError, match="qbc, random"):
        LearningConfig(strategy="uncertainty")
    assert calls_to_reach([10, 20, 30], [3.0, 1.5, 0.9], 1.5) == 20.0
    assert calls_to_reach([10, 20], [3.0, 2.0], 1.0) is None


def test_chem_spreads_per_atom_and_per_force():
    species = torch.tensor([[8, 1, 1, 0], [6, 1, 1, 1]])  # water padded, methane
    torch.testing.assert_close(energy_spread_per_atom(torch.tensor([3.0, 4.0]), species),
                               torch.tensor([3.0 / 3**0.5, 2.0]))
    std = torch.zeros(2, 4, 3)
    std[0, 1] = torch.tensor([3.0, 4.0, 0.0])
    assert atom_force_spread(std)[0].tolist() == [0.0, 5.0, 0.0, 0.0]
    prediction = EnsemblePrediction({"energy": torch.zeros(2)}, {"energy": torch.tensor([0.001, 0.0])}, None)
    problem = ChemLearning(ChemApp(), ChemConfig(molecule="water"))
    scores = problem.disagreement(prediction, {"species": species.numpy()})
    assert scores[0] == pytest.approx(627.5095 * 0.001 / 3**0.5, rel=1e-5) and scores[1] == 0.0


class CountingChemApp(ChemApp):
    """The chem app, counting its simulator (DFT) calls."""

    calls = 0

    def simulate(self, cfg, params):
        type(self).calls += 1
        return super().simulate(cfg, params)


CFG = ChemConfig(molecule="water", level="fast", hidden=(8,))
TRAIN = TrainConfig(epochs=2, batch_size=4, lr=1e-3, precision="fp32", device="cpu", patience=10)
SETTINGS = dict(initial=4, budget=4, rounds=2, pool_size=16, strategy="qbc", seed=3, members=2, n_test=4,
                train_cfg=TRAIN)


@pytest.fixture
def one_thread():
    """One thread for PySCF and torch: on a small shared machine, tiny DFT and tiny nets run faster so."""
    from pyscf import lib

    pyscf_threads, torch_threads = lib.num_threads(), torch.get_num_threads()
    lib.num_threads(1)
    torch.set_num_threads(1)
    yield
    lib.num_threads(pyscf_threads)
    torch.set_num_threads(torch_threads)


def test_tiny_chem_run_finishes_and_resumes_after_its_last_finished_round(tmp_path, one_thread):
    app = CountingChemApp()
    CountingChemApp.calls = 0
    history = run_active_learning(app, CFG, tmp_path, stop_after=2, **SETTINGS)
    assert [h["round"] for h in history] == [0, 1]
    assert CountingChemApp.calls == 4 + 4 + 2  # test set, initial set, round 1
    assert not (round_dir(tmp_path, 2)).exists()
    finished = {r: (round_dir(tmp_path, r) / "metrics.json").stat().st_mtime_ns for r in (0, 1)}

    history = run_active_learning(app, CFG, tmp_path, **SETTINGS)
    assert CountingChemApp.calls == 10 + 2  # only round 2's candidates were simulated
    assert {r: (round_dir(tmp_path, r) / "metrics.json").stat().st_mtime_ns for r in (0, 1)} == finished
    assert [h["simulator_calls"] for h in history] == [4, 6, 8]
    assert [h["n_train"] + h["failed"] for h in history] == [4, 6, 8]
    for h in history:
        assert np.isfinite(h["energy_mae_kcal_mol"]) and np.isfinite(h["force_mae_kcal_mol_A"])
        assert h["mean_energy_spread_kcal_mol"] > 0 and set(h["energy_mae_by_temperature"]) == {"300", "600"}

    # round 2 labelled the two highest-disagreement candidates of its pool
    selection = json.loads((round_dir(tmp_path, 2) / "selection.json").read_text())
    scores = np.asarray(selection["disagreement"])
    assert len(scores) == 16 and sorted(selection["selected"]) == sorted(np.argsort(-scores)[:2].tolist())
    assert history[2]["selected_mean_disagreement"] >= history[2]["pool_mean_disagreement"]

    ensemble_dir = round_dir(tmp_path, 2) / "ensemble"
    assert json.loads((ensemble_dir / "calibration.json").read_text())["n"] == 4
    envelope = load_envelope(ensemble_dir)
    trained = ShardStore.open(round_dir(tmp_path, 0) / "data").load()
    assert check_in_distribution(envelope, trained["species"][0], trained["coordinates"][0]) == []
    assert envelope.n_conformers == history[2]["n_train"]
    assert (tmp_path / "learning_curve.png").is_file()
    assert len(json.loads((tmp_path / "learning_curve.json").read_text())) == 3

    with pytest.raises(ConfigError, match="other learn settings"):
        run_active_learning(app, CFG, tmp_path, **{**SETTINGS, "pool_size": 32})


# -- batch diversity, shared round 0, curves ---------------------------------------------
def test_diverse_selection_takes_the_most_disputed_but_never_two_near_duplicates():
    scores = np.array([9.0, 8.9, 5.0, 4.0, 1.0])
    points = np.array([[0.0, 0.0], [0.01, 0.0], [3.0, 0.0], [0.0, 3.0], [0.02, 0.01]])  # 0, 1, 4: one shape
    plain = select_candidates(scores, 3, "qbc", np.random.default_rng(0))
    assert plain.tolist() == [0, 1, 2]  # top-k alone spends two calls on the near-duplicates 0 and 1
    picked = select_candidates(scores, 3, "qbc", np.random.default_rng(0), points, min_distance=0.5)
    assert picked.tolist() == [0, 2, 3]
    chosen = points[picked]
    assert min(np.linalg.norm(chosen[a] - chosen[b]) for a in range(3) for b in range(a)) >= 0.5
    # too few distinct candidates: the skipped ones fill the batch, most disputed first
    assert select_candidates(scores, 4, "qbc", np.random.default_rng(0), points, 0.5).tolist() == [0, 2, 3, 1]
    # random ignores descriptors; a mismatched descriptor array is refused
    assert select_candidates(scores, 2, "random", np.random.default_rng(1), points, 0.5).tolist() == \
        select_candidates(scores, 2, "random", np.random.default_rng(1)).tolist()
    with pytest.raises(ValueError, match="4 descriptors for 5 candidates"):
        select_candidates(scores, 2, "qbc", np.random.default_rng(0), points[:4], 0.5)


def test_median_distance_and_interatomic_descriptors():
    assert median_distance(np.array([[0.0], [1.0], [3.0]])) == pytest.approx(2.0)  # pairs 1, 3, 2
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3))
    q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    moved = x @ q.T + np.array([1.0, -2.0, 0.5])
    np.testing.assert_allclose(interatomic_distances(moved), interatomic_distances(x), atol=1e-12)
    water = np.array([[[0.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]])
    np.testing.assert_allclose(interatomic_distances(water), [[1.0, 2.0, 5**0.5]])
    problem = ChemLearning(ChemApp(), ChemConfig(molecule="water"))
    assert problem.descriptors({"coordinates": water}).shape == (1, 3)


def test_candidates_follow_their_shares_and_the_test_set_takes_every_temperature_alike():
    assert share_sequence([1, 1, 1], 7) == [0, 1, 2, 0, 1, 2, 0]  # equal shares: a plain cycle
    order = share_sequence([8, 4, 2, 1], 150)
    for n in range(1, 151):  # every prefix holds each temperature within one of its quota
        counts = np.bincount(order[:n], minlength=4)
        assert np.all(np.abs(counts - n * np.array([8, 4, 2, 1]) / 15) < 1), n
    problem = ChemLearning(ChemApp(), ChemConfig(molecule="water"), temperatures=(300.0, 1200.0), shares=(3, 1))
    pool = [p["temperature"] for p in problem.draw(seed=5, n=40)]
    assert pool.count(300.0) == 30 and pool.count(1200.0) == 10
    test = [p["temperature"] for p in problem.draw_test(seed=5, n=40)]
    assert test.count(300.0) == test.count(1200.0) == 20
    assert problem.settings["candidate_shares"] == [3.0, 1.0]
    with pytest.raises(ValueError, match="one share > 0 per temperature"):
        ChemLearning(ChemApp(), ChemConfig(molecule="water"), temperatures=(300.0, 1200.0), shares=(1,))


def test_interpolated_calls_to_reach_and_mean_curves():
    assert calls_to_reach([10, 20, 30], [3.0, 2.0, 1.0], 1.5, interpolate=True) == pytest.approx(25.0)
    assert calls_to_reach([10, 20, 30], [3.0, 2.0, 1.0], 1.5) == 30.0
    assert calls_to_reach([10, 20], [1.0, 0.5], 2.0, interpolate=True) == 10.0  # reached at the first point
    assert calls_to_reach([10, 20], [3.0, 2.0], 1.0, interpolate=True) is None
    a = [{"simulator_calls": 8, "mae": 2.0}, {"simulator_calls": 16, "mae": 1.0}]
    b = [{"simulator_calls": 8, "mae": 4.0}, {"simulator_calls": 16, "mae": 2.0}]
    assert mean_curve([a, b], "mae") == ([8.0, 16.0], [3.0, 1.5])
    with pytest.raises(ValueError, match="differ in their simulator calls"):
        mean_curve([a, b[:1]], "mae")
    with pytest.raises(ConfigError, match="learn.diversity"):
        LearningConfig(diversity=1.5)


def test_round_zero_is_shared_between_strategies(tmp_path):
    source = round_dir(tmp_path / "active", 0)
    (source / "ensemble").mkdir(parents=True)
    (source / "ensemble" / "ensemble.json").write_text("{}")
    assert not share_initial_round(tmp_path / "active", tmp_path / "random", "random")  # unfinished: no copy
    (source / "metrics.json").write_text(json.dumps({"round": 0, "strategy": "qbc", "simulator_calls": 8}))
    assert share_initial_round(tmp_path / "active", tmp_path / "random", "random")
    copied = round_dir(tmp_path / "random", 0)
    assert json.loads((copied / "metrics.json").read_text())["strategy"] == "random"
    assert (copied / "ensemble" / "ensemble.json").read_text() == "{}"
    assert not share_initial_round(tmp_path / "active", tmp_path / "random", "random")  # already there


def test_learn_cli_passes_diversity_and_rejects_a_bad_one(tmp_path, one_thread, monkeypatch):
    from typer.testing import CliRunner

    from converge import cli as cli_module
    from converge.validate import active

    seen = {}
    monkeypatch.setattr(active, "run_active_learning", lambda app, cfg, out, **kw: seen.update(kw) or [{}])
    runner = CliRunner()
    result = runner.invoke(cli_module.cli, ["learn", "chem", "--out", str(tmp_path / "a"), "--diversity", "0.3"])
    assert result.exit_code == 0, result.output
    assert seen["diversity"] == 0.3 and seen["strategy"] == "qbc"
    monkeypatch.undo()
    result = runner.invoke(cli_module.cli, ["learn", "chem", "--out", str(tmp_path / "b"), "--diversity", "1.5",
                                            "--set", "app.molecule=water"])
    assert result.exit_code == 2 and "learn.diversity=1.5" in result.output
    monkeypatch.setattr(active, "run_active_learning", lambda app, cfg, out, **kw: seen.update(kw) or [{}])
    result = runner.invoke(cli_module.cli, ["learn", "chem", "--out", str(tmp_path / "c"), "--set",
                                            "learn.temperatures=300,1200", "--set", "learn.shares=3,1"])
    assert result.exit_code == 0, result.output
    assert seen["problem"].temperatures == (300.0, 1200.0) and seen["problem"].shares == (3.0, 1.0)
    for args, message in ((["--set", "learn.shares=3,1,1"], "one share > 0 per temperature (2)"),
                          (["--set", "learn.shares=3,x"], "learn.shares: expected a number, got 'x"),
                          (["--set", "learn.temperatures=-5"], "give temperatures > 0 K"),
                          (["--set", "learn.colour=red"], "unknown key learn.colour")):
        result = runner.invoke(cli_module.cli, ["learn", "chem", "--out", str(tmp_path / "d"), "--set",
                                                "learn.temperatures=300,1200", *args])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    result = runner.invoke(cli_module.cli, ["learn", "gw", "--out", str(tmp_path / "e"), "--set", "learn.shares=1,1"])
    assert result.exit_code == 2 and "app 'gw' takes no [learn] options" in result.output
