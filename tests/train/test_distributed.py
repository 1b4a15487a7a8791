"""Data-parallel (DDP) and sharded (FSDP) training on the CPU with Gloo.

Two-process runs go through torchrun (``distributed_worker.py``) and are
compared with one-process runs of the same config: the chem app's batches are
rows of the stored arrays, so a step's samples are the same at any world size
and the parameters must agree to float32 round-off. (The gw app draws its noise
per rank and normalises with BatchNorm over each rank's share of a batch, so
its DDP runs are equivalent in distribution, not bit for bit.)

Tolerances: float32 parameters after a few AdamW steps; sums over ranks and
micro-batches are reordered, which moves the last bits (seen: 2e-8).
"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from converge.apps.chem import ChemApp
from converge.apps.chem.config import ChemConfig
from converge.apps.gw.pipeline import WindowSource
from converge.config import ConfigError
from converge.data.sources import ArraySource
from converge.data.store import ShardStore
from converge.simulate.runner import SimulateConfig, dataset_header
from converge.train.checkpoint import CheckpointError, load_checkpoint, sharded_path
from converge.train.distributed import Ranks, StepPlan, plan_steps, rank_batches
from converge.train.loop import TrainConfig, load_model, train

CHEM = ChemConfig(molecule="water", hidden=(16, 16))
N_SAMPLES = 31  # 25 train + 6 validation: uneven over 2 ranks, a 1-sample last batch at batch_size 8
BASE = {"epochs": 2, "batch_size": 8, "precision": "fp32", "val_fraction": 0.2, "patience": 10}
WORKER = Path(__file__).with_name("distributed_worker.py")
ATOL, RTOL = 1e-6, 1e-5


def water_arrays(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Water conformers labelled by a harmonic potential E = E0 + |r - r0|^2 / 2 (hartree, Å): valid, DFT-free."""
    rng = np.random.default_rng(seed)
    r0 = np.array([[0.0, 0.0, 0.117], [0.0, 0.757, -0.467], [0.0, -0.757, -0.467]])
    d = 0.05 * rng.standard_normal((n, 3, 3))
    return {"species": np.tile(np.array([8, 1, 1], dtype=np.int64), (n, 1)), "coordinates": r0 + d,
            "energy": -76.0 + 0.5 * (d**2).sum(axis=(1, 2)), "forces": -d}


def torchrun(root: Path, jobs: list[dict], arrays: Path, nproc: int = 2, app: str = "chem", app_cfg=CHEM) -> None:
    spec = root / f"spec-{len(list(root.glob('spec-*')))}.json"
    spec.write_text(json.dumps({"app": app, "app_config": asdict(app_cfg), "arrays": str(arrays), "jobs": jobs}))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", str(WORKER), str(spec)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def params(run: Path, which: str = "last") -> dict[str, torch.Tensor]:
    return load_model(ChemApp(), run, which)[0].state_dict()


def assert_same_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=RTOL, atol=ATOL, msg=key)


