"""The ensemble runner, on a damped harmonic oscillator solved with scipy.

The oscillator is a fixture app for the generic stage: cheap, exact (it has a
closed form to check the stored data against) and able to fail or kill its
worker on demand.
"""
from __future__ import annotations

import os
import json
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy.integrate import solve_ivp

from converge.contract import App, ArraySpec, Monitor
from converge.config import ConfigError, from_dict
from converge.data.store import CorruptShardError, ShardStore, StoreError
from converge.simulate.runner import WORKER_DIED, RetryQueue, SampleOutcome, SimulateConfig, run_ensemble

SAMPLES, SHARD_SIZE = 20, 6  # four shards, the last one short


@dataclass(frozen=True)
class OscillatorConfig:
    n_times: int = 32
    t_max: float = 10.0  # seconds
    fail_above: float = 0.0  # frequencies above this raise (0: never)
    wrong_dtype: bool = False  # return x as float64 although the schema says float32
    kill_marker: str = ""  # if set, the first simulate() call creates it and SIGKILLs its own process
    kill_above: float = 0.0  # frequencies above this SIGKILL their process, every time (0: never)
    flaky_dir: str = ""  # if set, each sample's first attempt raises (a marker file per sample remembers)
    sleep_s: float = 0.0  # seconds each sample sleeps first, to stretch a run


