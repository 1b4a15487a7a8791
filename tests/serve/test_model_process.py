"""BatchConfig.model_process: batches run by a model worker process (converge.serve.worker)."""
import functools
import sys
import textwrap

import numpy as np
import pytest
from fastapi.testclient import TestClient

from converge.serve import BatchConfig, ServerSettings, create_app
from converge.serve.batcher import BatchFailed, Batcher
from converge.serve.worker import ModelProcess, ModelProcessDied, ModelProcessError

CRASH = -999.0  # a sample starting with this kills the worker process mid-batch

# The child process (spawn) must import the loader: a module on sys.path, which the child inherits.
MODELS = textwrap.dedent("""
    import os

    import torch

    from converge.apps.base import TensorSpec
    from converge.serve import ServedModel

    INPUTS = [TensorSpec("x", "FP32", (-1, 4))]
    OUTPUTS = [TensorSpec("y", "FP32", (-1, 3)), TensorSpec("total", "FP64", (-1,))]


    class Crashy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x):
            if float(x[0, 0]) == -999.0:
                os._exit(3)
            if float(x[0, 0]) == -1.0:
                raise ValueError("no negative ones")
            y = torch.tanh(self.linear(x))
            return y, y.sum(1)


    def make(name="crashy", fail=False):
        if fail:
            raise RuntimeError("cannot load this one")
        return ServedModel.from_module(name, Crashy(), INPUTS, OUTPUTS, loader=functools.partial(make, name))
""").replace("import os\n", "import functools\nimport os\n", 1)


@pytest.fixture
def models(tmp_path, monkeypatch):
    (tmp_path / "mp_test_models.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("mp_test_models", None)
    import mp_test_models
    yield mp_test_models
    sys.modules.pop("mp_test_models", None)


def batch(n=5, first=0.5):
    x = np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)
    x[0, 0] = first
    return x


def test_results_are_identical_to_in_process(models):
    model = models.make()
    with ModelProcess(model.loader, model.name) as worker:
        for n in (1, 3, 8):
            x = {"x": batch(n)}
            here, there = model.predict(x), worker.predict(x)
            assert set(here) == set(there) == {"y", "total"}
            for k in here:
                assert here[k].dtype == there[k].dtype
                np.testing.assert_array_equal(here[k], there[k])
    assert not worker.alive


def test_a_dead_worker_fails_its_batch_clearly_and_is_restarted(models):
    model = models.make()
    with ModelProcess(model.loader, model.name) as worker:
        first = worker.pid
        with pytest.raises(ModelProcessDied, match=r"'crashy'.*worker process died \(exit code 3\)"):
            worker.predict({"x": batch(4, first=CRASH)})
        assert not worker.alive
        out = worker.predict({"x": batch(4)})  # the next batch restarts it
        np.testing.assert_array_equal(out["y"], model.predict({"x": batch(4)})["y"])
        assert worker.alive and worker.pid != first and worker.restarts == 1


def test_model_errors_come_back_and_the_worker_lives_on(models):
    model = models.make()
    with ModelProcess(model.loader, model.name) as worker:
        pid = worker.pid
        with pytest.raises(RuntimeError, match="ValueError: no negative ones"):
            worker.predict({"x": batch(2, first=-1.0)})
        assert worker.alive and worker.pid == pid and worker.restarts == 0
        worker.predict({"x": batch(2)})


def test_a_model_that_cannot_load_is_a_clear_error(models):
    worker = ModelProcess(functools.partial(models.make, fail=True), "broken")
    with pytest.raises(ModelProcessError, match="could not load the model: RuntimeError: cannot load this one"):
        worker.start()
    assert not worker.alive
    worker.close()


def test_batcher_with_a_worker_batches_and_recovers(models):
    model = models.make()
    with ModelProcess(model.loader, model.name) as worker:
        b = Batcher(worker.predict, BatchConfig(max_batch_size=8), "crashy", start=False)
        xs = [batch(2, first=i) for i in range(3)]
        futures = [b.submit({"x": x}) for x in xs]
        assert b.step() == 6  # one batch, split back in order
        for x, f in zip(xs, futures):
            np.testing.assert_array_equal(f.result(0)["y"], model.predict({"x": x})["y"])
        bad, good = b.submit({"x": batch(1, first=CRASH)}), b.submit({"x": batch(1)})
        b.step()
        for f in (bad, good):  # the whole in-flight batch fails, with the reason
            with pytest.raises(BatchFailed, match="ModelProcessDied: model 'crashy': its worker process died"):
                f.result(0)
        again = b.submit({"x": batch(1)})
        b.step()
        np.testing.assert_array_equal(again.result(0)["y"], model.predict({"x": batch(1)})["y"])
        b.close()


def test_app_serves_through_worker_processes_and_stops_them(models):
    model = models.make()
    app = create_app({"crashy": model}, ServerSettings(BatchConfig(max_batch_size=8, model_process=True)))
    x = batch(3)
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 4], "data": x.reshape(-1).tolist()}]}
    with TestClient(app) as c:
        worker = app.state.workers["crashy"]
        assert worker.alive
        r = c.post("/v2/models/crashy/infer", json=doc)
        assert r.status_code == 200, r.text
        y = next(o for o in r.json()["outputs"] if o["name"] == "y")
        np.testing.assert_array_equal(np.array(y["data"], np.float32).reshape(3, 3), model.predict({"x": x})["y"])
        crash = {"inputs": [{**doc["inputs"][0], "data": batch(3, first=CRASH).reshape(-1).tolist()}]}
        r = c.post("/v2/models/crashy/infer", json=crash)
        assert r.status_code == 500 and "worker process died" in r.json()["error"]
        assert c.post("/v2/models/crashy/infer", json=doc).status_code == 200
    assert not worker.alive  # shutdown stopped it


def test_models_without_a_loader_stay_in_process(known):
    app = create_app({"linear": known.model()}, ServerSettings(BatchConfig(model_process=True)))
    assert app.state.workers == {}


def test_small_batches_stay_in_process():
    from converge.serve.app import split_predict

    calls = []
    predict = split_predict(lambda x: calls.append("local"), lambda x: calls.append("remote"), 2)
    predict({"x": np.zeros((1, 4))})
    predict({"x": np.zeros((2, 4))})
    assert calls == ["local", "remote"]
    with pytest.raises(ValueError, match="model_process_min_batch=0"):
        BatchConfig(model_process_min_batch=0)
