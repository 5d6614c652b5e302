"""How a run on one machine's CPUs shares its cores between vLLM replicas and trainer ranks:
`plan_cpus` is pure (the usable cores are its argument), `usable_cpus` reads them here.

The config's `auto` values (`replicas.count`, `trainer.num_threads`) come from this plan, and
the local replica launcher binds each replica's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND) where
it says. Importing it loads nothing beyond the standard library, so config.py may use it.

- Up to two cores the parts share them, as the recipes were tuned: a replica on each core and a
  one-thread trainer rank beside them, which `trainer_first` puts first on the CPU
  (coordinator/launch/cpu_priority.py).
- From three cores the parts get disjoint cores, so that neither waits on the other's threads:
  the trainer the upper half (at least one core), the replicas the lower rest, each replica a
  contiguous range of its own. Two replicas at least (the gateway routes around one that is
  loading weights), more once each would have `REPLICA_THREADS` threads, since a small model's
  decode scales across replicas better than across one replica's threads.
- Explicit counts are honoured: more replicas than replica cores share them round robin, one
  core each, as the launcher always did.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

# The threads a replica gets before another replica is started instead.
REPLICA_THREADS = 4
# Below this many cores, replicas and trainer share the cores rather than split them.
SPLIT_FROM_CORES = 3


@dataclass(frozen=True)
class CpuPlan:
    cores: tuple[int, ...]
    replica_binds: tuple[str, ...]  # VLLM_CPU_OMP_THREADS_BIND of replica i
    trainer_cores: tuple[int, ...]
    trainer_ranks: int
    threads_per_rank: int

    @property
    def replicas(self) -> int:
        return len(self.replica_binds)

    @property
    def shared(self) -> bool:
        """The trainer runs on cores that replicas are bound to."""
        bound = {c for bind in self.replica_binds for c in _cores_of(bind)}
        return bool(bound & set(self.trainer_cores))

    def line(self) -> str:
        how = (
            "sharing them" if self.shared else f"on the cores left ({_ranges(self.trainer_cores)})"
        )
        return (
            f"CPU plan for {len(self.cores)} core(s): {self.replicas} replica(s) bound to "
            f"{', '.join(self.replica_binds)}; {self.trainer_ranks} trainer rank(s) x "
            f"{self.threads_per_rank} thread(s) {how}"
        )


def plan_cpus(
    cores: Sequence[int],
    *,
    replicas: int | None = None,
    trainer_ranks: int = 1,
    threads_per_rank: int | None = None,
) -> CpuPlan:
    """The plan for `cores` (the usable CPU ids); None for `replicas` or `threads_per_rank`
    is `auto`, a number is kept as given."""
    if not cores:
        raise ValueError("no usable CPU cores")
    ids = tuple(sorted(cores))
    if len(ids) < SPLIT_FROM_CORES:
        replica_cores, trainer_cores = ids, ids
        auto_threads = 1
    else:
        half = len(ids) // 2
        replica_cores, trainer_cores = ids[: len(ids) - half], ids[len(ids) - half :]
        auto_threads = max(1, len(trainer_cores) // trainer_ranks)
    count = replicas if replicas is not None else _auto_replicas(len(replica_cores))
    return CpuPlan(
        cores=ids,
        replica_binds=tuple(_binds(replica_cores, count)),
        trainer_cores=trainer_cores,
        trainer_ranks=trainer_ranks,
        threads_per_rank=threads_per_rank if threads_per_rank is not None else auto_threads,
    )


def _auto_replicas(replica_cores: int) -> int:
    return max(min(2, replica_cores), replica_cores // REPLICA_THREADS)


def _binds(cores: Sequence[int], count: int) -> list[str]:
    """Each replica a contiguous range of `cores`, the first ones one core more when they do not
    divide evenly; more replicas than cores: one core each, round robin."""
    if count >= len(cores):
        return [str(cores[i % len(cores)]) for i in range(count)]
    size, extra = divmod(len(cores), count)
    binds, start = [], 0
    for i in range(count):
        n = size + (1 if i < extra else 0)
        binds.append(_ranges(cores[start : start + n]))
        start += n
    return binds


def _ranges(cores: Sequence[int]) -> str:
    """`0-3,8` for cores 0, 1, 2, 3, 8: VLLM_CPU_OMP_THREADS_BIND's form."""
    parts: list[str] = []
    run: list[int] = []
    for c in cores:
        if run and c != run[-1] + 1:
            parts.append(_span(run))
            run = []
        run.append(c)
    if run:
        parts.append(_span(run))
    return ",".join(parts)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def _cores_of(bind: str) -> list[int]:
    out: list[int] = []
    for part in bind.split(","):
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def usable_cpus() -> list[int]:
    # os.cpu_count() counts the host's CPUs; in a container or under taskset only the affinity
    # set can be bound, and binding outside it makes the vLLM worker fail at startup.
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def plan_here(
    *, replicas: int | None = None, trainer_ranks: int = 1, threads_per_rank: int | None = None
) -> CpuPlan:
    """`plan_cpus` over this process's usable cores."""
    return plan_cpus(
        usable_cpus(),
        replicas=replicas,
        trainer_ranks=trainer_ranks,
        threads_per_rank=threads_per_rank,
    )


def busy_cores(before: Sequence[int], after: Sequence[int], cores: int) -> float:
    """How many cores were busy between two readings of /proc/stat's `cpu` line (its jiffies:
    user nice system idle iowait irq softirq steal ...): the share of time not idle or waiting
    on I/O, in cores."""
    spent = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(spent)
    if total <= 0:
        return 0.0
    return cores * (total - spent[3] - spent[4]) / total


def busy_cores_here(sample_s: float = 0.3) -> float:
    """The cores this machine's processes keep busy now, over `sample_s` seconds (0 where
    /proc/stat cannot be read)."""
    import time

    try:
        before = _cpu_jiffies()
        time.sleep(sample_s)
        after = _cpu_jiffies()
    except (OSError, ValueError):
        return 0.0
    return busy_cores(before, after, os.cpu_count() or 1)


def _cpu_jiffies() -> list[int]:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    if fields[0] != "cpu":
        raise ValueError("/proc/stat does not start with the cpu line")
    return [int(v) for v in fields[1:9]]