class OscillatorApp(App):
    """x'' + 2 zeta omega x' + omega^2 x = 0 from x(0) = 1, x'(0) = 0."""

    name = "oscillator"
    config_cls = OscillatorConfig
    monitor = Monitor("loss", "min")
    packages = ("scipy",)

    def schema(self, cfg: OscillatorConfig) -> dict[str, ArraySpec]:
        return {"x": ArraySpec((cfg.n_times,), "float32"), "energy": ArraySpec((), "float64")}

    def sample_parameters(self, cfg: OscillatorConfig, rng: np.random.Generator) -> dict[str, float]:
        return {"frequency": rng.uniform(0.5, 2.0), "damping": rng.uniform(0.0, 0.5)}  # rad/s, 1

    def simulate(self, cfg: OscillatorConfig, params: dict[str, float]) -> dict[str, np.ndarray]:
        time.sleep(cfg.sleep_s)
        if cfg.kill_marker:
            try:
                os.close(os.open(cfg.kill_marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        omega, zeta = params["frequency"], params["damping"]
        if cfg.kill_above and omega > cfg.kill_above:
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg.flaky_dir and not (marker := Path(cfg.flaky_dir) / f"{omega:.17g}").exists():
            marker.touch()
            raise RuntimeError("transient")
        if cfg.fail_above and omega > cfg.fail_above:
            raise ValueError(f"frequency {omega:.3f} above {cfg.fail_above}")
        times = np.linspace(0.0, cfg.t_max, cfg.n_times)
        sol = solve_ivp(
            lambda t, y: [y[1], -2 * zeta * omega * y[1] - omega**2 * y[0]],
            (0.0, cfg.t_max), [1.0, 0.0], t_eval=times, rtol=1e-10, atol=1e-12,
        )
        x, v = sol.y
        energy = 0.5 * (v[-1] ** 2 + omega**2 * x[-1] ** 2)
        return {"x": x.astype(np.float64 if cfg.wrong_dtype else np.float32), "energy": np.float64(energy)}

    def make_model(self, cfg: Any) -> Any:
        raise NotImplementedError

    def make_datasets(self, cfg: Any, arrays: Any, seed: int) -> Any:
        raise NotImplementedError

    def loss(self, output: Any, batch: Any) -> Any:
        raise NotImplementedError

    def metrics(self, outputs: Any, batches: Any) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self, run_dir: Path, data_dir: Path, out_dir: Path, **options: Any) -> dict:
        raise NotImplementedError


def underdamped_x(times: np.ndarray, omega: float, zeta: float) -> np.ndarray:
    """Closed form of the oscillator above for zeta < 1."""
    omega_d = omega * np.sqrt(1 - zeta**2)
    decay = np.exp(-zeta * omega * times)
    return decay * (np.cos(omega_d * times) + zeta / np.sqrt(1 - zeta**2) * np.sin(omega_d * times))


def simulate(out: Path, workers: int = 2, max_shards: int | None = None, repair: bool = False, **app_options: Any):
    cfg = SimulateConfig(samples=SAMPLES, seed=7, shard_size=SHARD_SIZE, workers=workers)
    return run_ensemble(OscillatorApp(), OscillatorConfig(**app_options), cfg, out, progress=False,
                        repair=repair, max_shards=max_shards)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("baseline") / "data"
    result = simulate(out)
    assert result.complete and result.n_ok == SAMPLES and result.n_failed == 0
    assert result.computed_ids == (0, 1, 2, 3) and result.shards_computed == 4
    return out


def test_stored_samples_match_the_closed_form(baseline: Path) -> None:
    store = ShardStore.open(baseline)
    data, params = store.load(), store.params()
    np.testing.assert_array_equal(data["index"], np.arange(SAMPLES))
    assert data["x"].shape == (SAMPLES, 32) and data["x"].dtype == np.float32
    times = np.linspace(0.0, 10.0, 32)
    for x, omega, zeta in zip(data["x"], params["frequency"], params["damping"]):
        np.testing.assert_allclose(x, underdamped_x(times, omega, zeta), atol=1e-6)
    # parameters come from default_rng([seed, i]), whatever shard or worker ran sample i
    rng = np.random.default_rng([7, 13])
    assert params["frequency"][13] == rng.uniform(0.5, 2.0) and params["damping"][13] == rng.uniform(0.0, 0.5)


def test_resume_after_interruption_is_byte_identical(baseline: Path, tmp_path: Path) -> None:
    first = simulate(tmp_path, max_shards=2)
    assert first.computed_ids == (0, 1) and first.missing_ids == (2, 3) and not first.complete
    second = simulate(tmp_path)
    assert second.computed_ids == (2, 3) and second.skipped_ids == (0, 1) and second.complete
    assert tree_bytes(tmp_path) == tree_bytes(baseline)  # also: no temp files left behind


def test_worker_count_does_not_change_the_dataset(baseline: Path, tmp_path: Path) -> None:
    simulate(tmp_path, workers=1)
    assert tree_bytes(tmp_path) == tree_bytes(baseline)


def test_failing_samples_are_recorded_and_the_rest_stored(baseline: Path, tmp_path: Path) -> None:
    result = simulate(tmp_path, fail_above=1.5)
    assert 0 < result.n_failed < SAMPLES and result.n_ok + result.n_failed == SAMPLES
    failed = [f["index"] for f in result.failures]
    for failure in result.failures:
        assert failure["error"].startswith("ValueError: frequency ")
        assert failure["params"]["frequency"] > 1.5
    store = ShardStore.open(tmp_path)
    data, reference = store.load(), ShardStore.open(baseline).load()
    kept = np.setdiff1d(np.arange(SAMPLES), failed)
    np.testing.assert_array_equal(data["index"], kept)
    np.testing.assert_array_equal(data["x"], reference["x"][kept])
    assert np.all(store.params()["frequency"] <= 1.5)
    assert store.failures() == result.failures


def test_a_sample_that_fails_once_is_stored_on_its_retry(baseline: Path, tmp_path: Path) -> None:
    result = simulate(tmp_path / "data", flaky_dir=str(tmp_path))
    assert result.n_ok == SAMPLES and result.n_failed == 0
    assert len(list(tmp_path.glob("*.*"))) == SAMPLES  # every sample did fail once
    data = ShardStore.open(tmp_path / "data").load()
    np.testing.assert_array_equal(data["x"], ShardStore.open(baseline).load()["x"])


def test_arrays_that_break_the_schema_are_failures_that_say_why(tmp_path: Path) -> None:
    cfg = SimulateConfig(samples=3, shard_size=3, workers=1)
    result = run_ensemble(OscillatorApp(), OscillatorConfig(wrong_dtype=True), cfg, tmp_path, progress=True)
    assert result.n_ok == 0 and result.n_failed == 3
    assert result.failures[0]["error"] == (
        "SchemaMismatchError: array 'x' has dtype float64, the schema says float32; "
        "cast it in simulate() with .astype('float32')"
    )
    assert ShardStore.open(tmp_path).load()["x"].shape == (0, 32)


def test_corrupt_shard_is_named_and_repair_recreates_only_it(baseline: Path, tmp_path: Path) -> None:
    out = tmp_path / "data"
    shutil.copytree(baseline, out)
    shard = out / "shards" / "shard-00001.h5"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))

    problems = ShardStore.open(out).verify()
    assert len(problems) == 1 and "shard-00001.h5" in problems[0] and "converge simulate --repair" in problems[0]
    with pytest.raises(CorruptShardError, match="shard-00001.h5"):
        ShardStore.open(out).load()
    with pytest.raises(CorruptShardError, match=r"shard-00001\.h5.*\n.*--repair"):
        simulate(out)

    others = {p: p.stat().st_mtime_ns for p in (out / "shards").iterdir() if p != shard}
    result = simulate(out, repair=True)
    assert result.computed_ids == (1,) and (result.shards_computed, result.shards_skipped) == (1, 3)
    assert {p: p.stat().st_mtime_ns for p in others} == others
    assert tree_bytes(out) == tree_bytes(baseline)