def test_assert_same_model_fails_on_a_different_model():
    a = {"w": torch.zeros(3)}
    with pytest.raises(AssertionError):
        assert_same_model(a, {"w": torch.tensor([0.0, 0.0, 1e-4])})
    with pytest.raises(AssertionError):
        assert_same_model(a, {"v": torch.zeros(3)})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One-process runs, then one torchrun launch of every two-process run, then resumes back in one process."""
    root = tmp_path_factory.mktemp("ddp")
    arrays = water_arrays(N_SAMPLES)
    np.savez(root / "arrays.npz", **arrays)
    app = ChemApp()

    def one(name, resume=False, stop_after=None, **kw):
        train(app, CHEM, TrainConfig(**{**BASE, **kw}), arrays, root / name, resume=resume, progress=False,
              stop_after=stop_after)

    one("one_step", epochs=1, batch_size=26)  # a single optimizer step over all 25 samples
    one("one")
    one("one_accum", grad_accum_steps=4)
    one("one_cut", stop_after=1)
    one("shard_one_cut", stop_after=1, shard=True)
    shutil.copytree(root / "one_cut", root / "one_then_two")
    shutil.copytree(root / "shard_one_cut", root / "shard_one_then_two")
    jobs = [{"run_dir": str(root / "two_step"), "train": {**BASE, "epochs": 1, "batch_size": 26}},
            {"run_dir": str(root / "two_accum"), "train": {**BASE, "grad_accum_steps": 2}},
            {"run_dir": str(root / "two_cut"), "train": BASE, "stop_after": 1},
            {"run_dir": str(root / "one_then_two"), "train": BASE, "resume": True},
            {"run_dir": str(root / "shard_two_cut"), "train": {**BASE, "shard": True}, "stop_after": 1},
            {"run_dir": str(root / "shard_one_then_two"), "train": {**BASE, "shard": True}, "resume": True}]
    torchrun(root, jobs, root / "arrays.npz")
    shutil.copytree(root / "two_cut", root / "two_then_one")
    shutil.copytree(root / "shard_two_cut", root / "shard_two_then_one")
    one("two_then_one", resume=True)
    one("shard_two_then_one", resume=True, shard=True)
    return root


def test_two_process_ddp_step_equals_one_process_on_the_whole_batch(runs):
    assert_same_model(params(runs / "one_step"), params(runs / "two_step"))
    before = ChemApp().make_model(CHEM).state_dict()  # the step moved the weights: the check is not vacuous
    assert any(not torch.allclose(before[k], v) for k, v in params(runs / "two_step").items() if "networks" in k)


def test_gradient_accumulation_with_no_sync_equals_one_big_batch(runs):
    reference = params(runs / "one")
    assert_same_model(reference, params(runs / "one_accum"))  # 4 micro-batches of 2 in one process
    assert_same_model(reference, params(runs / "two_accum"))  # 2 ranks x 2 micro-batches of 2, no_sync on the first


def test_checkpoints_resume_across_world_sizes(runs):
    reference = params(runs / "one")
    for name in ("two_then_one", "one_then_two"):
        history = json.loads((runs / name / "history.json").read_text()) if name == "one_then_two" else None
        assert_same_model(reference, params(runs / name))
        lines = [json.loads(x) for x in (runs / name / "metrics.jsonl").read_text().splitlines()]
        assert [x["epoch"] for x in lines] == [0, 1]
        assert lines[-1]["val_loss"] == pytest.approx(
            json.loads((runs / "one" / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"], rel=1e-5)
        if history is not None:
            assert [h["epoch"] for h in history] == [0, 1]
    # the checkpoint holds the unwrapped model: no DDP "module." prefix
    assert not any(k.startswith("module.") for k in load_checkpoint(runs / "two_cut" / "last.pt")["model"])


def test_fsdp_sharded_checkpoint_reloads_on_another_number_of_ranks(runs):
    cut = runs / "shard_two_cut" / "last.dcp"
    assert sorted(p.name for p in cut.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert not list(runs.glob("shard_two_cut/.*.dcp.*"))  # no temp or old directory left behind
    # gathered in one process, the 2-rank sharded state is the 2-rank DDP state after the same epoch
    assert_same_model(params(runs / "two_cut"), params(runs / "shard_two_cut"))
    reference = params(runs / "one")
    assert_same_model(reference, params(runs / "shard_two_then_one"))  # 2 ranks -> 1
    assert_same_model(reference, params(runs / "shard_one_then_two"))  # 1 rank -> 2
    # a finished sharded run also leaves consolidated best.pt / last.pt for serving
    full = load_checkpoint(runs / "shard_two_then_one" / "last.pt")
    assert full["consolidated_from"] == "last.dcp"
    assert_same_model(reference, full["model"])


def test_resume_refuses_the_other_kind_of_checkpoint(runs, tmp_path):
    arrays = water_arrays(N_SAMPLES)
    shutil.copytree(runs / "shard_two_cut", tmp_path / "sharded")
    with pytest.raises(CheckpointError, match="trained with --shard"):
        train(ChemApp(), CHEM, TrainConfig(**BASE), arrays, tmp_path / "sharded", resume=True, progress=False)
    shutil.copytree(runs / "two_cut", tmp_path / "replicated")
    with pytest.raises(CheckpointError, match="without --shard"):
        train(ChemApp(), CHEM, TrainConfig(**BASE, shard=True), arrays, tmp_path / "replicated", resume=True,
              progress=False)
    with pytest.raises(CheckpointError, match="--batch-size 8, not 16"):
        train(ChemApp(), CHEM, TrainConfig(**{**BASE, "batch_size": 16}), arrays, tmp_path / "replicated",
              resume=True, progress=False)


def test_gw_cnn_trains_under_ddp_and_fsdp_in_bf16(tmp_path):
    """The gw app's path: BatchNorm, bf16 autocast, inference-mode validation, on 2 ranks with and without --shard."""
    from converge.apps.gw.app import GWApp
    from converge.apps.gw.config import GWConfig
    from converge.apps.gw.waveforms import sample_bbh_parameters, whitened_signal

    cfg = GWConfig(channels=(4, 4, 8), hidden=8)
    rng = np.random.default_rng(3)
    np.savez(tmp_path / "gw.npz", signal=np.stack([whitened_signal(cfg, sample_bbh_parameters(cfg, rng))
                                                   for _ in range(24)]))
    train_cfg = {"epochs": 2, "batch_size": 8, "precision": "bf16", "patience": 10}
    jobs = [{"run_dir": str(tmp_path / "ddp"), "train": {**train_cfg, "grad_accum_steps": 2}},
            {"run_dir": str(tmp_path / "fsdp"), "train": {**train_cfg, "shard": True}}]
    torchrun(tmp_path, jobs, tmp_path / "gw.npz", app="gw", app_cfg=cfg)
    for name in ("ddp", "fsdp"):
        history = json.loads((tmp_path / name / "history.json").read_text())
        assert [h["epoch"] for h in history] == [0, 1] and all(np.isfinite(h["val_loss"]) for h in history)
        model, _ = load_model(GWApp(), tmp_path / name)
        with torch.inference_mode():
            assert model(torch.randn(3, cfg.window_samples)).shape == (3,)


