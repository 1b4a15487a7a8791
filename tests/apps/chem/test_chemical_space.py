"""One potential over several molecules: a mixed-size DFT dataset from SMILES, training, evaluation, and
`converge screen chem` (conformer search, trust flag, outputs), at HF-cost DFT (LDA/STO-3G)."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from converge import cli as cli_module
from converge.apps.chem import ChemApp, ChemConfig
from converge.apps.chem.evaluate import ChemEvalConfig
from converge.apps.chem.screen import ScreenConfig, relative_kcal
from converge.config import ConfigError
from converge.data.store import ShardStore
from converge.simulate.runner import SimulateConfig, run_ensemble
from converge.train.loop import TrainConfig, train
from converge.validate.ensemble import train_ensemble

CHEAP = dict(level="custom", functional="lda,vwn", basis="sto-3g", density_fit=False, grid_level=0,
             hidden=(16, 16))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    (root / "train.smi").write_text("# three sizes\nO water\nC methane\nCO methanol\n")
    cfg = ChemConfig(molecules=str(root / "train.smi"), **CHEAP)
    app = ChemApp()
    for name, n, seed in (("train", 36, 1), ("test", 9, 2)):
        res = run_ensemble(app, cfg, SimulateConfig(samples=n, seed=seed, workers=1, shard_size=12), root / name,
                           progress=False)
        assert res.n_failed == 0, res.failures
    arrays = ShardStore.open(root / "train").load()
    tcfg = TrainConfig(epochs=30, batch_size=8, lr=3e-3, patience=30)
    train(app, cfg, tcfg, arrays, root / "run", progress=False, extra_config={"data": str(root / "train")})
    train_ensemble(app, cfg, TrainConfig(epochs=5, batch_size=8, lr=3e-3, patience=5), arrays, root / "ens",
                   members=2, progress=False)
    return root, cfg


def test_a_mixed_dataset_is_padded_and_records_each_molecule(mixed):
    root, cfg = mixed
    arrays = ShardStore.open(root / "train").load()
    assert arrays["species"].shape == (36, 6) and arrays["coordinates"].shape == (36, 6, 3)
    assert set(arrays["molecule"].tolist()) == {0, 1, 2}  # conformers spread over the three molecules
    for z, m, f in zip(arrays["species"], arrays["molecule"], arrays["forces"]):
        n = (3, 5, 6)[m]
        assert (z[:n] > 0).all() and (z[n:] == -1).all() and not f[n:].any()
        assert np.abs(f[:n].sum(0)).max() < 1e-4  # DFT forces of an isolated molecule sum to zero


def test_evaluation_reports_relative_energies_and_times_the_trained_level(mixed):
    root, _ = mixed
    report = ChemApp().evaluate(root / "run", root / "test", root / "run",
                                ev=ChemEvalConfig(n_dft_timing=1, batch_size=8, ani_timing=False))
    test = report["test"]
    assert test["n_molecules"] == 3 and test["n"] == 9
    assert test["relative_energy_mae_kcal_mol"] > 0 and test["force_mae_kcal_mol_A"] > 0
    assert "relative_energy_mae_kcal_mol" in test["baselines"]["gfn2_xtb"]
    assert report["speed"]["dft_level"] == report["level_of_theory"]


def test_screen_finds_the_lowest_conformer_and_writes_every_output(mixed, tmp_path):
    root, _ = mixed
    (tmp_path / "in.smi").write_text("CO methanol\nCCO ethanol\n")
    runner = CliRunner()
    result = runner.invoke(cli_module.cli, ["screen", "chem", str(tmp_path / "in.smi"), "--run", str(root / "ens"),
                                            "--out", str(tmp_path / "hits"), "--conformers", "3",
                                            "--max-spread", "1e-9", "--fallback", "dft"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])
    assert summary["molecules"] == 2 and summary["molecules_per_second"] > 0
    rows = list(csv.DictReader((tmp_path / "hits.csv").open()))
    assert [r["name"] for r in rows] == ["methanol", "ethanol"]
    for r in rows:
        energies = [float(x) for x in r["relative_energies_kcal_mol"].split(";")]
        assert energies[0] == 0.0 and energies == sorted(energies)
        assert r["trusted"] == "False" and r["source"] == "dft"  # a spread limit no ensemble meets: DFT answers
    assert (tmp_path / "hits.sdf").read_text().count("$$$$") == 2
    assert "energy_hartree" in (tmp_path / "hits.extxyz").read_text()


def test_screen_errors_say_how_to_fix_them(mixed, tmp_path):
    root, _ = mixed
    runner = CliRunner()
    (tmp_path / "bad.smi").write_text("C[N+](C)(C)C tetramethylammonium\n")
    result = runner.invoke(cli_module.cli, ["screen", "chem", str(tmp_path / "bad.smi"), "--run", str(root / "run"),
                                            "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "charged" in result.output
    (tmp_path / "ok.smi").write_text("C methane\n")
    result = runner.invoke(cli_module.cli, ["screen", "chem", str(tmp_path / "ok.smi"), "--out", str(tmp_path / "y")])
    assert result.exit_code == 2 and "give --run RUN" in result.output
    with pytest.raises(ConfigError, match="choose one of surrogate, xtb, dft"):
        ScreenConfig(method="mp2")


def test_a_molecule_the_run_cannot_answer_gets_its_reason_and_the_screen_goes_on(mixed, tmp_path):
    """An .xyz frame with two atoms 0.3 Å apart (a broken input among good ones): its row says why, the other
    molecules are screened, and nothing of theirs is lost."""
    from ase import Atoms
    from ase.build import molecule
    from ase.io import write

    root, _ = mixed
    broken = molecule("CH3OH")
    broken.positions[1] = broken.positions[0] + [0.3, 0.0, 0.0]
    frames = [molecule("CH3OH"), Atoms(broken), molecule("CH4")]
    for atoms, name in zip(frames, ("methanol", "broken", "methane")):
        atoms.info["name"] = name
    write(tmp_path / "in.xyz", frames, format="extxyz")
    result = CliRunner().invoke(cli_module.cli, ["screen", "chem", str(tmp_path / "in.xyz"), "--run",
                                                 str(root / "run"), "--out", str(tmp_path / "hits")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])
    rows = list(csv.DictReader((tmp_path / "hits.csv").open()))
    assert summary["molecules"] == 3 and len(rows) == 3
    (failed, why), = summary["failed"].items()
    assert "0.300 Å apart" in why and "InputError" in why
    bad = [r for r in rows if r["name"] == failed][0]
    assert bad["n_conformers"] == "0" and bad["relative_energies_kcal_mol"] == "" and bad["trusted"] == "False"
    good = [r for r in rows if r["name"] != failed]
    assert len(good) == 2 and all(r["error"] == "" and r["relative_energies_kcal_mol"] == "0.000" for r in good)
    assert (tmp_path / "hits.extxyz").read_text().count("energy_hartree") == 2


def test_relative_energies_are_sorted_from_zero():
    assert relative_kcal([-1.0, -1.001, -0.999]) == pytest.approx([0.0, 0.6275095, 1.255019], rel=1e-5)


def test_one_served_model_answers_molecules_of_several_sizes_as_direct_calls_do(mixed):
    """Requests of 3, 5 and 9 atoms (ethanol: never trained on) in flight together through the batcher."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from converge.apps.chem.calculator import Calculator
    from converge.apps.chem.smiles import molecule_from_smiles
    from converge.serve.protocol import HEADER_LENGTH, decode_infer_response, encode_infer_request
    from converge.serve.server import build_app

    root, _ = mixed
    mols = [molecule_from_smiles(s) for s in ("O", "C", "CCO")]
    calc = Calculator(root / "run", dtype=torch.float32)
    with TestClient(build_app([f"mixed={root / 'run'}"])) as client:
        def infer(mol):
            body, headers = encode_infer_request({"species": mol.atomic_numbers[None],
                                                  "coordinates": mol.positions.astype(np.float32)[None]})
            r = client.post("/v2/models/mixed/infer", content=body, headers=headers)
            assert r.status_code == 200, r.text
            return decode_infer_response(r.content, r.headers.get(HEADER_LENGTH))

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(infer, mols * 2))
    for mol, out in zip(mols * 2, answers):
        energy, forces = calc.predict(mol.atomic_numbers, mol.positions.astype(np.float32))
        assert out["forces"].shape == (1, mol.n_atoms, 3)
        # float32 sums over a batch in another order than alone: a few units in the last place of the energy
        ulp = float(np.spacing(np.float32(abs(energy).max())))
        np.testing.assert_allclose(out["energy"], energy, rtol=0, atol=4 * ulp)
        np.testing.assert_allclose(out["forces"][0], forces[0], rtol=0, atol=1e-4)


