"""auto precision: the app's measured default where the device has bf16 units, fp32 where bf16 is emulated."""
import platform

import pytest
import torch

from converge.train import precision as prec
from converge.train.precision import cpu_flags, inference_precision, native_bf16, resolve_precision, run_precision

CPU = torch.device("cpu")
AVX2 = frozenset({"fma", "avx2"})
ZEN4 = frozenset({"fma", "avx2", "avx512f", "avx512_bf16"})
SAPPHIRE_RAPIDS = frozenset({"avx512f", "amx_tile", "amx_bf16"})


def test_cpu_flags_read_x86_flags_and_arm_features(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\nCPU implementer\t: 0x41\n")
    assert cpu_flags.__wrapped__(str(x86)) == {"fpu", "avx2", "avx512_bf16"}
    assert "bf16" in cpu_flags.__wrapped__(str(arm))
    assert cpu_flags.__wrapped__(str(tmp_path / "missing")) == frozenset()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
def test_bf16_is_native_only_with_avx512_bf16_or_amx():
    assert not native_bf16(CPU, AVX2)
    assert native_bf16(CPU, ZEN4) and native_bf16(CPU, SAPPHIRE_RAPIDS)


def test_arm_needs_the_bf16_feature(monkeypatch):
    monkeypatch.setattr(prec.platform, "machine", lambda: "aarch64")
    assert native_bf16(CPU, frozenset({"fp", "asimd", "bf16"}))
    assert not native_bf16(CPU, frozenset({"fp", "asimd"}))


def test_auto_keeps_the_app_default_where_bf16_is_native_and_falls_back_to_fp32_elsewhere(monkeypatch):
    monkeypatch.setattr(prec.platform, "machine", lambda: "x86_64")
    assert resolve_precision("auto", "bf16", CPU, ZEN4) == "bf16"
    assert resolve_precision("auto", "bf16", CPU, AVX2) == "fp32"
    assert resolve_precision("auto", "fp32", CPU, ZEN4) == "fp32"  # chem: fp32 everywhere
    assert resolve_precision("bf16", "fp32", CPU, AVX2) == "bf16"  # asked for: honoured
    assert resolve_precision("fp16", "bf16", CPU, AVX2) == "fp16"


def test_a_bf16_run_is_run_in_fp32_where_bf16_is_emulated(monkeypatch):
    monkeypatch.setattr(prec.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(prec, "cpu_flags", lambda: AVX2)
    assert inference_precision("bf16", CPU) == "fp32" and inference_precision("fp16", CPU) == "fp16"
    assert run_precision({"train": {"precision": "bf16"}}, "bf16", CPU) == "fp32"
    assert run_precision({}, "bf16", CPU) == "fp32"
    monkeypatch.setattr(prec, "cpu_flags", lambda: ZEN4)
    assert run_precision({"train": {"precision": "bf16"}}, "fp32", CPU) == "bf16"
    assert run_precision({"train": {"precision": "auto"}}, "bf16", CPU) == "bf16"
    assert run_precision({"train": {"precision": "fp32"}}, "bf16", CPU) == "fp32"
