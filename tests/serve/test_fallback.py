"""Trust-gated serving: an ensemble run served with its spreads, untrusted samples answered by DFT or refused."""
import json

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from converge.contract import TensorSpec
from converge.apps.chem import ChemApp
from converge.apps.chem.molecules import SYMBOL_OF
from converge.apps.chem.config import ChemConfig
from converge.apps.chem.dft import dft_energy_forces
from converge.apps.gw.config import GWConfig
from converge.data.store import ShardStore
from converge.serve import ServedModel, ServerSettings, create_app, load_served_model
from converge.serve.batcher import BatchConfig
from converge.serve.fallback import TrustConfig, TrustSetupError, untrusted_reasons
from converge.serve.registry import OUTSIDE
from converge.serve.protocol import HEADER_LENGTH, decode_infer_response, encode_infer_request
from converge.simulate.runner import SimulateConfig, run_ensemble
from converge.train.loop import TrainConfig
from converge.validate.ensemble import load_ensemble, train_ensemble
from converge.apps.chem.ood import fit_envelope, save_envelope

# Water at HF-cost DFT (LDA/STO-3G, < 0.1 s a point), as in tests/serve/test_apps.py
CHEM = ChemConfig(molecule="water", level="custom", functional="lda,vwn", basis="sto-3g", density_fit=False,
                  grid_level=0, hidden=(16, 16), force_weight=0.1)


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    """A 2-member chem ensemble on 10 DFT conformers of water, with its training envelope (ood.json)."""
    root = tmp_path_factory.mktemp("serve_fallback")
    chem = ChemApp()
    res = run_ensemble(chem, CHEM, SimulateConfig(samples=10, seed=1, workers=1, shard_size=10), root / "data",
                       progress=False)
    assert res.n_failed == 0, res.failures
    arrays = ShardStore.open(root / "data").load()
    run = root / "water-ens"
    train_ensemble(chem, CHEM, TrainConfig(epochs=2, batch_size=4, patience=10), arrays, run, members=2)
    save_envelope(run, fit_envelope(arrays["species"], arrays["coordinates"]))
    return run, arrays


def serve(run, **trust):
    return TestClient(create_app({"water": load_served_model(run, name="water")},
                                 ServerSettings(trust=TrustConfig(**trust) if trust else None)))


def request(client, species, coordinates):
    body, headers = encode_infer_request({"species": species, "coordinates": coordinates})
    return client.post("/v2/models/water/infer", content=body, headers=headers)


def answer(client, species, coordinates):
    r = request(client, species, coordinates)
    assert r.status_code == 200, r.text
    return decode_infer_response(r.content, r.headers.get(HEADER_LENGTH))


def dft(species, coordinates):
    """Energies (B,) and forces (B, A, 3) straight from PySCF, for the float32 coordinates sent."""
    out = [dft_energy_forces([SYMBOL_OF[int(z)] for z in s], c.astype(np.float64), CHEM)
           for s, c in zip(species, coordinates)]
    return np.array([o.energy_hartree for o in out]), np.stack([o.forces_hartree_per_angstrom for o in out])


def metric(client, name, **labels):
    text = client.get("/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}}"):
            return float(line.split()[-1])
    return 0.0


def batch(arrays, idx):
    return arrays["species"][idx].astype(np.int64), arrays["coordinates"][idx].astype(np.float32)