# -- the step plan: each rank's share, and the union over ranks ----------------------------------


@pytest.mark.parametrize("n,batch,world,accum", [(25, 8, 2, 1), (25, 8, 2, 2), (31, 12, 3, 2), (7, 4, 4, 1),
                                                 (100, 64, 1, 4), (9, 6, 3, 1)])
def test_step_plan_keeps_the_one_process_steps(n, batch, world, accum):
    plan = plan_steps(n, batch, world, accum)
    assert plan.optimizer_steps == -(-n // batch)  # the schedule does not depend on the world size
    sizes = [plan.batch_sizes(r) for r in range(world)]
    assert sum(map(sum, sizes)) == n
    weights = [plan.loss_weights(r) for r in range(world)]
    for step in range(plan.optimizer_steps):
        group = range(step * accum, min((step + 1) * accum, plan.micro_steps))
        # DDP's mean over ranks of the weighted micro-batch means is the mean over the step's samples
        assert sum(weights[r][k] / world for r in range(world) for k in group) == pytest.approx(1.0)
        assert sum(sizes[r][k] for r in range(world) for k in group) == min(batch, n - step * batch)


def test_rank_batches_together_are_the_one_process_batches():
    source = ArraySource({"index": torch.arange(25)}, seed=3)
    one = [b["index"] for b in source.batches(1, 8)]
    plan = plan_steps(25, 8, 2, 1)
    per_rank = [list(rank_batches(source, 1, plan, Ranks(r, 2))) for r in range(2)]
    for k, whole in enumerate(one):
        parts = [b["index"] for r in range(2) for b, w in [per_rank[r][k]] if w > 0]
        assert sorted(torch.cat(parts).tolist()) == sorted(whole.tolist())
    assert per_rank[1][-1][1] == 0  # rank 1's share ended: it repeats a batch at weight 0


def test_gw_windows_of_all_ranks_are_the_one_process_epoch():
    from converge.apps.gw.config import GWConfig

    cfg = GWConfig()
    source = WindowSource(cfg, torch.randn(6, cfg.stored_samples), seed=1)  # 6 signals -> 12 windows
    plan = plan_steps(len(source), 4, 2, 1)
    labels_one = torch.cat([b["label"] for b in source.batches(2, 4)])
    labels = torch.cat([b["label"] for r in range(2) for b, w in rank_batches(source, 2, plan, Ranks(r, 2)) if w])
    assert len(labels) == len(source) and labels.sum() == labels_one.sum() == 6


def test_a_source_that_ignores_its_rank_is_caught():
    class Everything(ArraySource):
        def batches(self, epoch, batch_size, rank=0, world=1):
            return super().batches(epoch, batch_size)

    plan = plan_steps(10, 4, 2, 1)
    with pytest.raises(RuntimeError, match="breaks the BatchSource contract"):
        list(rank_batches(Everything({"x": torch.zeros(10)}, seed=0), 0, plan, Ranks(0, 2)))


# -- config errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,match", [
    ({"grad_accum_steps": 0}, "train.grad_accum_steps=0: must be >= 1"),
    ({"bucket_cap_mb": 0}, "train.bucket_cap_mb=0: must be > 0 MB"),
    ({"bucket_cap_mb": -5.0}, "train.bucket_cap_mb=-5.0"),
    ({"batch_size": 10, "grad_accum_steps": 4}, "not divisible by train.grad_accum_steps=4"),
    ({"shard": True, "precision": "fp16"}, "use bf16 or fp32"),
])
def test_config_errors_name_the_key_and_the_fix(kw, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**kw)


def test_plan_errors_name_the_fix():
    with pytest.raises(ConfigError, match=r"train.batch_size=64 is not divisible by 3 rank\(s\).*e.g. 63 or 66"):
        plan_steps(100, 64, 3, 1)
    with pytest.raises(ConfigError, match="2 training samples cannot be shared by 4 ranks"):
        plan_steps(2, 4, 4, 1)
    assert plan_steps(100, 64, 4, 2) == StepPlan(100, 4, 2, 8)


