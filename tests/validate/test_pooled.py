"""Active learning over a labelled pool: disjoint slices per round, no simulator call, the same pools for both
strategies, and clear errors when the pool is too small or the sets do not fit."""
import json

import numpy as np
import pytest
import torch

from converge.apps.chem import ChemApp, ChemConfig
from converge.config import ConfigError
from converge.data.store import ShardStore
from converge.simulate.sample import draw_parameters
from converge.train.loop import TrainConfig
from converge.data.sources import stream_seed
from converge.validate.active import STREAM_POOL, LearningConfig, compare_strategies, round_dir
from converge.validate.curves import reach_random_final
from converge.validate.pooled import PooledProblem

CFG = ChemConfig(molecule="water", level="fast", hidden=(8,))
TRAIN = TrainConfig(epochs=2, batch_size=4, lr=1e-3, precision="fp32", device="cpu", patience=10)


class CountingChemApp(ChemApp):
    calls = 0

    def simulate(self, cfg, params):
        type(self).calls += 1
        return super().simulate(cfg, params)


@pytest.fixture(scope="module")
def labelled():
    """18 pool and 3 test water conformers, DFT-labelled once (one thread: tiny DFT runs faster so)."""
    from pyscf import lib

    threads = lib.num_threads()
    lib.num_threads(1)
    torch.set_num_threads(1)
    app = ChemApp()
    rows = [app.simulate(CFG, draw_parameters(app, CFG, 5, i)) for i in range(21)]
    lib.num_threads(threads)
    stacked = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    return {k: v[:18] for k, v in stacked.items()}, {k: v[18:] for k, v in stacked.items()}


def test_strategies_see_the_same_disjoint_pools_and_call_no_simulator(tmp_path, labelled):
    pool, test = labelled
    app = CountingChemApp()
    CountingChemApp.calls = 0
    problem = PooledProblem(app.learning_problem(CFG), pool, test, note={"pool": "water, 18 conformers"})
    result = compare_strategies(app, CFG, tmp_path, initial=4, budget=4, rounds=2, pool_size=6, seed=1, members=2,
                                n_test=3, train_cfg=TRAIN, problem=problem)
    assert CountingChemApp.calls == 0
    assert [h["simulator_calls"] for h in result["active"]] == [4, 6, 8] == [h["n_train"] for h in result["random"]]
    order = np.random.default_rng(stream_seed(1, STREAM_POOL)).permutation(18)  # the pooled problem's own
    used = {}
    for label in ("active", "random"):
        rows = [int(p) for p in ShardStore.open(round_dir(tmp_path / label, 0) / "data").params()["row"]]
        assert rows == order[:4].tolist()
        for r in (1, 2):
            selection = json.loads((round_dir(tmp_path / label, r) / "selection.json").read_text())
            offered = [int(p["row"]) for p in selection["pool"]]
            assert offered == order[4 + 6 * (r - 1): 4 + 6 * r].tolist()  # the round's own slice, for both
            chosen = [offered[i] for i in selection["selected"]]
            rows += chosen
            stored = ShardStore.open(round_dir(tmp_path / label, r) / "data").load()
            np.testing.assert_array_equal(stored["energy"], pool["energy"][chosen])  # the pool's labels
            if label == "active":
                scores = np.asarray(selection["disagreement"])
                assert sorted(selection["selected"]) == sorted(np.argsort(-scores)[:2].tolist())
        assert len(set(rows)) == len(rows) == 8  # no row twice
        used[label] = rows
    assert used["active"][:4] == used["random"][:4]
    held = ShardStore.open(tmp_path / "test").load()
    np.testing.assert_array_equal(held["energy"], test["energy"])
    assert json.loads((tmp_path / "active" / "learning.json").read_text())["problem"]["labelled_pool_rows"] == 18


def test_a_pool_too_small_a_wrong_test_size_or_missing_arrays_are_refused(labelled):
    pool, test = labelled
    problem = PooledProblem(ChemApp().learning_problem(CFG), pool, test)
    with pytest.raises(ConfigError, match=r"4 \+ 3 x 6 = 22 rows, but the labelled pool holds 18"):
        problem.draw_round(LearningConfig(initial=4, budget=6, rounds=3, pool_size=6), 1)
    with pytest.raises(ConfigError, match="the labelled test set has 3 rows; give n_test=3"):
        problem.draw_test(0, 5)
    with pytest.raises(ConfigError, match="the labelled test lacks forces"):
        PooledProblem(ChemApp().learning_problem(CFG), pool, {k: v for k, v in test.items() if k != "forces"})
    padded = {**pool, "species": np.pad(pool["species"], ((0, 0), (0, 2)), constant_values=-1)}
    with pytest.raises(ConfigError, match=r"pool's species is int64 \(5,\) per row, the app's schema says int64 "
                                          r"\(3,\).*app.max_atoms"):
        PooledProblem(ChemApp().learning_problem(CFG), padded, test)
    with pytest.raises(NotImplementedError, match="use draw_round"):
        problem.draw(0, 3)


def test_reach_random_final_interpolates_and_says_never():
    def curve(errors):
        return [{"simulator_calls": c, "mae": e} for c, e in zip((100, 200, 300, 400), errors)]

    out = reach_random_final({"active": curve([4.0, 2.0, 1.0, 0.8]), "random": curve([4.0, 3.0, 2.5, 1.5])}, "mae")
    assert out["active_calls_to_reach_random_final"] == pytest.approx(250.0)
    assert out["fraction_of_random_calls"] == pytest.approx(250 / 400)
    assert out["random_final"] == 1.5 and out["active_final"] == 0.8
    never = reach_random_final({"active": curve([4.0, 3.0, 2.6, 2.0]), "random": curve([4.0, 3.0, 2.5, 1.5])}, "mae")
    assert never["active_calls_to_reach_random_final"] is None and never["fraction_of_random_calls"] is None
