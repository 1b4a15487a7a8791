"""The seeds summary of the learning benchmarks (validate/curves.py): plain runs only, and no mean where a seed
fell short."""
import pytest

from converge.validate.curves import summarise_seeds

METRICS = ("energy_mae_kcal_mol", "force_mae_kcal_mol_A")


def run(seed, fraction, diversity=0.0):
    return {"seed": seed, "diversity": diversity, **{m: {"fraction_of_random_calls": fraction} for m in METRICS}}


def test_plain_runs_are_averaged_over_seeds_and_diversity_runs_left_out():
    result = {**run(0, 0.7), "variants": {"s1": run(1, 0.5), "div": run(0, 0.1, diversity=0.3),
                                          "delta": {**run(0, 0.2), "delta": "gfn2_xtb"}}}
    seeds = summarise_seeds(result, METRICS)["seeds"]
    assert seeds["seeds"] == [0, 1]
    assert seeds["energy_mae_kcal_mol"] == {"fraction_of_random_calls": [0.7, 0.5], "mean": 0.6}


def test_a_seed_that_never_reached_random_leaves_no_mean():
    seeds = summarise_seeds({**run(0, 0.4), "variants": {"s1": run(1, None)}}, METRICS)["seeds"]
    assert seeds["force_mae_kcal_mol_A"] == {"fraction_of_random_calls": [0.4, None], "mean": None}


def test_seeds_are_read_from_settings_where_a_run_keeps_them_there():
    def nested(seed, fraction, diversity=0.0):
        flat = run(seed, fraction, diversity)
        return {"settings": {"seed": flat.pop("seed"), "diversity": flat.pop("diversity")}, **flat}

    result = {**nested(0, 0.3), "variants": {"s2": nested(2, 0.5), "div": nested(2, 0.9, diversity=0.3)}}
    seeds = summarise_seeds(result, METRICS)["seeds"]
    assert seeds["seeds"] == [0, 2]
    assert seeds["energy_mae_kcal_mol"]["mean"] == 0.4


def curves(random, active, calls=(100, 200)):
    return {label: [{"dft_calls": c, "energy_mae_kcal_mol": e, "force_mae_kcal_mol_A": None} for c, e in
                    zip(calls, errors)] for label, errors in (("random", random), ("active", active))}


def test_each_seed_is_also_judged_against_random_averaged_over_the_seeds():
    """Random ends at 2 and 4 (mean 3): seed 0's active (4 -> 1) crosses 3 a third of the way, at 133.3 calls;
    seed 1's starts at 2, below it, at 100. Forces have no values, so no entry."""
    result = {**run(0, 0.7), "curves": curves([4, 2], [4, 1]),
              "variants": {"s1": {**run(1, 0.5), "curves": curves([5, 4], [2, 1.5])}}}
    against = summarise_seeds(result, METRICS)["seeds"]["against_random_mean"]
    assert list(against) == ["energy_mae_kcal_mol"]
    energy = against["energy_mae_kcal_mol"]
    assert energy["random_final_mean"] == 3.0
    assert energy["fraction_of_random_calls"] == pytest.approx([2 / 3, 0.5])
    assert energy["mean"] == pytest.approx(7 / 12)


def test_a_seed_that_never_reaches_random_mean_leaves_no_mean_and_schedules_must_match():
    result = {**run(0, 0.7), "curves": curves([4, 2], [4, 3.5]),
              "variants": {"s1": {**run(1, 0.5), "curves": curves([5, 4], [2, 1.5])}}}
    energy = summarise_seeds(result, METRICS)["seeds"]["against_random_mean"]["energy_mae_kcal_mol"]
    assert energy["fraction_of_random_calls"] == [None, 0.5] and energy["mean"] is None
    result["variants"]["s1"]["curves"] = curves([5, 4], [2, 1.5], calls=(100, 300))
    with pytest.raises(ValueError, match="differ in their DFT calls"):
        summarise_seeds(result, METRICS)
