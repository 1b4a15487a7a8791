"""Delta learning on GFN2-xTB (``app.baseline = "gfn2_xtb"``): the network is trained on DFT minus xTB, and every
way of asking the run (calculator, served model) answers xTB plus the network. HF-cost DFT (LDA/STO-3G) labels."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from converge.apps.chem import ChemApp, ChemConfig
from converge.apps.chem.calculator import Calculator
from converge.apps.chem.delta import BaselineError, xtb_energies_forces
from converge.apps.chem.smiles import molecule_from_smiles
from converge.config import ConfigError
from converge.data.store import ShardStore
from converge.simulate.runner import SimulateConfig, run_ensemble
from converge.train.loop import TrainConfig, load_model, train

CHEAP = dict(level="custom", functional="lda,vwn", basis="sto-3g", density_fit=False, grid_level=0,
             hidden=(16, 16))


@pytest.fixture(scope="module")
def delta(tmp_path_factory):
    root = tmp_path_factory.mktemp("delta")
    (root / "train.smi").write_text("O water\nC methane\nCO methanol\n")
    cfg = ChemConfig(molecules=str(root / "train.smi"), baseline="gfn2_xtb", **CHEAP)
    res = run_ensemble(ChemApp(), cfg, SimulateConfig(samples=24, seed=3, workers=1, shard_size=12), root / "train",
                       progress=False)
    assert res.n_failed == 0, res.failures
    arrays = ShardStore.open(root / "train").load()
    train(ChemApp(), cfg, TrainConfig(epochs=3, batch_size=8, lr=3e-3, patience=3), arrays, root / "run",
          progress=False)
    return root, cfg, arrays


def test_an_unknown_baseline_is_refused():
    with pytest.raises(ConfigError, match="app.baseline='xtb'.*gfn2_xtb"):
        ChemConfig(baseline="xtb")


def test_training_targets_are_dft_minus_xtb(delta):
    _, cfg, arrays = delta
    app = ChemApp()
    plain, _ = app.make_datasets(ChemConfig(molecules=cfg.molecules, **CHEAP), arrays, seed=0, val_fraction=0.25)
    minus, _ = app.make_datasets(cfg, arrays, seed=0, val_fraction=0.25)
    e_xtb, f_xtb = xtb_energies_forces(plain.arrays["species"].numpy(), plain.arrays["coordinates"].numpy())
    np.testing.assert_allclose(minus.arrays["energy"].numpy(), plain.arrays["energy"].numpy() - e_xtb, rtol=0,
                               atol=1e-12)
    np.testing.assert_allclose(minus.arrays["forces"].numpy(), plain.arrays["forces"].numpy() - f_xtb, rtol=0,
                               atol=1e-12)
    assert np.abs(f_xtb).max() > 1e-3  # the baseline is not zero: the subtraction did something


def test_a_delta_run_answers_xtb_plus_its_network(delta):
    root, _, _ = delta
    mol = molecule_from_smiles("CCO")  # never trained on
    calc = Calculator(root / "run")
    assert calc.model.baseline == "gfn2_xtb"  # from the run's config.json
    energy, forces = calc.predict(mol.atomic_numbers, mol.positions)
    network, _ = load_model(ChemApp(), root / "run")
    network.baseline = ""
    alone = network.double().energies_forces(torch.as_tensor(mol.atomic_numbers)[None],
                                             torch.tensor(mol.positions, dtype=torch.float64)[None])
    e_xtb, f_xtb = xtb_energies_forces(mol.atomic_numbers[None], mol.positions[None])
    np.testing.assert_allclose(energy, alone.energy.numpy() + e_xtb, rtol=0, atol=1e-10)
    np.testing.assert_allclose(forces, alone.forces.numpy() + f_xtb, rtol=0, atol=1e-10)


def test_delta_forces_are_minus_the_gradient_of_its_energy(delta):
    root, _, _ = delta
    mol = molecule_from_smiles("CO")
    calc = Calculator(root / "run")
    _, forces = calc.predict(mol.atomic_numbers, mol.positions)
    h, numeric = 1e-3, np.zeros(3)
    for axis in range(3):
        step = np.zeros_like(mol.positions)
        step[1, axis] = h  # atom 1 (oxygen)
        up, _ = calc.predict(mol.atomic_numbers, mol.positions + step)
        down, _ = calc.predict(mol.atomic_numbers, mol.positions - step)
        numeric[axis] = -(up[0] - down[0]) / (2 * h)
    np.testing.assert_allclose(forces[0, 1], numeric, rtol=0, atol=2e-5)  # hartree/Å; xTB's SCC tolerance
    assert np.abs(forces[0, 1]).max() > 1e-3


def test_the_served_delta_model_matches_the_calculator_on_a_padded_mixed_batch(delta):
    root, cfg, _ = delta
    app = ChemApp()
    model, _ = load_model(app, root / "run")
    mols = [molecule_from_smiles(s) for s in ("O", "CCO")]
    species = np.full((2, 9), -1)
    coords = np.zeros((2, 9, 3), dtype=np.float32)
    for k, mol in enumerate(mols):
        species[k, : mol.n_atoms], coords[k, : mol.n_atoms] = mol.atomic_numbers, mol.positions
    out = app.serve_predict(model.eval(), {"species": torch.as_tensor(species), "coordinates": torch.as_tensor(coords)})
    calc = Calculator(root / "run", dtype=torch.float32)
    for k, mol in enumerate(mols):
        energy, forces = calc.predict(mol.atomic_numbers, coords[k, : mol.n_atoms])
        np.testing.assert_allclose(out["energy"][k].item(), energy[0], rtol=0, atol=1e-4)  # float32 network
        np.testing.assert_allclose(out["forces"][k, : mol.n_atoms].numpy(), forces[0], rtol=0, atol=1e-4)
        assert not out["forces"][k, mol.n_atoms:].any()  # padding atoms carry no force


def test_the_baseline_on_a_padded_batch_equals_each_molecule_alone():
    mols = [molecule_from_smiles(s) for s in ("O", "CCO")]
    species, coords = np.full((2, 9), -1), np.zeros((2, 9, 3))
    for k, mol in enumerate(mols):
        species[k, : mol.n_atoms], coords[k, : mol.n_atoms] = mol.atomic_numbers, mol.positions
    energy, forces = xtb_energies_forces(species, coords)
    for k, mol in enumerate(mols):
        e, f = xtb_energies_forces(mol.atomic_numbers[None], mol.positions[None])
        assert energy[k] == e[0] and np.array_equal(forces[k, : mol.n_atoms], f[0])
        assert not forces[k, mol.n_atoms:].any()
    assert -20 < energy[1] < -5  # ethanol's GFN2-xTB total energy is about -11.4 E_h


def test_a_structure_the_baseline_cannot_take_is_a_clear_error():
    with pytest.raises(BaselineError, match=r"sample 1: atomic number\(s\) \[16\] have no element here"):
        xtb_energies_forces(np.array([[8, 1, 1], [16, 1, 1]]), np.array([[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]]] * 2))


def test_padded_energies_forces_names_the_sample_a_method_fails_on_and_leaves_padding_out():
    from converge.apps.chem.molecule_set import padded_energies_forces

    calls = []

    def method(symbols, positions):
        calls.append(symbols)
        if len(symbols) == 1:
            raise RuntimeError("SCC did not converge")
        return -1.0, np.ones_like(positions)

    species = np.array([[8, 1, 1], [1, -1, -1]])
    with pytest.raises(BaselineError, match=r"sample 1: GFN2-xTB failed \(RuntimeError: SCC did not converge\)"):
        padded_energies_forces(species, np.zeros((2, 3, 3)), method, BaselineError, wrap="GFN2-xTB")
    assert calls == [["O", "H", "H"], ["H"]]  # padding atoms never reach the method
    with pytest.raises(RuntimeError, match="SCC"):  # without wrap, the method's own error, for its caller to handle
        padded_energies_forces(species, np.zeros((2, 3, 3)), method)
    energy, forces = padded_energies_forces(species[:1, :2], np.zeros((1, 2, 3)), method)
    assert energy.tolist() == [-1.0] and forces.shape == (1, 2, 3)


def test_dft_of_given_structures_refuses_an_element_it_has_no_symbol_for():
    with pytest.raises(ValueError, match=r"sample 0: atomic number\(s\) \[16\] have no element here"):
        ChemApp().simulate_inputs(ChemConfig(**CHEAP), {"species": np.array([[16, 1, 1]]),
                                                        "coordinates": np.zeros((1, 3, 3))})


def test_a_screen_on_a_delta_run_optimises_on_xtb_plus_the_network(delta, tmp_path):
    import ase.io
    from typer.testing import CliRunner

    from converge import cli as cli_module

    root, _, _ = delta
    (tmp_path / "in.smi").write_text("CCO ethanol\nCC=O acetaldehyde\n")
    result = CliRunner().invoke(cli_module.cli, ["screen", "chem", str(tmp_path / "in.smi"), "--run", str(root / "run"),
                                                 "--out", str(tmp_path / "hits"), "--conformers", "2"])
    assert result.exit_code == 0, result.output
    frames = ase.io.read(tmp_path / "hits.extxyz", index=":")
    assert len(frames) == 2
    calc = Calculator(root / "run")
    for atoms in frames:  # the energies written are the delta potential's at the optimised geometries
        energy, forces = calc.predict(atoms.numbers, atoms.positions)
        np.testing.assert_allclose(atoms.info["energy_hartree"], energy[0], rtol=0, atol=1e-6)
        assert np.abs(forces).max() * 27.211 < 0.06  # BFGS stopped below fmax 0.05 eV/Å on this potential