def test_other_settings_in_the_same_directory_are_refused(baseline: Path, tmp_path: Path) -> None:
    out = tmp_path / "data"
    shutil.copytree(baseline, out)
    cfg = SimulateConfig(samples=SAMPLES, seed=8, shard_size=SHARD_SIZE)
    with pytest.raises(StoreError, match=r"seed: stored 7, requested 8.*another --out.*delete"):
        run_ensemble(OscillatorApp(), OscillatorConfig(), cfg, out, progress=False)
    with pytest.raises(StoreError, match=r"app_config.*schema"):  # the array shape changes too
        simulate(out, n_times=16)
    assert tree_bytes(out) == tree_bytes(baseline)


def test_a_store_made_before_a_setting_existed_resumes_at_its_default(baseline: Path, tmp_path: Path) -> None:
    out = tmp_path / "data"
    shutil.copytree(baseline, out)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["app_config"]["t_max"]  # as if t_max were added to the config after this store was made
    (out / "manifest.json").write_text(json.dumps(manifest))
    result = simulate(out)  # t_max at its default: the same dataset
    assert result.complete and result.shards_skipped == 4 and result.shards_computed == 0
    with pytest.raises(StoreError, match=r"app_config"):
        simulate(out, t_max=5.0)  # another value is another dataset


def test_a_dataset_grows_to_more_samples_and_never_shrinks(baseline: Path, tmp_path: Path) -> None:
    def run(samples: int):
        cfg = SimulateConfig(samples=samples, seed=7, shard_size=SHARD_SIZE, workers=1)
        return run_ensemble(OscillatorApp(), OscillatorConfig(), cfg, tmp_path, progress=False)

    first = run(14)  # shards 0-1 full, shard 2 short (samples 12-13)
    assert first.computed_ids == (0, 1, 2) and first.complete
    kept = {k: (tmp_path / "shards" / f"shard-0000{k}.h5").stat().st_mtime_ns for k in (0, 1)}
    grown = run(SAMPLES)
    assert grown.computed_ids == (2, 3) and grown.skipped_ids == (0, 1) and grown.complete
    assert {k: (tmp_path / "shards" / f"shard-0000{k}.h5").stat().st_mtime_ns for k in (0, 1)} == kept
    assert tree_bytes(tmp_path) == tree_bytes(baseline)  # the same dataset as one run of 20
    with pytest.raises(StoreError, match=r"n_samples: stored 20, requested 12.*grow, never shrink"):
        run(12)
    assert tree_bytes(tmp_path) == tree_bytes(baseline)


