"""`compute_dtype: auto`: the rule over the device and the CPU's flags (trainer/precision.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockgate.trainer.config import ComputeDtype
from lockgate.trainer.precision import (
    CpuInfo,
    choose_compute_dtype,
    parse_cpuinfo,
    read_cpu_info,
)

AVX2 = CpuInfo("AMD EPYC 7B13", frozenset({"sse4_2", "avx", "avx2", "fma"}))
AVX512_BF16 = CpuInfo("AMD EPYC", frozenset({"avx2", "avx512f", "avx512_bf16"}))
AMX = CpuInfo(
    "Intel Xeon Platinum 8480+",
    frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}),
)


def _auto(cpu: CpuInfo, *, device: str = "cpu", packed: bool = True, rl: bool = False) -> str:
    choice = choose_compute_dtype(
        "auto", device=device, cpu=cpu, packed=packed, float32_rollouts=rl
    )
    return choice.dtype


def test_avx2_only_computes_in_float32() -> None:
    assert _auto(AVX2) == "float32"


def test_avx512_bf16_without_amx_computes_in_float32() -> None:
    assert _auto(AVX512_BF16) == "float32"


def test_amx_computes_packed_rows_in_bfloat16() -> None:
    assert _auto(AMX) == "bfloat16"


def test_amx_keeps_float32_for_one_sample_per_pass() -> None:
    # On the AMX host bf16 SFT running each conversation alone was slower than fp32.
    assert _auto(AMX, packed=False) == "float32"


def test_rl_on_cpu_matches_the_float32_replicas_even_with_amx() -> None:
    assert _auto(AMX, rl=True) == "float32"


@pytest.mark.parametrize("cpu", [AVX2, AVX512_BF16, AMX])
@pytest.mark.parametrize("rl", [False, True])
def test_cuda_computes_in_bfloat16(cpu: CpuInfo, rl: bool) -> None:
    assert _auto(cpu, device="cuda", rl=rl, packed=True) == "bfloat16"


@pytest.mark.parametrize("requested", ["float32", "bfloat16"])
@pytest.mark.parametrize("cpu", [AVX2, AMX])
def test_an_explicit_dtype_is_honoured(requested: ComputeDtype, cpu: CpuInfo) -> None:
    for device in ("cpu", "cuda"):
        choice = choose_compute_dtype(
            requested, device=device, cpu=cpu, packed=False, float32_rollouts=True
        )
        assert choice.dtype == requested
        assert "set in the config" in choice.line()


def test_the_line_names_the_cpu_its_flags_and_the_choice() -> None:
    choice = choose_compute_dtype(
        "auto", device="cpu", cpu=AVX512_BF16, packed=True, float32_rollouts=False
    )
    assert choice.line() == (
        "compute dtype float32: CPU AMD EPYC has avx2 avx512f avx512_bf16, no amx_bf16"
    )
    amx = choose_compute_dtype("auto", device="cpu", cpu=AMX, packed=True, float32_rollouts=False)
    assert amx.line() == (
        "compute dtype bfloat16: CPU Intel Xeon Platinum 8480+ has "
        "avx2 avx512f avx512_bf16 amx_tile amx_bf16"
    )


def test_cpuinfo_is_parsed_from_the_first_processor() -> None:
    text = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n"
        "flags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n"
    )
    cpu = parse_cpuinfo(text)
    assert cpu.model_name == "AMD EPYC"
    assert cpu.flags == {"fpu", "avx2", "avx512f", "avx512_bf16"}


def test_no_cpuinfo_means_no_flags_and_float32(tmp_path: Path) -> None:
    cpu = read_cpu_info(tmp_path / "missing")
    assert cpu.flags == frozenset()
    assert _auto(cpu) == "float32"
