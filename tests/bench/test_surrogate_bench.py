"""Simulator against surrogate: the quick configuration runs both apps, ratios and accuracy sources are right."""
import json

import pytest

from converge.bench.surrogate import (
    SurrogateBenchConfig, accuracy_entry, accuracy_source, main, run_surrogate_benchmark, write_results,
)
from converge.contract import load_app

GW_EVALUATION = {"n_noise": 1000, "n_templates": 8,
                 "cnn": {"efficiency": {"1e-02": {"4": 0.1, "6": 0.7, "8": 0.95, "10": 0.99}}},
                 "matched_filter": {"efficiency": {"1e-02": {"4": 0.2, "6": 0.75, "8": 0.99, "10": 1.0}}}}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    (results / "gw.json").write_text(json.dumps(GW_EVALUATION))  # no chem.json: its accuracy is missing
    cfg = SurrogateBenchConfig.fast(apps=("gw", "chem"), results_dir=str(results),
                                    app_overrides=(("chem", "molecule", "water"),))
    return run_surrogate_benchmark(cfg), results


def test_quick_run_is_well_formed(quick_run, tmp_path):
    r, results = quick_run
    assert set(r["apps"]) == {"gw", "chem"} and r["device"] == "cpu"
    for e in r["apps"].values():
        assert e["trained"] is False and "untrained" in e["surrogate"]
        sim, sur = e["simulator_seconds_per_sample"], e["surrogate_seconds_per_sample"]
        assert sim["single"] > 0 and sur["single"] > 0 and sur["batched"] > 0
        assert e["speedup"]["single"] == pytest.approx(sim["single"] / sur["single"])
        assert e["speedup"]["batched"] == pytest.approx((sim["batched"] or sim["single"]) / sur["batched"])
        assert e["surrogate_batch"] == 16
    gw = r["apps"]["gw"]
    assert gw["n_templates"] == 8 and gw["simulator_batch"] == 4 and gw["simulator_seconds_per_sample"]["batched"] > 0
    assert gw["accuracy"]["source"] == str(results / "gw.json")
    assert gw["accuracy"]["cnn"] == {"1e-02": {"6": 0.7, "8": 0.95, "10": 0.99}}
    assert gw["accuracy"]["headline"] == "efficiency at SNR 8, FAP 1e-02 per window: CNN 0.950, matched filter 0.990"
    chem = r["apps"]["chem"]
    assert chem["molecule"] == "water" and chem["simulator_seconds_per_sample"]["batched"] is None
    assert "B3LYP" in chem["simulator"] and chem["level_of_theory"] in chem["simulator"]
    assert chem["accuracy"]["source"] is None
    assert "converge evaluate chem" in chem["accuracy"]["note"]
    json_path, png_path = write_results(r, tmp_path)
    assert json.loads(json_path.read_text())["apps"]["gw"]["n_templates"] == 8
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_accuracy_comes_from_the_run_before_the_results_folder(tmp_path):
    chem = load_app("chem")
    ethanol, methanol = chem.config_cls(molecule="ethanol"), chem.config_cls(molecule="methanol")
    run, results = tmp_path / "run", tmp_path / "results"
    run.mkdir()
    results.mkdir()
    (results / "chem.json").write_text(json.dumps({"ethanol": {"energy_mae_kcal_mol": 0.1,
                                                               "force_mae_kcal_mol_A": 0.8}}))
    path, report = accuracy_source(str(run), str(results), "chem")
    assert path == results / "chem.json"
    assert accuracy_entry(chem, ethanol, path, report) == {
        "source": str(path), "molecule": "ethanol", "energy_mae_kcal_mol": 0.1, "force_mae_kcal_mol_A": 0.8,
        "headline": "ethanol: energy MAE 0.1 kcal/mol, forces 0.8 kcal/mol/Å against DFT"}
    assert accuracy_entry(chem, methanol, path, report)["source"] is None
    (run / "evaluation.json").write_text(json.dumps({"energy_mae_kcal_mol": 0.2, "level_of_theory": "B3LYP"}))
    path, report = accuracy_source(str(run), str(results), "chem")
    assert path == run / "evaluation.json"
    assert accuracy_entry(chem, ethanol, path, report)["energy_mae_kcal_mol"] == 0.2
    assert accuracy_source(None, str(tmp_path / "nowhere"), "gw") == (None, None)
    gw = load_app("gw")
    assert accuracy_entry(gw, gw.config_cls(), None, None)["source"] is None


def test_config_errors_say_how_to_fix_them(capsys):
    with pytest.raises(ValueError, match=r"choose from chem, .*gw"):
        SurrogateBenchConfig(apps=("weather",))
    with pytest.raises(ValueError, match="give cpu or cuda"):
        SurrogateBenchConfig(device="tpu")
    with pytest.raises(ValueError, match="not among apps"):
        SurrogateBenchConfig(apps=("gw",), runs=(("chem", "runs/chem"),))
    for args, message in ((["--run", "runs/gw"], "write it as APP=RUN"),
                          (["--set", "molecule=water"], "write APP.KEY=VALUE")):
        assert main(args) == 2
        assert message in capsys.readouterr().err
