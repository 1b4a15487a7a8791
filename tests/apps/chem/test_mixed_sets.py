"""Datasets of many molecules of different sizes: padding, masks, per-molecule relative energies.

Tolerances: float64; a padded batch equals its molecules alone to rounding (1e-12 hartree on ~100-hartree
totals); rotations and permutations change AEV sums only by rounding (1e-10).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from converge.apps.chem import ChemApp, ChemConfig
from converge.apps.chem.evaluate import error_report, far_from_mean, relative_energy_mae
from converge.apps.chem.model import ANIPotential, EnergiesForces
from converge.apps.chem.molecule_set import pad_atoms, pad_conformers, real_atoms
from converge.units import hartree_to_kcal_mol

F64 = torch.float64
ETHANOL_Z = [6, 6, 8, 1, 1, 1, 1, 1, 1]
ETHANOL = [[1.168181, -0.400382, 0.0], [0.0, 0.559462, 0.0], [-1.190083, -0.227669, 0.0],
           [-1.946623, 0.381525, 0.0], [0.042557, 1.207508, 0.886933], [0.042557, 1.207508, -0.886933],
           [2.115891, 0.1448, 0.0], [1.128599, -1.037234, 0.885881], [1.128599, -1.037234, -0.885881]]
WATER_Z = [8, 1, 1]
WATER = [[0.0, 0.0, 0.119262], [0.0, 0.763239, -0.477047], [0.0, -0.763239, -0.477047]]
METHANE_Z = [6, 1, 1, 1, 1]
METHANE = [[0.0, 0.0, 0.0], [0.629118, 0.629118, 0.629118], [-0.629118, -0.629118, 0.629118],
           [0.629118, -0.629118, -0.629118], [-0.629118, 0.629118, -0.629118]]
SAE = {1: -0.60095298, 6: -38.08316124, 7: -54.70775770, 8: -75.19446356}


@pytest.fixture(scope="module")
def model() -> ANIPotential:
    torch.manual_seed(0)
    m = ANIPotential(hidden=(32, 24, 16)).double()
    m.set_energy_reference(SAE)
    return m


def padded_batch(molecules, n: int, seed: int = 0):
    """Species (B, n) padded with -1 and jittered float64 coordinates (B, n, 3)."""
    rng = np.random.default_rng(seed)
    species = np.stack([pad_atoms(np.asarray(z), n, -1) for z, _ in molecules])
    coords = np.stack([pad_atoms(np.asarray(x) + 0.05 * rng.standard_normal((len(z), 3)), n, 0.0)
                       for z, x in molecules])
    return torch.from_numpy(species), torch.from_numpy(coords)


def test_a_molecule_alone_equals_it_inside_a_padded_mixed_batch(model):
    species, coords = padded_batch([(ETHANOL_Z, ETHANOL), (WATER_Z, WATER), (METHANE_Z, METHANE)], 12)
    batch = model.energies_forces(species, coords)
    for b, n in enumerate((9, 3, 5)):
        alone = model.energies_forces(species[b:b + 1, :n], coords[b:b + 1, :n])
        torch.testing.assert_close(batch.energy[b:b + 1], alone.energy, rtol=0, atol=1e-12)
        torch.testing.assert_close(batch.forces[b:b + 1, :n], alone.forces, rtol=0, atol=1e-12)
        assert torch.count_nonzero(batch.forces[b, n:]) == 0


def test_rotation_and_permutation_inside_a_mixed_batch_change_no_energy(model):
    species, coords = padded_batch([(ETHANOL_Z, ETHANOL), (WATER_Z, WATER)], 9)
    q, r = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(1), dtype=F64))
    q = q * torch.sign(torch.diagonal(r))
    rotated = coords @ q.T + torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    perm = torch.tensor([0, 2, 1, 3, 4, 5, 6, 7, 8])  # water: swap its two H; ethanol: the C and O swap below
    permuted_species, permuted = species.clone(), rotated.clone()
    permuted_species[1], permuted[1] = species[1][perm], rotated[1][perm]
    swap_h = torch.tensor([0, 1, 2, 3, 5, 4, 6, 8, 7])  # ethanol: like H atoms exchanged
    permuted_species[0], permuted[0] = species[0][swap_h], rotated[0][swap_h]
    torch.testing.assert_close(model(permuted_species, permuted), model(species, coords), rtol=0, atol=1e-10)


def test_padding_changes_neither_the_loss_nor_the_metrics():
    app, cfg = ChemApp(), ChemConfig()
    species, coords = padded_batch([(WATER_Z, WATER), (METHANE_Z, METHANE)], 5)
    forces = torch.randn(coords.shape, dtype=F64) * (species > 0).unsqueeze(-1)
    batch = {"species": species, "forces": forces, "energy_residual": torch.tensor([0.01, -0.02], dtype=F64)}
    output = EnergiesForces(torch.tensor([0.0, 0.0], dtype=F64), torch.zeros_like(forces))
    wider = {"species": torch.cat([species, torch.full((2, 4), -1)], 1),
             "forces": torch.cat([forces, torch.zeros(2, 4, 3, dtype=F64)], 1),
             "energy_residual": batch["energy_residual"]}
    wide_out = EnergiesForces(output.energy, torch.zeros_like(wider["forces"]))
    assert app.loss(cfg, wide_out, wider).item() == pytest.approx(app.loss(cfg, output, batch).item(), rel=1e-12)
    real = real_atoms(species.numpy())
    mae = error_report(np.zeros(2), np.zeros(forces.shape), np.zeros(2), forces.numpy(), real)["force_mae_kcal_mol_A"]
    assert mae == pytest.approx(float(np.abs(hartree_to_kcal_mol(forces.numpy()[real])).mean()))
    assert mae > error_report(np.zeros(2), np.zeros(forces.shape), np.zeros(2), forces.numpy())["force_mae_kcal_mol_A"]


def test_relative_energy_error_ignores_a_per_molecule_offset_and_catches_a_wrong_ordering():
    molecule = np.array([0, 0, 0, 1, 1])
    ref = np.array([-1.0, -1.001, -1.002, -2.0, -2.003])
    offset = ref + np.array([0.5, 0.5, 0.5, -0.2, -0.2])  # each molecule shifted as a whole: no relative error
    assert relative_energy_mae(offset, ref, molecule) == pytest.approx(0.0, abs=1e-9)
    swapped = ref.copy()
    swapped[[3, 4]] = swapped[[4, 3]]  # the two conformers of molecule 1 in the wrong order: 0.0015 Ha each
    assert relative_energy_mae(swapped, ref, molecule) == pytest.approx(
        hartree_to_kcal_mol(0.003) * 2 / 5, rel=1e-9)


def test_far_from_mean_marks_every_conformer_of_a_molecule_with_one_far_conformer():
    kcal = 1.0 / hartree_to_kcal_mol(1.0)  # hartree per kcal/mol
    molecule = np.array([2, 2, 2, 7, 7, 7, 7])  # labels need not be 0..n-1
    ref = np.array([-1.0, -1.0 + 10 * kcal, -1.0 - 10 * kcal,  # within 10 kcal/mol of its mean
                    -2.0, -2.0, -2.0, -2.0 + 120 * kcal])  # one conformer 90 kcal/mol above the mean
    assert far_from_mean(ref, molecule, 50.0).tolist() == [False] * 3 + [True] * 4
    assert not far_from_mean(ref, molecule, 95.0).any()  # 90 is not beyond 95
    assert far_from_mean(ref, molecule, 5.0).all()


def test_pad_atoms_refuses_a_molecule_too_large():
    with pytest.raises(ValueError, match="does not fit 2 padded atoms"):
        pad_atoms(np.zeros((3, 3)), 2, 0.0)


def test_pad_conformers_pads_every_atom_array_and_keeps_the_rest():
    arrays = {"species": np.array([[8, 1, 1]]), "coordinates": np.ones((1, 3, 3)), "forces": np.ones((1, 3, 3)),
              "energy": np.array([-76.4])}
    out = pad_conformers(arrays, 5)
    assert out["species"].tolist() == [[8, 1, 1, -1, -1]] and out["energy"] is arrays["energy"]
    assert out["coordinates"].shape == out["forces"].shape == (1, 5, 3)
    assert not out["forces"][0, 3:].any() and out["coordinates"][0, :3].all()
    with pytest.raises(ValueError, match="does not fit 2 padded atoms"):
        pad_conformers(arrays, 2)