def test_ensemble_run_serves_means_and_spreads(ensemble):
    run, arrays = ensemble
    species, coords = batch(arrays, [0, 1, 2])
    with serve(run, max_uncertainty=1e9) as c:
        meta = c.get("/v2/models/water").json()
        out = answer(c, species, coords)
    assert [o["name"] for o in meta["outputs"]] == ["energy", "forces", "energy_std", "forces_std", "source"]
    assert meta["platform"] == "converge-chem-ensemble"
    direct = load_ensemble(ChemApp(), run).predict({"species": species, "coordinates": coords})
    np.testing.assert_allclose(out["energy"], direct.mean["energy"].numpy(), rtol=0, atol=1e-9)
    np.testing.assert_allclose(out["energy_std"], direct.std["energy"].numpy(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(out["forces_std"], direct.std["forces"].numpy(), rtol=1e-5, atol=1e-7)
    assert np.all(out["energy_std"] > 0)  # two members of different seeds disagree
    np.testing.assert_array_equal(out["source"], [0, 0, 0])  # trusted: the surrogate answered


def test_uncertain_samples_are_answered_by_dft_and_queued(ensemble, tmp_path):
    run, arrays = ensemble
    species, coords = batch(arrays, [3, 4])
    with serve(run, max_uncertainty=0.0, fallback="simulator", queue_dir=tmp_path / "queue") as c:
        out = answer(c, species, coords)
        assert metric(c, "converge_fallback_samples_total", model="water", reason="uncertainty") == 2
    energy, forces = dft(species, coords)
    np.testing.assert_array_equal(out["source"], [1, 1])
    np.testing.assert_allclose(out["energy"], energy, rtol=0, atol=1e-8)
    np.testing.assert_allclose(out["forces"], forces, rtol=0, atol=1e-6)  # served as FP32
    assert np.all(out["energy_std"] > 0)  # the spread that sent them to DFT is kept
    (queued,) = list((tmp_path / "queue").iterdir())
    assert queued.suffix == ".npz" and not queued.name.startswith(".")
    with np.load(queued) as q:  # no pickles
        np.testing.assert_array_equal(q["species"], species)
        np.testing.assert_array_equal(q["coordinates"], coords)
        np.testing.assert_allclose(q["energy"], energy, rtol=0, atol=1e-8)
        np.testing.assert_allclose(q["forces"], forces, rtol=0, atol=1e-8)
        assert all("energy spread per atom" in r for r in q["reasons"])
        meta = json.loads(str(q["meta"]))
    assert meta["model"] == "water" and meta["app"] == "chem" and meta["app_config"]["basis"] == "sto-3g"
    # `converge learn --from-queue`: the queued answers become an ordinary dataset to train on
    from converge.data.store import ShardStore
    from converge.validate.queue import QueueError, queue_to_dataset

    store = queue_to_dataset(ChemApp(), tmp_path / "queue", tmp_path / "from-queue")
    again = ShardStore.open(tmp_path / "from-queue").load()
    assert len(store) == 2 and store.verify() == [] and "fallback_queue" in store.manifest["simulate"]["origin"]
    np.testing.assert_allclose(again["energy"], energy, rtol=0, atol=1e-8)
    np.testing.assert_allclose(again["coordinates"], coords, rtol=0, atol=1e-6)
    with pytest.raises(QueueError, match="exists"):
        queue_to_dataset(ChemApp(), tmp_path / "queue", tmp_path / "from-queue")
    with pytest.raises(QueueError, match="no queued samples"):
        queue_to_dataset(ChemApp(), tmp_path / "nothing", tmp_path / "other")


def test_only_the_uncertain_sample_of_a_request_falls_back(ensemble):
    run, arrays = ensemble
    species, coords = batch(arrays, [5, 6])
    with serve(run, max_uncertainty=1e9) as c:
        surrogate = answer(c, species, coords)
    rho = ChemApp().uncertainty(CHEM, {"species": species}, {}, {"energy": surrogate["energy_std"]})
    assert rho[0] != rho[1]
    with serve(run, max_uncertainty=float(rho.mean()), fallback="simulator") as c:
        out = answer(c, species, coords)
    high = int(np.argmax(rho))
    np.testing.assert_array_equal(out["source"], np.eye(2, dtype=np.int8)[high])
    np.testing.assert_allclose(out["energy"][1 - high], surrogate["energy"][1 - high], rtol=0, atol=1e-9)
    np.testing.assert_allclose(out["energy"][high], dft(species[high:high + 1], coords[high:high + 1])[0][0],
                               rtol=0, atol=1e-8)


def test_a_fallback_past_its_timeout_fails_the_request_clearly(ensemble, tmp_path):
    run, arrays = ensemble
    species, coords = batch(arrays, [0])
    with serve(run, max_uncertainty=0.0, fallback="simulator", timeout_s=1e-3, queue_dir=tmp_path) as c:
        r = request(c, species, coords)
        assert r.status_code == 504
        assert "too uncertain" in r.json()["error"] and "did not answer within 0.001 s" in r.json()["error"]
        assert metric(c, "converge_fallback_failures_total", model="water", reason="timeout") == 1
        assert metric(c, "converge_inference_failures_total", model="water", reason="fallback_timeout") == 1


def squeezed(arrays):
    """Sample 0 with its first H pulled to 0.75 Å of the O: shorter than any O-H bond in training."""
    species, coords = batch(arrays, [0])
    o, h = (int(np.flatnonzero(species[0] == z)[0]) for z in (8, 1))
    bond = coords[0, h] - coords[0, o]
    coords[0, h] = coords[0, o] + np.float32(0.75) * bond / np.linalg.norm(bond)
    return species, coords


def test_out_of_distribution_is_refused_without_a_fallback(ensemble):
    run, arrays = ensemble
    species, coords = squeezed(arrays)
    with serve(run) as c:  # no trust settings: the run's ood.json still gates
        r = request(c, species, coords)
        assert r.status_code == 422, r.text
        assert "out of distribution" in r.json()["error"] and "O-H" in r.json()["error"]
        assert "--fallback simulator" in r.json()["error"]
        assert metric(c, "converge_untrusted_refused_samples_total", model="water",
                      reason="out_of_distribution") == 1
        fine = answer(c, *batch(arrays, [1]))
    np.testing.assert_array_equal(fine["source"], [0])


def test_out_of_distribution_goes_to_dft_with_a_fallback(ensemble):
    run, arrays = ensemble
    species, coords = squeezed(arrays)
    with serve(run, fallback="simulator") as c:
        out = answer(c, species, coords)
        assert metric(c, "converge_fallback_samples_total", model="water", reason="out_of_distribution") == 1
    np.testing.assert_array_equal(out["source"], [1])
    np.testing.assert_allclose(out["energy"], dft(species, coords)[0], rtol=0, atol=1e-8)


def test_gw_cannot_fall_back_to_its_simulator():
    gw = GWConfig(channels=(4, 4, 8), hidden=8)
    model = ServedModel.from_module("gw", torch.nn.Linear(gw.window_samples, 1),
                                    [TensorSpec("strain", "FP32", (-1, gw.window_samples))],
                                    [TensorSpec("logit", "FP32", (-1,)), TensorSpec("logit_std", "FP32", (-1,))],
                                    app="gw", app_config=gw)
    with pytest.raises(TrustSetupError, match="app 'gw' has no simulator for served inputs"):
        create_app({"gw": model}, ServerSettings(trust=TrustConfig(max_uncertainty=0.1, fallback="simulator")))


def test_uncertainty_needs_an_ensemble(ensemble):
    run, _ = ensemble
    single = load_served_model(run / "member-0", name="single")
    with pytest.raises(TrustSetupError, match="needs an ensemble run"):
        create_app({"single": single}, ServerSettings(trust=TrustConfig(max_uncertainty=1.0)))


def test_trust_settings_are_checked():
    with pytest.raises(ValueError, match="fallback='simulator'"):
        TrustConfig(queue_dir="q")
    with pytest.raises(ValueError, match="choose one of simulator"):
        TrustConfig(fallback="dft")
    with pytest.raises(ValueError, match="must be > 0"):
        TrustConfig(fallback="simulator", timeout_s=0)


def test_untrusted_reasons_flag_nan_and_join_ood():
    reasons = untrusted_reasons(np.array([0.5, 2.0, np.nan]), 1.0, "spread", [[], [], ["x"]], 3)
    assert reasons[0] == [] and reasons[1] == ["spread 2 exceeds the limit 1"]
    assert reasons[2] == ["spread nan exceeds the limit 1", "out of distribution: x"]
    assert untrusted_reasons(np.array([5.0]), None, "spread", None, 1) == [[]]


def test_a_gated_model_is_answered_alike_on_the_direct_http_path(ensemble, tmp_path, live_server):
    run, arrays = ensemble
    species, coords = batch(arrays, [3, 4])
    trust = TrustConfig(max_uncertainty=0.0, fallback="simulator")
    with serve(run, max_uncertainty=0.0, fallback="simulator") as c:
        expected = answer(c, species, coords)
    app = create_app({"water": load_served_model(run, name="water")}, ServerSettings(trust=trust))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        out = answer(c, species, coords)
    np.testing.assert_array_equal(out["source"], [1, 1])  # both went to DFT, through the gate's task
    np.testing.assert_array_equal(out["source"], expected["source"])
    # two DFT runs of the same structures, one per server: equal to the SCF's last digits, not bit for bit
    # (on an AVX2 machine the energies of the two were 2.8e-14 Ha apart, 4e-16 relative)
    for name in ("energy", "forces"):
        np.testing.assert_allclose(out[name], expected[name], rtol=1e-12, atol=1e-12)


def test_the_model_runs_the_envelope_check_on_each_whole_batch(ensemble):
    run, arrays = ensemble
    model = load_served_model(run, name="water")
    species, coords = squeezed(arrays)
    inside_s, inside_c = batch(arrays, [1, 2])
    inputs = {"species": np.concatenate([inside_s, species]), "coordinates": np.concatenate([inside_c, coords])}
    served = model.serve(inputs)
    assert OUTSIDE not in model.predict(inputs)  # what the peers of the serve bench run stays the model alone
    assert served[OUTSIDE].shape == (3,) and served[OUTSIDE].dtype == object
    assert served[OUTSIDE].tolist() == model.distribution_check(inputs)
    assert served[OUTSIDE][0] == [] and served[OUTSIDE][1] == [] and "O-H" in " ".join(served[OUTSIDE][2])


def test_the_gate_reads_the_check_the_model_process_ran(ensemble, live_server):
    run, arrays = ensemble

    def never(inputs):
        raise AssertionError("the server ran the envelope check itself")

    settings = ServerSettings(BatchConfig(max_batch_size=8, model_process=True))
    app = create_app({"water": load_served_model(run, name="water")}, settings)
    app.state.gates["water"].outside = never
    with live_server(app, direct_infer=True) as url, httpx.Client(base_url=url, timeout=60) as c:
        fine = answer(c, *batch(arrays, [1, 2]))
        refused = request(c, *squeezed(arrays))
    np.testing.assert_array_equal(fine["source"], [0, 0])
    assert refused.status_code == 422 and "O-H" in refused.json()["error"], refused.text
