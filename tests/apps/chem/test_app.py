"""The chem app through the spine: a tiny DFT ensemble, training, evaluation, ASE and predict."""
import json

import numpy as np
import pytest
from ase import Atoms
from ase.io import read

from converge.apps.chem import Calculator, ChemApp
from converge.apps.chem.calculator import InputError, check_structure, predict_file
from converge.apps.chem.config import ChemConfig
from converge.apps.chem.evaluate import ChemEvalConfig
from converge.data.store import ShardStore
from converge.simulate.runner import SimulateConfig, run_ensemble
from converge.train.loop import TrainConfig, train

# Water at HF-cost DFT (LDA/STO-3G): seconds for the whole ensemble, real PySCF labels all the same.
CFG = ChemConfig(molecule="water", level="custom", functional="lda,vwn", basis="sto-3g", density_fit=False,
                 grid_level=0, hidden=(16, 16), force_weight=0.1)
WATER = Atoms("OHH", positions=[[0.0, 0.0, 0.117], [0.0, 0.757, -0.467], [0.0, -0.757, -0.467]])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chem")
    app = ChemApp()
    for name, n, seed in (("train", 40, 1), ("test", 10, 2)):
        res = run_ensemble(app, CFG, SimulateConfig(samples=n, seed=seed, workers=1, shard_size=20), root / name,
                           progress=False)
        assert res.n_failed == 0, res.failures
    arrays = ShardStore.open(root / "train").load()
    train(app, CFG, TrainConfig(epochs=40, batch_size=8, lr=3e-3, patience=40), arrays, root / "run",
          progress=False, extra_config={"data": str(root / "train")})
    return root


def test_dataset_holds_dft_labels(run):
    arrays = ShardStore.open(run / "train").load()
    assert arrays["coordinates"].shape == (40, 3, 3) and arrays["forces"].shape == (40, 3, 3)
    assert np.all(arrays["species"] == [8, 1, 1])
    # the stored label is what PySCF gives directly for that conformer
    from pyscf import dft, gto

    mol = gto.M(atom=[("O", p) if z == 8 else ("H", p) for z, p in zip(arrays["species"][0], arrays["coordinates"][0])],
                basis="sto-3g", unit="Angstrom", verbose=0)
    mf = dft.RKS(mol, xc="lda,vwn")
    mf.grids.level = 0
    mf.conv_tol = 1e-10
    assert mf.kernel() == pytest.approx(arrays["energy"][0], abs=1e-7)
    # conformers at 300 K spread by about a kcal/mol, never by hundreds
    spread = (arrays["energy"].max() - arrays["energy"].min()) * 627.5
    assert 0.1 < spread < 50


def test_training_beats_predicting_the_mean_and_evaluation_reports(run):
    ev = ChemEvalConfig(n_dft_timing=1, batch_size=16, ani_timing=False)
    report = ChemApp().evaluate(run / "run", run / "test", run / "run", ev=ev)
    assert report["speed"]["dft_level"] == report["level_of_theory"]  # timed at the level it reproduces
    assert report["energy_mae_kcal_mol"] < 0.5 * report["test"]["baselines"]["mean"]["energy_mae_kcal_mol"]
    assert report["speedup_batched"] > 1 and report["speedup_single"] > 0
    assert "gfn2_xtb" in report["test"]["baselines"] and report["n_train"] == 36
    assert (run / "run" / "parity.png").stat().st_size > 10_000
    assert json.loads((run / "run" / "evaluation.json").read_text())["molecule"] == "water"


def test_ase_calculator_forces_are_minus_the_energy_gradient(run):
    atoms = WATER.copy()
    atoms.calc = Calculator(run / "run")
    numeric = atoms.calc.calculate_numerical_forces(atoms, d=1e-4)
    assert np.allclose(atoms.get_forces(), numeric, atol=1e-6)
    moved = atoms.copy()
    moved.positions += [1.0, -2.0, 0.5]
    moved.calc = Calculator(run / "run")
    assert moved.get_potential_energy() == pytest.approx(atoms.get_potential_energy(), abs=1e-9)


def test_predict_writes_extxyz_with_energies(run, tmp_path):
    WATER.write(tmp_path / "w.xyz")
    out = predict_file(run / "run", tmp_path / "w.xyz")
    frame = read(out)
    calc = Calculator(run / "run")
    energy, _ = calc.predict(WATER.numbers, WATER.positions)
    assert frame.info["energy_hartree"] == pytest.approx(energy[0], abs=1e-4)
    assert frame.get_forces().shape == (3, 3)


@pytest.mark.parametrize("numbers,positions,message", [
    ([17, 1], [[0, 0, 0], [0, 0, 1.3]], r"element\(s\) Cl not supported"),
    ([8, 1, 1], [[0, 0, 0], [0, 0, 0.2], [0, 0.9, 0]], r"atoms 0 and 1 are 0.200 Å apart"),
    ([8, 1, 1], (WATER.positions / 0.529177).tolist(), "look like bohr"),
    ([8, 1, 1], [[0, 0, 0], [0, 0, 1]], r"must be \(n_atoms, 3\)"),
])
def test_bad_structures_are_refused(numbers, positions, message):
    with pytest.raises(InputError, match=message):
        check_structure(numbers, np.asarray(positions, dtype=float), (1, 6, 7, 8))


def test_nve_drift_is_small_for_an_exactly_conservative_potential():
    from ase.calculators.lj import LennardJones

    from converge.apps.chem.md import nve_drift

    cluster = Atoms("Ar4", positions=[[0, 0, 0], [3.8, 0, 0], [0, 3.8, 0], [0, 0, 3.8]])
    cluster.calc = LennardJones(sigma=3.4, epsilon=0.0104, rc=10.0)
    result = nve_drift(cluster, temperature=50.0, duration_ps=1.0, dt_fs=2.0)
    assert result["drift_kcal_mol_ps_atom"] < 1e-3 and result["steps"] == 500
    with pytest.raises(ValueError, match="attach a calculator"):
        nve_drift(WATER.copy())


def test_surrogate_dynamics_runs(run):
    from converge.apps.chem.md import nve_drift

    atoms = WATER.copy()
    atoms.calc = Calculator(run / "run")
    result = nve_drift(atoms, temperature=5.0, duration_ps=0.005, dt_fs=0.25)
    assert result["steps"] == 20 and np.isfinite(result["drift_kcal_mol_ps"])
