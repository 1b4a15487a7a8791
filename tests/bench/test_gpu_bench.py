"""The platform benchmarks on CUDA, small: GEMM with TF32 against the datasheet, NCCL on one rank, the surrogate
timings on the GPU. benchmarks/gpu_check.sh runs the full configurations."""
import pytest
import torch

from converge.bench.collectives import CollectivesConfig, run_collectives_benchmark
from converge.bench.ddp import DDPBenchConfig, run_ddp_benchmark
from converge.bench.gemm import GemmConfig, run_gemm_benchmark

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_gemm_on_cuda_measures_every_precision_tf32_included():
    r = run_gemm_benchmark(GemmConfig(sizes=(256, 512), device="cuda", target_s=0.02, warmup=3))
    assert r["device"] == "cuda" and r["device_name"] == torch.cuda.get_device_name()
    measured = {(row["precision"], row["size"]) for row in r["rows"] if "tflops" in row}
    assert measured == {(p, s) for p in ("fp64", "fp32", "tf32", "bf16", "fp16") for s in (256, 512)}
    if r["peaks"] is not None:  # a GPU of the datasheet table
        assert all(0 < row["fraction_of_peak"] < 1.2 for row in r["rows"])


def test_nccl_on_one_rank_is_correct():
    r = run_collectives_benchmark(CollectivesConfig(world=1, device="cuda", max_bytes=2**20, factor=64,
                                                    target_s=0.005, min_repeats=1))
    assert r["backend"] == "nccl" and r["all_correct"]
    assert all(row["algbw_GBps"] > 0 for row in r["rows"])
    assert all(row["busbw_GBps"] == 0 for row in r["rows"] if row["op"] != "broadcast")  # factor (n - 1) / n
    assert any("one rank" in n for n in r["notes"])


def test_ddp_on_one_gpu_trains_the_reference_mlp_in_bf16():
    r = run_ddp_benchmark(DDPBenchConfig(models=("mlp",), processes=(1,), device="cuda", precision="bf16",
                                         warmup=2, steps=5))
    assert r["backend"] == "nccl" and r["rows"][0]["samples_per_s"] > 0 and r["rows"][0]["precision"] == "bf16"
    assert "measured" in r["scaling_model"]["assumptions"]["gpu_step"]