def test_a_killed_worker_does_not_stop_the_run(baseline: Path, tmp_path: Path) -> None:
    marker = tmp_path / "killed"
    result = simulate(tmp_path / "data", kill_marker=str(marker))
    assert marker.exists()  # a worker did die
    assert result.complete and result.n_failed == 0
    data = ShardStore.open(tmp_path / "data").load()
    np.testing.assert_array_equal(data["x"], ShardStore.open(baseline).load()["x"])


def test_a_sample_that_always_kills_its_worker_fails_alone(baseline: Path, tmp_path: Path) -> None:
    result = simulate(tmp_path, kill_above=1.85)  # samples 3 and 19
    assert [f["index"] for f in result.failures] == [3, 19]
    assert all(f["error"] == WORKER_DIED for f in result.failures)
    assert result.failures[0]["params"]["frequency"] > 1.85  # drawn again by the parent for the record
    kept = np.setdiff1d(np.arange(SAMPLES), [3, 19])  # the samples running beside them were not charged
    np.testing.assert_array_equal(ShardStore.open(tmp_path).load()["x"], ShardStore.open(baseline).load()["x"][kept])


def test_workers_that_always_die_stop_the_run_with_a_clear_error(tmp_path: Path) -> None:
    cfg = SimulateConfig(samples=4, shard_size=2, workers=1, retries=0)
    with pytest.raises(RuntimeError, match=r"died on samples \[0, 1, 2\] in a row.*imports in a fresh Python"):
        run_ensemble(OscillatorApp(), OscillatorConfig(kill_above=0.1), cfg, tmp_path, progress=False)


def test_retry_queue_charges_only_a_sample_that_dies_alone() -> None:
    queue = RetryQueue(iter(range(3)), retries=1)
    died = [SampleOutcome(i, None, None, WORKER_DIED, retry=True) for i in range(3)]
    assert [queue.next(), queue.next()] == [0, 1]
    assert not queue.settle(died[0], culprit_known=False) and not queue.settle(died[1], culprit_known=False)
    assert queue.attempts == {}  # two were running: neither is charged
    assert queue.exclusive and queue.next() == 0  # suspects run one at a time
    assert not queue.settle(died[0], culprit_known=True) and queue.attempts == {0: 1}
    assert queue.next() == 1 and queue.settle(SampleOutcome(1, {}, {}), culprit_known=True)
    assert queue.next() == 0 and queue.settle(died[0], culprit_known=True)  # retries used up: final
    assert not queue.exclusive and queue.next() == 2
    failed = SampleOutcome(2, {}, None, "ValueError: x", retry=True)
    assert not queue.settle(failed, culprit_known=True) and queue.next() == 2  # an error: tried again
    assert queue.settle(failed, culprit_known=True) and queue.next() is None


def test_config_errors_name_the_key_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"^simulate\.workers=0: must be >= 1"):
        SimulateConfig(workers=0)
    with pytest.raises(ConfigError, match=r"simulate\.retries=-1: must be >= 0"):
        SimulateConfig(retries=-1)
    with pytest.raises(ConfigError, match=r"simulate\.samples=2\.5: must be an integer"):
        SimulateConfig(samples=2.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"shard_size=0"):
        from_dict(SimulateConfig, {"shard_size": "0"}, "simulate")
    assert from_dict(SimulateConfig, {"workers": "3"}, "simulate").workers == 3


def test_an_app_class_workers_cannot_import_is_refused(tmp_path: Path) -> None:
    class LocalApp(OscillatorApp):
        pass

    with pytest.raises(TypeError, match="module level"):
        run_ensemble(LocalApp(), OscillatorConfig(), SimulateConfig(samples=2), tmp_path, progress=False)
