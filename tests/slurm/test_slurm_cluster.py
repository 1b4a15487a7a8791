"""converge against a real Slurm scheduler: the single-node cluster of conftest.py.

Every dataset made through Slurm must be the local pool's, byte for byte (manifest
with its shard hashes, and the shard files): uninterrupted, after a scancel of the
whole ensemble and a rerun, and after a scancel of its worker job alone. The DDP
check runs the sbatch script of docs/cluster.md itself. The checks are those of
benchmarks/slurm_check.py.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks.slurm_check import (Ensemble, LocalSlurm, SlurmUnavailable, check_ddp, check_ensemble,
                                    check_scancel_of_everything, check_scancel_of_the_worker, doc_sbatch_script,
                                    same_dataset, simulate_on_local_pool)

ENSEMBLE = Ensemble()


@pytest.fixture(scope="module")
def local_pool_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("local") / "data"
    simulate_on_local_pool(ENSEMBLE, out)
    return out


def test_same_dataset_tells_a_changed_byte_or_manifest_apart(local_pool_dataset: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(local_pool_dataset, copy)
    assert same_dataset(copy, local_pool_dataset)
    shard = next((copy / "shards").iterdir())
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    assert not same_dataset(copy, local_pool_dataset)
    shutil.copyfile(local_pool_dataset / "shards" / shard.name, shard)
    manifest = (copy / "manifest.json").read_text()
    assert f'"seed": {ENSEMBLE.seed}' in manifest
    (copy / "manifest.json").write_text(manifest.replace(f'"seed": {ENSEMBLE.seed}', f'"seed": {ENSEMBLE.seed + 1}'))
    assert not same_dataset(copy, local_pool_dataset)
    assert not same_dataset(tmp_path / "nothing", tmp_path / "nothing")  # no dataset is not the same dataset


@pytest.mark.slurm
def test_dask_jobqueue_on_slurm_gives_the_local_pools_dataset(idle_slurm: LocalSlurm, local_pool_dataset: Path,
                                                              tmp_path: Path) -> None:
    done = check_ensemble(idle_slurm, tmp_path, ENSEMBLE, local_pool_dataset)
    assert len(done["worker_jobs"]) == 1  # the samples did run in a Slurm job
    assert done["ensemble_hashes_equal_local"]


@pytest.mark.slurm
def test_an_ensemble_scancelled_midway_resumes_on_rerun_to_the_same_dataset(
        idle_slurm: LocalSlurm, local_pool_dataset: Path, tmp_path: Path) -> None:
    if idle_slurm.cpus() < 2:
        pytest.skip("the batch job of converge simulate and its worker job need 2 CPUs on the node")
    done = check_scancel_of_everything(idle_slurm, tmp_path, ENSEMBLE, local_pool_dataset)
    assert len(done["cancelled_jobs"]) == 2  # converge simulate's job and its worker job
    assert 0 < done["shards_at_cancel"] < ENSEMBLE.n_shards
    assert done["rerun_state"] == ["COMPLETED", "0:0"]
    kept = done["shards_at_cancel"]
    assert done["rerun_said"] == f"{ENSEMBLE.n_shards - kept} shards computed, {kept} already complete"
    assert done["resumed_after_scancel"]


@pytest.mark.slurm
@pytest.mark.slow  # 35 s: the lost job is replaced after distributed.deploy.lost-worker-timeout (15 s)
def test_a_worker_job_scancelled_midway_is_replaced_and_the_dataset_unchanged(
        idle_slurm: LocalSlurm, local_pool_dataset: Path, tmp_path: Path) -> None:
    done = check_scancel_of_the_worker(idle_slurm, tmp_path, ENSEMBLE, local_pool_dataset)
    assert 0 < done["shards_at_cancel"] < ENSEMBLE.n_shards
    assert done["worker_jobs"][0] == done["cancelled_jobs"][0] and len(done["worker_jobs"]) == 2
    assert done["worker_job_replaced_after_scancel"]


@pytest.mark.slurm
def test_the_docs_sbatch_script_trains_with_two_ddp_ranks(idle_slurm: LocalSlurm, tmp_path: Path) -> None:
    done = check_ddp(idle_slurm, tmp_path)
    assert done["state"] == ["COMPLETED", "0:0"], (tmp_path / f"train-{done['job']}.out").read_text()
    assert done["epochs_written"] == 2
    assert done["ddp_sbatch_completed"]


def test_the_docs_hold_one_sbatch_training_script(tmp_path: Path) -> None:
    script = doc_sbatch_script()
    assert script.startswith("#!/bin/bash\n#SBATCH") and "torchrun" in script and "-m converge train" in script
    twice = tmp_path / "cluster.md"
    twice.write_text(f"```bash\n{script}```\n\n```bash\n{script}```\n")
    with pytest.raises(ValueError, match="2 bash blocks with #SBATCH lines"):
        doc_sbatch_script(twice)


@pytest.mark.parametrize("uid, reason", [("1000", "not root: cannot apt-get install slurm-wlm munge"),
                                         ("0", "no apt-get to install slurm-wlm munge")])
def test_the_cluster_says_why_slurm_cannot_be_installed(uid: str, reason: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"  # a PATH with no Slurm, no munge and no apt-get
    bin_dir.mkdir()
    for tool in ("bash", "hostname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "id").write_text(f"#!{shutil.which('bash')}\necho {uid}\n")
    (bin_dir / "id").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    cluster = LocalSlurm(tmp_path / "state")
    assert not cluster.answers()
    with pytest.raises(SlurmUnavailable, match=f"^{reason} \\(missing: munged slurmctld slurmd sinfo sbatch\\)$"):
        cluster.start()
