"""converge bench ddp: efficiencies against hand-computed values, the ring model's formula, the replica check
(shown to catch ranks that diverged), config errors, and a small 1- and 2-rank Gloo run end to end."""
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from converge.bench.ddp import (
    DDPBenchConfig, add_efficiencies, main, model_predictions, parse_counts, replicas_spread, run_ddp_benchmark,
    write_results,
)
from converge.bench.report_tables import ddp_tables
from converge.bench.scaling_model import Cluster, cluster_allreduce_seconds, efficiency, ring_allreduce_seconds
from converge.bench.server_process import free_port


def test_efficiencies_against_hand_computed_values():
    rows = add_efficiencies([
        {"model": "a", "processes": 1, "samples_per_s": 100.0, "ceiling_samples_per_s": None},
        {"model": "a", "processes": 2, "samples_per_s": 150.0, "ceiling_samples_per_s": 180.0},
        {"model": "b", "processes": 1, "samples_per_s": 10.0, "ceiling_samples_per_s": None},
        {"model": "b", "processes": 4, "samples_per_s": 36.0, "ceiling_samples_per_s": 36.0},
    ])
    assert [r["efficiency"] for r in rows] == pytest.approx([1.0, 0.75, 1.0, 0.9])  # 150 / 200, 36 / 40
    assert [r["efficiency_vs_ceiling"] for r in rows] == [None, pytest.approx(150 / 180), None, 1.0]


def test_ring_model_against_hand_computed_values():
    # 1 GB over 4 ranks at 100 GB/s, 10 us per step: 2 x 3/4 x 10 ms + 6 x 10 us = 15.06 ms
    assert ring_allreduce_seconds(4, 1e9, 100e9, 10e-6) == pytest.approx(15.06e-3)
    c = Cluster(gpus_per_node=8, nvlink_bytes_per_s=400e9, nvlink_alpha_s=0.0, ib_bytes_per_s=50e9, ib_alpha_s=0.0)
    assert cluster_allreduce_seconds(8, 8e9, c) == pytest.approx(2 * 7 / 8 * 8e9 / 400e9)  # one node: its ring
    # 16 GPUs: the intra-node halves (7/8 x 8 GB / 400 GB/s x 2) plus 2 nodes all-reducing 1 GB over IB
    assert cluster_allreduce_seconds(16, 8e9, c) == pytest.approx(0.035 + 2 * 1 / 2 * 1e9 / 50e9)
    assert efficiency(3.0, 1.0, overlap=False) == pytest.approx(0.75)
    assert efficiency(3.0, 1.0, overlap=True) == 1.0  # 1 s hides behind the 2 s backward
    assert efficiency(3.0, 4.0, overlap=True) == pytest.approx(3.0 / 5.0)  # 1 s forward + 4 s all-reduce


def test_predictions_label_an_assumed_gpu_step():
    rows = [{"model": "mlp", "processes": 1, "step_ms": 200.0, "grad_bytes": 4_000_000, "per_rank_batch": 8}]
    cpu = model_predictions(rows, "cpu")
    assert "ASSUMED" in cpu["assumptions"]["gpu_step"] and cpu["models"]["mlp"]["gpu_step_ms"] == pytest.approx(4.0)
    assert set(cpu["models"]["mlp"]["predictions"]) == {"8", "64", "512"}
    gpu = model_predictions(rows, "cuda")
    assert "measured" in gpu["assumptions"]["gpu_step"] and gpu["models"]["mlp"]["gpu_step_ms"] == 200.0


def _spread_rank(rank: int, world: int, port: int, diverge: bool, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    if diverge and rank == 1:
        with torch.no_grad():
            layer.bias[2] += 0.5
    spread = replicas_spread(layer)
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(spread))
    dist.destroy_process_group()


@pytest.mark.parametrize("diverge, expected", [(False, 0.0), (True, 0.5)])
def test_replica_check_catches_ranks_that_diverged(tmp_path, diverge, expected):
    out = tmp_path / "spread.txt"
    mp.start_processes(_spread_rank, args=(2, free_port(), diverge, str(out)), nprocs=2, start_method="spawn")
    assert float(out.read_text()) == pytest.approx(expected)


def test_config_errors_say_how_to_fix_them(capsys):
    with pytest.raises(ValueError, match="including 1"):
        DDPBenchConfig(processes=(2, 4))
    with pytest.raises(ValueError, match=r"choose from chem, .*gw, mlp"):
        DDPBenchConfig(models=("resnet",))
    with pytest.raises(ValueError, match="GradScaler"):
        DDPBenchConfig(precision="fp16")
    with pytest.raises(ValueError, match="e.g. 1,2,4"):
        parse_counts("one,two")
    assert main(["--processes", "2,4"]) == 2
    assert "including 1" in capsys.readouterr().err


def test_one_and_two_gloo_ranks_train_in_sync_and_report_well_formed_results(tmp_path):
    r = run_ddp_benchmark(DDPBenchConfig.quick())
    assert r["backend"] == "gloo" and r["launcher"] == "torch.multiprocessing.spawn"
    assert [(row["model"], row["processes"]) for row in r["rows"]] == [("mlp", 1), ("mlp", 2)]
    one, two = r["rows"]
    assert one["params"] == two["params"] == 512 * 1024 + 1024 + 1024 * 512 + 512 + 512 + 1
    assert one["grad_bytes"] == 4 * one["params"] and one["precision"] == "fp32"
    assert one["efficiency"] == 1.0 and one["efficiency_vs_ceiling"] is None
    assert two["samples_per_s"] == pytest.approx(2 * 32 / (two["step_ms"] / 1e3))
    assert 0 < two["efficiency"] and 0 < two["efficiency_vs_ceiling"] and two["ceiling_samples_per_s"] > 0
    assert two["in_sync"] and two["replicas_max_difference"] == 0.0 and r["all_in_sync"]
    assert set(r["summary"]["mlp"]["samples_per_s"]) == {"1", "2"}
    assert set(r["scaling_model"]["models"]["mlp"]["predictions"]) == {"8", "64", "512"}
    measured, modelled = ddp_tables(r)  # the report's view of it
    assert [row[2] for row in measured.rows] == [1, 2] and measured.rows[1][-1] == "yes"
    assert modelled.header[-3:] == ["8 GPUs", "64 GPUs", "512 GPUs"] and "ASSUMED" in modelled.caption
    json_path, png_path = write_results(r, tmp_path)
    assert json.loads(json_path.read_text())["all_in_sync"] is True
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
