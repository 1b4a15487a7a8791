"""ANI potential: AEV against a naive loop over the documented formulas, invariances,
forces against finite differences, padding and batching, self-energy fits.

Tolerances: float64 throughout unless stated. Invariances and padding/batching hold to
rounding (~1e-12 relative on AEVs, 1e-10 hartree on ~150-hartree totals). Central
differences with h = 1e-4 Å have O(h^2) truncation error ~1e-8 hartree/Å on the
O(0.1-1) forces of a randomly initialised network, hence 1e-6 absolute.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from converge.apps.chem.aev import (
    AtomicEnvironment,
    ElementIndex,
    angular_terms,
    cosine_cutoff,
    radial_terms,
)
from converge.apps.chem.config import ChemConfig
from converge.apps.chem.model import (
    ANIPotential,
    EnergiesForces,
    element_counts,
    finite_difference_forces,
    fit_energy_scale,
    fit_self_energies,
    from_config,
)

torch.set_num_threads(1)

# ASE's G2 geometries (ase.build.molecule), Å
ETHANOL_Z = [6, 6, 8, 1, 1, 1, 1, 1, 1]
ETHANOL = [[1.168181, -0.400382, 0.0], [0.0, 0.559462, 0.0], [-1.190083, -0.227669, 0.0],
           [-1.946623, 0.381525, 0.0], [0.042557, 1.207508, 0.886933], [0.042557, 1.207508, -0.886933],
           [2.115891, 0.1448, 0.0], [1.128599, -1.037234, 0.885881], [1.128599, -1.037234, -0.885881]]
ACETAMIDE_Z = [8, 6, 7, 6, 1, 1, 1, 1, 1]
ACETAMIDE = [[0.424546, 1.327024, 0.008034], [0.077158, 0.149789, -0.004249], [0.985518, -0.878537, -0.04891],
             [-1.371475, -0.288665, -0.000144], [0.707952, -1.824249, 0.169942], [-1.997229, 0.584922, -0.175477],
             [-1.560842, -1.03927, -0.771686], [-1.632113, -0.723007, 0.969814], [1.953133, -0.631574, 0.111866]]
WATER_Z = [8, 1, 1]
WATER = [[0.0, 0.0, 0.119262], [0.0, 0.763239, -0.477047], [0.0, -0.763239, -0.477047]]
# Self energies of the ANI-1x model (hartree), used only as realistic magnitudes
SAE = {1: -0.600952980000, 6: -38.08316124000, 7: -54.70775770000, 8: -75.19446356000}
F64 = torch.float64


def molecule(z: list[int], xyz: list[list[float]], jitter: float = 0.05, seed: int = 0):
    """(1, A) species and (1, A, 3) float64 coordinates, jittered off symmetric geometry."""
    g = torch.Generator().manual_seed(seed)
    coords = torch.tensor(xyz, dtype=F64) + jitter * torch.randn(len(z), 3, generator=g, dtype=F64)
    return torch.tensor([z]), coords.unsqueeze(0)


def random_rotation(seed: int) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(seed), dtype=F64))
    q = q * torch.sign(torch.diagonal(r))
    return q if torch.det(q) > 0 else -q


@pytest.fixture(scope="module")
def model() -> ANIPotential:
    torch.manual_seed(0)
    m = ANIPotential(hidden=(32, 24, 16)).double()
    m.set_energy_reference(SAE, energy_scale=1.0)
    return m


def assert_forces_match_finite_differences(model, species, coords, forces, atol=1e-6):
    reference = finite_difference_forces(model, species, coords, step=1e-4)
    error = (forces - reference).abs().max().item()
    assert error < atol, f"forces differ from central differences by {error:.3g} hartree/Å (atol {atol})"


# --------------------------------------------------------------------------- AEV


def test_aev_preset_constants_are_the_ani1x_paper_values():
    computer = AtomicEnvironment("ani1x").computer
    radial, angular = computer.radial, computer.angular
    # rHCNO-5.2R_16-3.5A_a4-8.params of ANI-1x (NeuroChem): ShfR, ShfA, ShfZ
    shf_r = [0.9, 1.16875, 1.4375, 1.70625, 1.975, 2.24375, 2.5125, 2.78125, 3.05, 3.31875, 3.5875,
             3.85625, 4.125, 4.39375, 4.6625, 4.93125]
    shf_z = [0.19634954, 0.58904862, 0.9817477, 1.3744468, 1.7671459, 2.1598449, 2.5525440, 2.9452431]
    assert (radial.cutoff, angular.cutoff) == (5.2, 3.5)
    assert (radial.eta.item(), angular.eta.item(), angular.zeta.item()) == (16.0, 8.0, 32.0)
    np.testing.assert_allclose(radial.shifts.numpy(), shf_r, rtol=1e-6)
    np.testing.assert_allclose(angular.shifts.numpy(), [0.9, 1.55, 2.2, 2.85], rtol=1e-6)
    np.testing.assert_allclose(angular.sections.numpy(), shf_z, rtol=1e-6)
    assert computer.radial_len == 4 * 16 and computer.angular_len == 10 * 4 * 8 and computer.out_dim == 384


def test_an_unknown_aev_preset_in_the_app_settings_is_refused_with_the_choices():
    from converge.apps.chem import ChemConfig
    from converge.config import ConfigError

    with pytest.raises(ConfigError, match="app.aev_preset='ani1ccx': choose one of ani1x, ani2x, ani1x_r4"):
        ChemConfig(aev_preset="ani1ccx")


def test_aev_preset_ani1x_r4_cuts_only_the_radial_part_at_4_angstrom():
    short, long = AtomicEnvironment("ani1x_r4").double(), AtomicEnvironment("ani1x").double()
    radial = short.computer.radial
    assert (radial.cutoff, short.computer.angular.cutoff, short.out_dim) == (4.0, 3.5, 384)
    np.testing.assert_allclose(radial.shifts.numpy(), 0.9 + np.arange(16) * (4.0 - 0.9) / 16, rtol=1e-6)
    index = ElementIndex()(torch.tensor([[6, 6]]))
    pair = torch.tensor([[[0.0, 0.0, 0.0], [4.5, 0.0, 0.0]]], dtype=F64)  # inside 5.2 Å, outside 4.0 Å
    assert torch.count_nonzero(long(index, pair)) > 0
    assert torch.count_nonzero(short(index, pair)) == 0
    pair[0, 1, 0] = 3.0  # inside both: the neighbour is seen, by both
    assert torch.count_nonzero(short(index, pair)[0, 0, :64]) > 0


def naive_aev(index: torch.Tensor, coords: torch.Tensor, computer) -> torch.Tensor:
    """Loop over neighbours and neighbour pairs of each atom, using the documented terms."""
    rad, ang = computer.radial, computer.angular
    pair_block = {}
    for p, (a, b) in enumerate(itertools.combinations_with_replacement(range(4), 2)):
        pair_block[(a, b)] = pair_block[(b, a)] = p
    index, coords = index[0].tolist(), coords[0]
    n_rad, n_ang = rad.num_feats, ang.num_feats
    out = torch.zeros(len(index), 4 * n_rad + 10 * n_ang, dtype=F64)
    for i in range(len(index)):
        for j in range(len(index)):
            r = (coords[j] - coords[i]).norm()
            if j != i and r <= rad.cutoff:
                out[i, index[j] * n_rad:(index[j] + 1) * n_rad] += radial_terms(
                    r.view(1), rad.eta.item(), rad.shifts, rad.cutoff)[0]
        for j, k in itertools.combinations([n for n in range(len(index)) if n != i], 2):
            v_ij, v_ik = coords[j] - coords[i], coords[k] - coords[i]
            r_ij, r_ik = v_ij.norm(), v_ik.norm()
            if r_ij <= ang.cutoff and r_ik <= ang.cutoff:
                start = 4 * n_rad + pair_block[(index[j], index[k])] * n_ang
                out[i, start:start + n_ang] += angular_terms(
                    r_ij.view(1), r_ik.view(1), (v_ij @ v_ik / (r_ij * r_ik)).view(1), ang.eta.item(),
                    ang.zeta.item(), ang.shifts, ang.sections, ang.cutoff)[0]
    return out


def test_aev_equals_naive_loop_over_documented_formulas():
    aev = AtomicEnvironment("ani1x").double()
    species, coords = molecule(ACETAMIDE_Z, ACETAMIDE)
    index = ElementIndex()(species)
    got = aev(index, coords)[0]
    expected = naive_aev(index, coords, aev.computer)
    assert got.abs().max() > 1.0  # not trivially zero
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-13)


def test_cosine_cutoff_is_one_at_zero_and_zero_at_and_beyond_cutoff():
    r = torch.tensor([0.0, 2.6, 5.2, 5.2000001, 9.0], dtype=F64)
    torch.testing.assert_close(cosine_cutoff(r, 5.2), torch.tensor([1.0, 0.5, 0.0, 0.0, 0.0], dtype=F64))


def test_aev_is_zero_for_an_atom_beyond_every_cutoff_and_far_atoms_change_nothing():
    aev = AtomicEnvironment("ani1x").double()
    species, coords = molecule(ETHANOL_Z, ETHANOL)
    far = coords[0].max(0).values + torch.tensor([5.25, 0.0, 0.0], dtype=F64)  # > Rcr from every atom
    with_far = torch.cat([coords, far.view(1, 1, 3)], dim=1)
    index = ElementIndex()(torch.cat([species, torch.tensor([[8]])], dim=1))
    g = aev(index, with_far)
    assert torch.count_nonzero(g[0, -1]) == 0
    alone = aev(index[:, :-1], coords)
    assert torch.equal(g[0, :-1], alone[0])  # exactly: the far atom is not even a neighbour
    moved = with_far.clone()
    moved[0, -1, 0] += 3.0  # further out: still nothing
    assert torch.equal(aev(index, moved), g)


# ----------------------------------------------------------------- invariances


def test_energy_invariant_under_rotation_translation_and_permutation(model):
    species, coords = molecule(ETHANOL_Z, ETHANOL)
    energy = model(species, coords)
    rot = random_rotation(1)
    moved = coords @ rot.T + torch.tensor([3.0, -1.5, 7.0], dtype=F64)
    perm = torch.tensor([1, 0, 2, 8, 4, 3, 6, 5, 7])  # swaps the two C and permutes the H
    torch.testing.assert_close(model(species, moved), energy, rtol=0, atol=1e-10)
    torch.testing.assert_close(model(species[:, perm], coords[:, perm]), energy, rtol=0, atol=1e-10)
    # forces rotate with the molecule: F(R x + t) = R F(x)
    forces = model.energies_forces(species, coords).forces
    torch.testing.assert_close(model.energies_forces(species, moved).forces, forces @ rot.T, rtol=0, atol=1e-10)


def test_forces_equal_minus_gradient_by_finite_differences(model):
    species, coords = molecule(ACETAMIDE_Z, ACETAMIDE, seed=2)
    out = model.energies_forces(species, coords)
    assert isinstance(out, EnergiesForces) and out.forces.shape == (1, 9, 3)
    assert out.forces.abs().max() > 1e-3  # a non-trivial check
    assert_forces_match_finite_differences(model, species, coords, out.forces)


def test_finite_difference_check_fails_on_wrong_force_sign(model):
    species, coords = molecule(ETHANOL_Z, ETHANOL, seed=3)
    rotated = coords @ random_rotation(4).T
    forces = model.energies_forces(species, rotated).forces
    assert_forces_match_finite_differences(model, species, rotated, forces)
    with pytest.raises(AssertionError, match="differ from central differences"):
        assert_forces_match_finite_differences(model, species, rotated, -forces)


def test_padding_atoms_change_nothing_and_get_zero_force(model):
    species, coords = molecule(ETHANOL_Z, ETHANOL)
    ref = model.energies_forces(species, coords)
    padded_species = torch.cat([species, torch.tensor([[0, -1, 0]])], dim=1)
    # padding placed on top of a real atom and of each other: must not produce NaN
    padded_coords = torch.cat([coords, coords[:, :1].expand(1, 3, 3)], dim=1)
    out = model.energies_forces(padded_species, padded_coords)
    torch.testing.assert_close(out.energy, ref.energy, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.forces[:, :9], ref.forces, rtol=0, atol=1e-12)
    assert torch.count_nonzero(out.forces[:, 9:]) == 0
    assert torch.count_nonzero(model.atomic_energies(padded_species, padded_coords)[:, 9:]) == 0


def test_padded_batch_of_two_sizes_equals_separate_molecules(model):
    s1, x1 = molecule(ETHANOL_Z, ETHANOL)
    s2, x2 = molecule(WATER_Z, WATER)
    species = torch.cat([s1, torch.cat([s2, torch.full((1, 6), -1)], dim=1)])
    coords = torch.cat([x1, torch.cat([x2, torch.zeros(1, 6, 3, dtype=F64)], dim=1)])
    batch = model.energies_forces(species, coords)
    one, two = model.energies_forces(s1, x1), model.energies_forces(s2, x2)
    torch.testing.assert_close(batch.energy, torch.cat([one.energy, two.energy]), rtol=0, atol=1e-12)
    torch.testing.assert_close(batch.forces[0], one.forces[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(batch.forces[1, :3], two.forces[0], rtol=0, atol=1e-12)


def test_float32_model_agrees_with_float64():
    torch.manual_seed(0)
    m64 = ANIPotential(hidden=(32, 24, 16)).double()
    m64.set_energy_reference(SAE, energy_scale=0.01)
    m32 = ANIPotential(hidden=(32, 24, 16))
    m32.load_state_dict(m64.state_dict())  # casts to float32
    species, coords = molecule(ETHANOL_Z, ETHANOL)
    e64, f64 = m64.energies_forces(species, coords)
    e32, f32 = m32.energies_forces(species, coords.float())
    assert e32.dtype == torch.float32
    # the total carries float32 rounding of ~150-hartree sums (ulp 1.5e-5); the network part does not
    torch.testing.assert_close(e32.double(), e64, rtol=0, atol=1e-4)
    torch.testing.assert_close(m32.network_energy(species, coords.float()).double(),
                               m64.network_energy(species, coords), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(f32.double(), f64, rtol=0, atol=1e-6)
    torch.testing.assert_close(m64.network_energy(species, coords) + m64.self_energy(species), e64)


def test_create_graph_lets_a_force_loss_reach_the_parameters(model):
    species, coords = molecule(ACETAMIDE_Z, ACETAMIDE)
    weight = model.networks["N"][0].weight

    def force_loss() -> torch.Tensor:
        return model.energies_forces(species, coords, create_graph=True).forces.pow(2).sum()

    model.zero_grad()
    force_loss().backward()
    analytic = weight.grad[3, 5].item()
    h = 1e-5
    with torch.no_grad():
        weight[3, 5] += h
        plus = force_loss().item()
        weight[3, 5] -= 2 * h
        minus = force_loss().item()
        weight[3, 5] += h
    assert analytic == pytest.approx((plus - minus) / (2 * h), rel=1e-5, abs=1e-9)
    model.zero_grad()
    assert not model.energies_forces(species, coords).energy.requires_grad  # inference: detached
    expected = model.energies_forces(species, coords).forces
    with torch.no_grad():
        torch.testing.assert_close(model.energies_forces(species, coords).forces, expected, rtol=0, atol=0)
    with torch.inference_mode():  # as a server would call it
        species, coords = species.clone(), coords.clone()
        torch.testing.assert_close(model.energies_forces(species, coords).forces, expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(model):
    species, coords = molecule(ACETAMIDE_Z, ACETAMIDE)
    cpu = model.energies_forces(species, coords)
    gpu = model.to("cuda").energies_forces(species.cuda(), coords.cuda())
    model.to("cpu")
    torch.testing.assert_close(gpu.energy.cpu(), cpu.energy, rtol=0, atol=1e-10)
    torch.testing.assert_close(gpu.forces.cpu(), cpu.forces, rtol=0, atol=1e-10)


# --------------------------------------------------------------- self energies


def test_self_energy_fit_recovers_known_values_from_several_molecules():
    molecules = [[6, 1, 1, 1, 1], [8, 1, 1], [7, 1, 1, 1], ETHANOL_Z, ACETAMIDE_Z, [1, 1], [7, 7], [8, 6, 8]]
    width = max(map(len, molecules))
    species = torch.tensor([z + [0] * (width - len(z)) for z in molecules])
    energies = element_counts(species) @ np.array([SAE[e] for e in (1, 6, 7, 8)])
    fitted = fit_self_energies(species, torch.tensor(energies))
    assert fitted.keys() == SAE.keys()
    for e, value in SAE.items():
        assert fitted[e] == pytest.approx(value, abs=1e-10)


def test_self_energy_fit_of_one_molecules_conformers_is_minimum_norm():
    rng = np.random.default_rng(0)
    species = np.tile(ETHANOL_Z, (50, 1))
    energies = -154.9 + 0.005 * rng.standard_normal(50)  # conformers: only the mean is determined
    fitted = fit_self_energies(species, energies)
    n = np.array([6.0, 2.0, 0.0, 1.0])  # H, C, N, O counts of ethanol
    values = np.array([fitted[e] for e in (1, 6, 7, 8)])
    assert np.all(np.isfinite(values)) and fitted[7] == 0.0  # absent element: 0
    assert n @ values == pytest.approx(energies.mean(), abs=1e-10)
    np.testing.assert_allclose(values, n * energies.mean() / (n @ n), atol=1e-10)
    scale = fit_energy_scale(species, energies, fitted)
    assert scale == pytest.approx(energies.std(), rel=1e-8)


def test_energy_reference_sets_the_self_energy_of_a_molecule():
    m = ANIPotential(hidden=(8,)).double()
    m.set_energy_reference({1: -0.5, 8: -75.0}, energy_scale=0.02)
    species, coords = molecule(WATER_Z + [0], WATER + [[0.0, 0.0, 0.0]])
    assert m.self_energy(species).item() == pytest.approx(-76.0)
    assert m.energy_scale.item() == 0.02
    torch.testing.assert_close(m(species, coords), m.self_energy(species) + m.network_energy(species, coords))


# ------------------------------------------------------------------ construction and errors


def test_from_config_builds_the_configured_network():
    cfg = ChemConfig(hidden=(64, 32))
    m = from_config(cfg)
    assert m.aev.out_dim == 384 and list(m.networks) == ["H", "C", "N", "O"]
    widths = [layer.out_features for layer in m.networks["C"] if isinstance(layer, torch.nn.Linear)]
    assert widths == [64, 32, 1]
    assert isinstance(m.networks["O"][1], torch.nn.CELU) and m.networks["O"][1].alpha == 0.1


def test_errors_say_how_to_fix_the_input(model):
    species, coords = molecule(WATER_Z, WATER)
    with pytest.raises(ValueError, match=r"atomic numbers \[9\] are not supported.*pad with 0 or -1"):
        model(torch.tensor([[9, 1, 1]]), coords)
    with pytest.raises(TypeError, match="model.double"):
        model(species, coords.float())
    with pytest.raises(ValueError, match=r"coordinates \(B, A, 3\)"):
        model(species, coords[0])
    with pytest.raises(ValueError, match="aev_preset='ani3x': choose one of ani1x, ani2x, ani1x_r4"):
        ANIPotential(aev_preset="ani3x")
    with pytest.raises(ValueError, match=r"atomic numbers \[9\] are not among"):
        fit_self_energies(np.array([[9, 1]]), np.array([-100.0]))
    with pytest.raises(ValueError, match="2 molecules but 3 energies"):
        fit_self_energies(np.array([[1, 1], [8, 0]]), np.zeros(3))
    with pytest.raises(ValueError, match=r"self energies given for \[9\]"):
        model.set_energy_reference({9: -99.0})
