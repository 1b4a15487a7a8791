"""Peak FLOP rates from CPU features (flags, cores, clock) and GPU datasheets; /proc/cpuinfo parsing; the clock."""
import pytest

from converge.bench.machine import Clock, CpuInfo, cpu_clock, machine_line, parse_cpuinfo
from converge.bench.peaks import cpu_flops_per_cycle, cpu_peaks, gpu_peaks, peak_tflops

SPR_FLAGS = "fpu sse2 avx avx2 fma avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8"
CPUINFO = f"""processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
cpu MHz\t\t: 2000.000
flags\t\t: {SPR_FLAGS}

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
cpu MHz\t\t: 2000.000
flags\t\t: {SPR_FLAGS}
"""


def cpu(flags: str, vendor: str = "GenuineIntel", family: int = 6, model: int = 143) -> CpuInfo:
    return CpuInfo("test cpu", vendor, family, model, frozenset(flags.split()), 2000.0, 2)


def test_cpuinfo_is_parsed_from_the_first_processor_block():
    info = parse_cpuinfo(CPUINFO)
    assert info.model_name == "Intel(R) Xeon(R) Platinum 8480+" and info.vendor == "GenuineIntel"
    assert (info.family, info.model, info.mhz, info.logical_cpus) == (6, 143, 2000.0, 2)
    assert {"amx_bf16", "avx512f", "avx512_fp16"} <= info.flags
    assert info.as_dict()["flags"] == sorted(["fma", "avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile",
                                              "amx_bf16", "amx_int8"])


def test_sapphire_rapids_peaks_from_flags_cores_and_clock():
    rates = cpu_flops_per_cycle(parse_cpuinfo(CPUINFO))
    assert {p: r.flops_per_cycle for p, r in rates.items()} == {"fp64": 32, "fp32": 64, "bf16": 1024, "fp16": 128}
    assert "AMX" in rates["bf16"].unit
    peaks = cpu_peaks(parse_cpuinfo(CPUINFO), cores=2, clock=Clock(2.0, "test"))
    # 64 FLOP/cycle x 2 cores x 2.0 GHz = 256 GFLOP/s; AMX 1024 x 2 x 2.0 = 4096 GFLOP/s
    assert peaks["fp32"]["tflops"] == pytest.approx(0.256)
    assert peaks["bf16"]["tflops"] == pytest.approx(4.096)
    assert peaks["fp64"]["tflops"] == pytest.approx(0.128)
    assert peaks["fp32"]["cores"] == 2 and peaks["fp32"]["clock_source"] == "test"


@pytest.mark.parametrize("flags, vendor, family, model, expected", [
    ("avx2 fma avx512f avx512_bf16", "AuthenticAMD", 0x19, 0x11, {"fp64": 16, "fp32": 32, "bf16": 64, "fp16": 32}),
    ("avx2 fma avx512f avx512_bf16", "AuthenticAMD", 0x1A, 0x02, {"fp64": 32, "fp32": 64, "bf16": 128, "fp16": 64}),
    ("avx2 fma avx512f avx512_bf16", "GenuineIntel", 6, 85, {"fp64": 32, "fp32": 64, "bf16": 128, "fp16": 64}),
    ("avx2 fma", "GenuineIntel", 6, 63, {"fp64": 16, "fp32": 32, "bf16": 32, "fp16": 32}),
    ("avx2 fma", "AuthenticAMD", 0x17, 0x01, {"fp64": 8, "fp32": 16, "bf16": 16, "fp16": 16}),
    ("avx", "GenuineIntel", 6, 42, {"fp64": 8, "fp32": 16, "bf16": 16, "fp16": 16}),
    ("sse2", "GenuineIntel", 6, 15, {"fp64": 4, "fp32": 8, "bf16": 8, "fp16": 8}),
])
def test_flops_per_cycle_by_vector_unit(flags, vendor, family, model, expected):
    rates = cpu_flops_per_cycle(cpu(flags, vendor, family, model))
    assert {p: r.flops_per_cycle for p, r in rates.items()} == expected


def test_peak_formula_and_a_missing_clock():
    assert peak_tflops(32, 4, 2.5) == pytest.approx(0.32)  # 32 x 4 x 2.5 GHz = 320 GFLOP/s
    peaks = cpu_peaks(cpu("avx2 fma"), cores=1, clock=None)
    assert peaks["fp32"]["tflops"] is None and peaks["fp32"]["flops_per_cycle_per_core"] == 32


def test_gpu_datasheet_matching():
    assert gpu_peaks("NVIDIA H200")["bf16"]["tflops"] == 989.5
    assert gpu_peaks("NVIDIA H100 80GB HBM3")["tf32"]["tflops"] == 494.5
    assert gpu_peaks("NVIDIA H100 PCIe")["fp16"]["tflops"] == 756
    assert gpu_peaks("NVIDIA H200 NVL")["fp64"]["tflops"] == 60
    a100 = gpu_peaks("NVIDIA A100-SXM4-80GB")
    assert {p: v["tflops"] for p, v in a100.items()} == {"fp64": 19.5, "fp32": 19.5, "tf32": 156, "bf16": 312,
                                                           "fp16": 312}
    assert gpu_peaks("NVIDIA GeForce GTX 1080") is None


def test_clock_prefers_cpufreq_max_and_says_where_it_came_from(tmp_path):
    info = parse_cpuinfo(CPUINFO)
    assert cpu_clock(info, tmp_path / "absent") == Clock(2.0, cpu_clock(info, tmp_path / "absent").source)
    assert "cpu MHz" in cpu_clock(info, tmp_path / "absent").source
    (tmp_path / "cpuinfo_max_freq").write_text("3800000\n")  # kHz
    clock = cpu_clock(info, tmp_path)
    assert clock.ghz == pytest.approx(3.8) and "cpuinfo_max_freq" in clock.source
    assert cpu_clock(parse_cpuinfo(""), tmp_path / "absent") is None


def test_machine_line_reads_new_and_old_records():
    old = {"cpu": "x86_64", "python": "3.11.7", "torch": "2.13.0+cpu"}
    assert machine_line(old) == "x86_64; torch 2.13.0+cpu"
    assert machine_line(None) == "machine not recorded"
    new = {"cpu": {"model_name": "AMD EPYC"}, "logical_cpus": 2, "torch_threads": 1, "date": "2026-01-01",
           "gpus": [{"name": "NVIDIA H200", "driver": "580"}], "versions": {"torch": "2.13"}}
    assert machine_line(new) == "AMD EPYC; 2 CPUs, 1 torch threads; NVIDIA H200 (driver 580); torch 2.13; 2026-01-01"
