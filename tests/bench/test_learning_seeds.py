"""The seeds summary of the learning benchmarks (validate/curves.py): plain runs only, and no mean where a seed
fell short."""
from converge.validate.curves import summarise_seeds

METRICS = ("energy_mae_kcal_mol", "force_mae_kcal_mol_A")


def run(seed, fraction, diversity=0.0):
    return {"seed": seed, "diversity": diversity, **{m: {"fraction_of_random_calls": fraction} for m in METRICS}}


def test_plain_runs_are_averaged_over_seeds_and_diversity_runs_left_out():
    result = {**run(0, 0.7), "variants": {"s1": run(1, 0.5), "div": run(0, 0.1, diversity=0.3)}}
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