def test_openmm_runs_the_potential_through_openmmml(mixed):
    """MLPotential("converge", run=...) (the openmmml.potentials entry point): OpenMM's energy is the network's,
    and a few Verlet steps keep the total energy."""
    openmm = pytest.importorskip("openmm")
    from openmm import app as omm_app
    from openmm import unit
    from openmmml import MLPotential

    from converge.apps.chem.calculator import Calculator
    from converge.apps.chem.smiles import molecule_from_smiles
    from converge.units import HARTREE_TO_KCAL_MOL

    root, _ = mixed
    mol = molecule_from_smiles("CO")
    topology = omm_app.Topology()
    residue = topology.addResidue("MOL", topology.addChain())
    for symbol in mol.symbols:
        topology.addAtom(symbol, omm_app.Element.getBySymbol(symbol), residue)
    # no CMMotionRemover: it would take the centre-of-mass kinetic energy out at the first step
    system = MLPotential("converge", run=str(root / "run")).createSystem(topology, removeCMMotion=False)
    integrator = openmm.VerletIntegrator(0.25 * unit.femtoseconds)
    context = openmm.Context(system, integrator, openmm.Platform.getPlatformByName("Reference"))
    context.setPositions(mol.positions * unit.angstrom)
    context.setVelocitiesToTemperature(100 * unit.kelvin, 1)
    state = context.getState(getEnergy=True)
    energy, _ = Calculator(root / "run").predict(mol.atomic_numbers, mol.positions)
    openmm_kcal = state.getPotentialEnergy().value_in_unit(unit.kilocalories_per_mole)
    assert openmm_kcal == pytest.approx(energy[0] * HARTREE_TO_KCAL_MOL, abs=1e-3)
    total0 = openmm_kcal + state.getKineticEnergy().value_in_unit(unit.kilocalories_per_mole)
    integrator.step(20)
    state = context.getState(getEnergy=True)
    total = sum(e.value_in_unit(unit.kilocalories_per_mole) for e in (state.getPotentialEnergy(),
                                                                       state.getKineticEnergy()))
    assert abs(total - total0) < 0.01  # kcal/mol over 5 fs at 0.25 fs: the forces are the energy's gradient
    with pytest.raises(ValueError, match='needs the trained run'):
        MLPotential("converge")


def test_active_learning_over_chemical_space_labels_candidates_of_several_molecules(mixed, tmp_path):
    from converge.validate.active import run_active_learning

    root, cfg = mixed
    app = ChemApp()
    problem = app.learning_problem(cfg)
    pool = problem.draw(5, 30)
    assert {p["molecule"] for p in pool} == {0.0, 1.0, 2.0}
    inputs = problem.inputs(pool[:3])
    assert inputs["species"].shape == (3, 6) and inputs["coordinates"].shape == (3, 6, 3)
    history = run_active_learning(app, cfg, tmp_path / "al", initial=4, budget=2, rounds=1, pool_size=8,
                                  members=2, n_test=6, train_cfg=TrainConfig(epochs=3, batch_size=4, patience=3))
    assert [h["simulator_calls"] for h in history] == [4, 6]
    assert history[-1]["relative_energy_mae_kcal_mol"] >= 0 and history[-1]["force_mae_kcal_mol_A"] > 0
    labelled = ShardStore.open(tmp_path / "al" / "round-1" / "data").load()
    assert labelled["species"].shape[1] == 6 and "molecule" in labelled
