"""The chem out-of-distribution check: unseen elements, too-short and too-long distances, other molecules."""
import numpy as np
import pytest

from converge.apps.chem.molecules import get_molecule
from converge.apps.chem.ood import (TrainingEnvelope, check_batch, check_in_distribution, fit_envelope, load_envelope,
                                   save_envelope)

METHANOL = get_molecule("methanol")  # C, O, H, H, H, H (G2 geometry)


@pytest.fixture(scope="module")
def training():
    rng = np.random.default_rng(0)
    coordinates = METHANOL.positions + rng.normal(scale=0.03, size=(50, METHANOL.n_atoms, 3))  # (50, 6, 3) Å
    species = np.broadcast_to(METHANOL.atomic_numbers, (50, METHANOL.n_atoms)).copy()
    return species, coordinates


@pytest.fixture(scope="module")
def envelope(training):
    return fit_envelope(*training)


def test_training_conformers_pass(training, envelope):
    species, coordinates = training
    assert envelope.elements == (1, 6, 8) and envelope.n_conformers == 50
    assert all(reasons == [] for reasons in check_batch(envelope, species, coordinates))
    assert check_in_distribution(envelope, METHANOL.atomic_numbers, METHANOL.positions) == []


def test_an_unseen_element_is_named(envelope):
    species = METHANOL.atomic_numbers.copy()
    species[2] = 7  # an H becomes N
    reasons = check_in_distribution(envelope, species, METHANOL.positions)
    assert any("element N (atoms 3) never seen" in r for r in reasons), reasons


def test_a_too_short_distance_is_caught(training, envelope):
    positions = METHANOL.positions.copy()
    carbon, hydrogen = 0, 2
    bond = positions[hydrogen] - positions[carbon]
    positions[hydrogen] = positions[carbon] + bond / np.linalg.norm(bond) * 0.8  # C-H at 0.8 Å
    reasons = check_in_distribution(envelope, METHANOL.atomic_numbers, positions)
    assert any("(C-H) are 0.800 Å apart, shorter than the training minimum" in r for r in reasons), reasons
    # take the training conformer with the shortest C-H bond: shortened by half the margin it is still inside
    species, coordinates = training
    ch = np.linalg.norm(coordinates[:, 2:] - coordinates[:, :1], axis=-1)  # (N, 4) C-H distances
    n, k = np.unravel_index(np.argmin(ch), ch.shape)
    assert ch[n, k] == pytest.approx(envelope.pair_min_distance["1-6"])
    for shift, inside in ((0.5, True), (2.0, False)):
        positions = coordinates[n].copy()
        bond = positions[2 + k] - positions[0]
        positions[2 + k] -= shift * envelope.margin * bond / np.linalg.norm(bond)
        assert (check_in_distribution(envelope, species[n], positions) == []) == inside


def test_a_broken_bond_and_another_molecule_are_caught(envelope):
    positions = METHANOL.positions.copy()
    positions[5] += 1.5 * (positions[5] - positions[1]) / np.linalg.norm(positions[5] - positions[1])  # pull H off O
    reasons = check_in_distribution(envelope, METHANOL.atomic_numbers, positions)
    assert any("nearest neighbour" in r and "broken bond" in r for r in reasons), reasons
    ethanol = get_molecule("ethanol")
    reasons = check_in_distribution(envelope, ethanol.atomic_numbers, ethanol.positions)
    assert any("neighbours within 5.2 Å; training had 5 to 5" in r for r in reasons), reasons


def test_padding_is_ignored_and_the_envelope_round_trips(envelope, tmp_path):
    species = np.r_[METHANOL.atomic_numbers, 0, -1]
    positions = np.r_[METHANOL.positions, np.zeros((2, 3))]
    assert check_in_distribution(envelope, species, positions) == []
    save_envelope(tmp_path, envelope)
    again = load_envelope(tmp_path)
    assert isinstance(again, TrainingEnvelope) and again == envelope


def test_unusable_inputs_give_reasons_or_errors(envelope):
    positions = METHANOL.positions.copy()
    positions[0, 0] = np.nan
    assert check_in_distribution(envelope, METHANOL.atomic_numbers, positions) == ["coordinates hold NaN or inf"]
    assert check_in_distribution(envelope, np.zeros(3, dtype=int), np.zeros((3, 3))) != []
    with pytest.raises(ValueError, match="coordinates"):
        check_in_distribution(envelope, METHANOL.atomic_numbers, METHANOL.positions[:3])
    with pytest.raises(FileNotFoundError, match="fit_envelope"):
        load_envelope("/nonexistent")


def test_the_batch_test_agrees_with_the_one_by_one_check(training, envelope):
    from converge.apps.chem.ood import inside_envelope

    species, coordinates = training
    rng = np.random.default_rng(3)
    z = np.c_[species, np.zeros((50, 2), np.int64)]  # padded to 8 atoms
    xyz = np.concatenate([coordinates, np.zeros((50, 2, 3))], axis=1)
    z[1, 2] = 7  # an element never trained on
    xyz[2, 0, 0] = np.nan
    z[3] = -1  # all padding
    xyz[4, 5] += 1.5 * (xyz[4, 5] - xyz[4, 1])  # a broken O-H bond
    xyz[5, 2] = xyz[5, 0] + 0.8 * (xyz[5, 2] - xyz[5, 0]) / np.linalg.norm(xyz[5, 2] - xyz[5, 0])  # C-H at 0.8 Å
    xyz[6, :6] *= 1.03  # a stretched molecule, maybe outside
    xyz[7:, :6] += rng.normal(scale=0.06, size=(43, 6, 3))  # hotter conformers: some in, some out
    one_by_one = [check_in_distribution(envelope, s, c) for s, c in zip(z, xyz)]
    inside = inside_envelope(envelope, z, xyz)
    assert inside.tolist() == [r == [] for r in one_by_one]
    assert not inside[1:6].any() and inside[0] and 0 < inside[7:].sum() < 43  # both kinds are in the batch
    assert check_batch(envelope, z, xyz) == one_by_one


def test_atoms_outside_neighbour_counts_names_the_crowded_atoms_and_ignores_padding(training, envelope):
    from converge.apps.chem.ood import atoms_outside_neighbour_counts

    species, coordinates = training
    assert not atoms_outside_neighbour_counts(envelope, species, coordinates).any()
    ethanol = get_molecule("ethanol")  # every methanol atom had 5 neighbours within 5.2 Å; ethanol's have 8
    z = np.r_[ethanol.atomic_numbers, 0][None]  # one padding atom
    xyz = np.r_[ethanol.positions, np.zeros((1, 3))][None]
    outside = atoms_outside_neighbour_counts(envelope, z, xyz)
    assert outside.shape == (1, ethanol.n_atoms + 1)
    assert outside[0, :-1].all() and not outside[0, -1]
    bonds = fit_envelope(METHANOL.atomic_numbers[None], METHANOL.positions[None], cutoff=1.2)  # X-H bonds only
    assert bonds.neighbour_count["6"] == (3, 3)
    bonded = atoms_outside_neighbour_counts(bonds, z, xyz)[0, :-1]
    assert bonded.tolist() == [False, True] + [False] * 7  # only the CH2 carbon has 2 hydrogens, not 3
