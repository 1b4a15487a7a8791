"""Both reference apps' real trained models, served together from their run folders."""
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from converge.apps.chem import ChemApp
from converge.apps.chem.config import ChemConfig
from converge.apps.gw.app import GWApp
from converge.apps.gw.config import GWConfig
from converge.apps.gw.waveforms import sample_bbh_parameters, whitened_signal
from converge.data.store import ShardStore
from converge.serve import ModelLoadError, create_app, load_served_model
from converge.serve.protocol import HEADER_LENGTH, decode_infer_response, encode_infer_request
from converge.serve.server import load_runs
from converge.simulate.runner import SimulateConfig, run_ensemble
from converge.train.loop import TrainConfig, autocast_context, load_model, train
from converge.train.precision import native_bf16

GW = GWConfig(channels=(4, 4, 8), hidden=8)
# Water at HF-cost DFT (LDA/STO-3G), as in tests/apps/chem/test_app.py
CHEM = ChemConfig(molecule="water", level="custom", functional="lda,vwn", basis="sto-3g", density_fit=False,
                  grid_level=0, hidden=(16, 16), force_weight=0.1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_apps")
    rng = np.random.default_rng(7)
    signals = np.stack([whitened_signal(GW, sample_bbh_parameters(GW, rng)) for _ in range(32)])
    # precision "auto": the gw run is bf16 where the CPU has bf16 units, so the server must autocast as training did
    train(GWApp(), GW, TrainConfig(epochs=1, batch_size=16, patience=10), {"signal": signals}, root / "gw-run",
          progress=False)
    chem = ChemApp()
    res = run_ensemble(chem, CHEM, SimulateConfig(samples=10, seed=1, workers=1, shard_size=10), root / "water-data",
                       progress=False)
    assert res.n_failed == 0, res.failures
    arrays = ShardStore.open(root / "water-data").load()
    train(chem, CHEM, TrainConfig(epochs=2, batch_size=4, patience=10), arrays, root / "water-run", progress=False)
    return root, arrays


def post(client, model, inputs, binary=True):
    body, headers = encode_infer_request(inputs, binary=binary)
    r = client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    return decode_infer_response(r.content, r.headers.get(HEADER_LENGTH))


def test_gw_and_chem_runs_are_served_side_by_side(runs):
    root, arrays = runs
    models = load_runs([root / "gw-run", f"water={root / 'water-run'}"])
    assert sorted(models) == ["gw-run", "water"]
    gw_precision = "bf16" if native_bf16(torch.device("cpu")) else "fp32"  # auto: fp32 where bf16 is emulated
    assert models["gw-run"].precision == gw_precision and models["water"].precision == "fp32"
    gw_model, _ = load_model(GWApp(), root / "gw-run")
    chem_model, _ = load_model(ChemApp(), root / "water-run")
    strain = np.random.default_rng(0).standard_normal((5, GW.window_samples)).astype(np.float32)
    species = arrays["species"][:4].astype(np.int64)
    coords = arrays["coordinates"][:4].astype(np.float32)
    with TestClient(create_app(models)) as c:
        meta = c.get("/v2/models/gw-run").json()
        assert meta["platform"] == "converge-gw"
        assert meta["inputs"] == [{"name": "strain", "datatype": "FP32", "shape": [-1, GW.window_samples]}]
        gw_out = post(c, "gw-run", {"strain": strain}, binary=False)
        water = post(c, "water", {"species": species, "coordinates": coords})
        shifted = post(c, "water", {"species": species, "coordinates": coords + np.float32(1.5)})

    # served with each BatchNorm folded into its convolution (GWApp.inference_model): none is left, and the answers
    # are the folded model's exactly, the trained model's to the served precision's rounding
    assert not any(isinstance(m, torch.nn.BatchNorm1d) for m in models["gw-run"].module.modules())
    assert any(isinstance(m, torch.nn.BatchNorm1d) for m in gw_model.modules())
    folded = GWApp().inference_model(load_model(GWApp(), root / "gw-run")[0])
    with torch.inference_mode(), autocast_context(torch.device("cpu"), gw_precision):
        direct = GWApp().serve_predict(folded, {"strain": torch.from_numpy(strain)})
        trained = GWApp().serve_predict(gw_model, {"strain": torch.from_numpy(strain)})
    np.testing.assert_allclose(gw_out["logit"], direct["logit"].float().numpy(), rtol=1e-6, atol=1e-6)
    rounding = 2e-2 if gw_precision == "bf16" else 1e-5  # bf16 keeps 8 bits of each product's mantissa
    np.testing.assert_allclose(gw_out["logit"], trained["logit"].float().numpy(), rtol=rounding, atol=rounding)
    np.testing.assert_allclose(gw_out["probability"], 1 / (1 + np.exp(-gw_out["logit"])), rtol=1e-6)

    assert ChemApp().inference_model(chem_model) is chem_model  # the contract's default: served as trained
    direct = ChemApp().serve_predict(chem_model, {"species": torch.from_numpy(species),
                                                  "coordinates": torch.from_numpy(coords)})
    assert water["energy"].dtype == np.float64 and water["forces"].shape == (4, 3, 3)
    np.testing.assert_allclose(water["energy"], direct["energy"].numpy(), rtol=0, atol=1e-9)
    np.testing.assert_allclose(water["forces"], direct["forces"].numpy(), rtol=1e-6, atol=1e-7)
    # physics through the server: a rigid translation changes neither energy nor forces
    np.testing.assert_allclose(shifted["energy"], water["energy"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(shifted["forces"], water["forces"], rtol=0, atol=1e-4)
    assert np.all(np.abs(water["forces"].sum(1)) < 1e-4)  # and the net force vanishes


def test_a_run_is_named_after_its_folder_and_checked_on_load(runs):
    root, _ = runs
    assert load_served_model(root / "water-run").name == "water-run"
    with pytest.raises(ModelLoadError, match="no missing.pt checkpoint"):
        load_served_model(root / "water-run", which="missing")
    with pytest.raises(ModelLoadError, match="model name 'two words': use letters, digits"):
        load_served_model(root / "water-run", name="two words")
    with pytest.raises(ModelLoadError, match="two runs are both named 'gw-run'"):
        load_runs([root / "gw-run", root / "gw-run"])
