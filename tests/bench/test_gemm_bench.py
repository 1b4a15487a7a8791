"""The GEMM benchmark: a small run is well formed, the budget skips what it cannot afford, the helpers' arithmetic."""
import json
import math

import pytest
import torch

from converge.bench.gemm import (
    GemmConfig, extrapolate_seconds, gemm_flops, gemm_tflops, parse_sizes, repeats_for, run_gemm_benchmark,
    write_results,
)


@pytest.fixture(scope="module")
def small_run():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_gemm_benchmark(GemmConfig.quick())
    finally:
        torch.set_num_threads(threads)


def test_small_run_is_well_formed(small_run, tmp_path):
    r = small_run
    assert r["device"] == "cpu" and r["threads"] == 1 and r["peaks"] is not None
    assert set(r["peaks"]) == {"fp64", "fp32", "bf16", "fp16"}
    measured = [row for row in r["rows"] if "tflops" in row]
    assert {(row["precision"], row["size"]) for row in measured} == {
        (p, s) for p in ("fp64", "fp32", "bf16", "fp16") for s in (64, 128)}
    for row in measured:
        assert row["seconds"] > 0 and row["repeats"] >= 1 and row["tflops"] > 0 and row["peak_tflops"] > 0
        assert row["tflops"] == pytest.approx(gemm_flops(row["size"], row["size"], row["size"]) / row["seconds"] / 1e12)
        assert row["fraction_of_peak"] == pytest.approx(row["tflops"] / row["peak_tflops"])
        fp32 = next(x for x in measured if x["precision"] == "fp32" and x["size"] == row["size"])
        assert row["relative_to_fp32"] == pytest.approx(row["tflops"] / fp32["tflops"])
    assert [row["skipped"] for row in r["rows"] if row["precision"] == "tf32"] == ["TF32 is a CUDA tensor-core mode"] * 2
    assert r["summary"]["fp32"]["relative_to_fp32"] == 1.0 and r["summary"]["bf16"]["best_tflops"] > 0
    json_path, png_path = write_results(r, tmp_path)
    assert json.loads(json_path.read_text())["rows"] == json.loads(json.dumps(r["rows"]))
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_budget_too_small_skips_every_point_and_says_why():
    r = run_gemm_benchmark(GemmConfig(sizes=(64, 128), precisions=("fp32", "bf16"), budget_s=1e-6))
    assert all("tflops" not in row for row in r["rows"])
    first = [row["skipped"] for row in r["rows"] if row["size"] == 64]
    assert all("exceeds" in s and "budget" in s for s in first)
    later = [row["skipped"] for row in r["rows"] if row["size"] == 128]
    assert later == ["a smaller size was already skipped for time"] * 2
    assert r["summary"] == {}


def test_a_point_longer_than_max_point_s_is_skipped_with_its_larger_sizes():
    r = run_gemm_benchmark(GemmConfig(sizes=(16, 2048, 4096), precisions=("fp32",), target_s=0.01, max_point_s=0.05))
    rows = {row["size"]: row for row in r["rows"]}
    assert rows[16]["tflops"] > 0  # ~0.01 s of ~1 us products
    assert rows[2048]["skipped"].endswith("exceeds the 0.05 s allowed one point")  # one product takes ~0.2 s
    assert rows[4096]["skipped"] == "a smaller size was already skipped for time"


def test_cost_model_helpers():
    assert gemm_flops(2, 3, 4) == 48
    assert gemm_tflops(1000, 2.0) == pytest.approx(1e-3)  # 2e9 FLOP in 2 s
    assert extrapolate_seconds(512, 0.1, 1024) == pytest.approx(0.8)  # the work grows as n^3
    assert repeats_for(0.01, 0.5, 10_000) == 50
    assert repeats_for(3.0, 0.5, 10_000) == 1
    assert repeats_for(1e-9, 0.5, 100) == 100
    assert repeats_for(0.3, 1.0, 100) == math.ceil(1 / 0.3)


def test_config_errors_say_how_to_fix_them():
    with pytest.raises(ValueError, match="choose from fp64, fp32, tf32, bf16, fp16"):
        GemmConfig(precisions=("fp8",))
    with pytest.raises(ValueError, match="give one or more matrix sizes >= 1"):
        GemmConfig(sizes=(0,))
    with pytest.raises(ValueError, match="give cpu, cuda or cuda:N"):
        GemmConfig(device="tpu")
    with pytest.raises(ValueError, match="give comma-separated whole numbers"):
        parse_sizes("512,big")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
        run_gemm_benchmark(GemmConfig(device="cuda"))