# -- the command line: --nproc through torchrun, and a SIGKILL mid-run -------------------------------


def write_dataset(root: Path, arrays: dict[str, np.ndarray]) -> None:
    app, n = ChemApp(), len(arrays["energy"])
    header = dataset_header(app, CHEM, SimulateConfig(samples=n, shard_size=n, seed=0), app.schema(CHEM))
    store = ShardStore.create_or_open(root, header)
    store.write_shard(0, arrays, {"conformer_seed": np.arange(n, dtype=np.float64)}, np.arange(n), [])


def children(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


@pytest.mark.parametrize("shard,n_samples", [(False, 300), (True, 150)], ids=["ddp", "fsdp"])
def test_sigkill_mid_run_then_resume_matches_an_uninterrupted_run(tmp_path, shard, n_samples):
    EPOCHS = 10  # long enough that a loaded machine's slow polling still sees the run before its end
    """Kill the torchrun launcher of `converge train --nproc 2` after its first checkpoint: the ranks exit,
    every checkpoint seen meanwhile loads, and --resume ends where an uninterrupted run does."""
    import psutil

    arrays = water_arrays(n_samples, seed=1)  # FSDP steps are slower on the CPU: fewer suffice to kill mid-run
    write_dataset(tmp_path / "data", arrays)
    run = tmp_path / "run"
    args = [sys.executable, "-m", "converge", "train", "chem", "--data", tmp_path / "data", "--out", run,
            "--epochs", EPOCHS, "--batch-size", 8, "--precision", "fp32", "--nproc", 2, "--set", "train.val_fraction=0.2",
            "--set", "train.patience=10", *(["--shard"] if shard else [])]
    last = run / "last.dcp" if shard else run / "last.pt"

    def last_epoch() -> int:  # fails unless the whole checkpoint is there
        if shard:
            found = sharded_path(last)
            return load_checkpoint(found / "meta.pt")["epoch"] if found is not None else -1
        return load_checkpoint(last)["epoch"] if last.exists() else -1

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(list(map(str, args)), env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen, deadline = set(), time.monotonic() + 300
    try:
        while last_epoch() < 0:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.02)
        ranks = children(proc.pid)
        assert len(ranks) == 2  # `converge ... --nproc 2` became the torchrun launcher (same pid) of two ranks
        t_kill = time.monotonic() + 0.3
        while time.monotonic() < t_kill:  # read the checkpoint while rank 0 may be replacing it
            seen.add(last_epoch())
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only: the ranks live in sessions of their own
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs([psutil.Process(p) for p in ranks if psutil.pid_exists(p)], timeout=30)
        assert not alive, "ranks outlived their launcher"
    finally:
        for pid in [proc.pid, *(children(proc.pid) if proc.poll() is None else [])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    killed_at = last_epoch()
    assert 0 <= killed_at < EPOCHS - 1, "the run finished before the kill: make it longer"
    assert -1 not in seen and max(seen) <= killed_at
    resumed = subprocess.run(list(map(str, [*args, "--resume"])), env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["epoch"] for x in lines] == list(range(EPOCHS))
    full_cfg = TrainConfig(**{**ChemApp.train_defaults, **BASE, "epochs": EPOCHS})  # what the CLI ran
    full = train(ChemApp(), CHEM, full_cfg, arrays, tmp_path / "full", progress=False)
    for key in ("val_loss", "energy_mae_kcal_mol"):
        assert lines[-1][key] == pytest.approx(full.history[-1][key], rel=1e-4), key
    assert_same_model(params(tmp_path / "full"), params(run))


def test_nproc_errors_are_caught_before_launching(tmp_path):
    write_dataset(tmp_path / "data", water_arrays(8))
    args = [sys.executable, "-m", "converge", "train", "chem", "--data", str(tmp_path / "data"), "--out",
            str(tmp_path / "run"), "--nproc", "2"]
    under_torchrun = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    proc = subprocess.run(args, env=under_torchrun, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "under torchrun leave --nproc out" in " ".join(proc.stderr.split())
    proc = subprocess.run([*args, "--batch-size", "9"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "use a multiple of 2, e.g. 8 or 10" in " ".join(proc.stderr.split())


def test_torchrun_command_drops_nproc():
    from converge.cli import torchrun_command

    cmd = torchrun_command(["train", "gw", "--nproc", "4", "--data", "d", "--nproc=4", "--resume"], 4)
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "converge",
                       "train", "gw", "--data", "d", "--resume"]
