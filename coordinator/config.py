"""The run's configuration: one typed tree, loaded from YAML or TOML, overridable from the CLI.

Importing this module loads no torch or vLLM. Layering: field defaults < the config file <
`LOCKGATE_<SECTION>__<FIELD>` environment variables < `--set section.field=value` flags.
Derived values (the trainer's full config, the gateway's) are computed in one explicit step
(`launch.py`, `part_configs.py`), never by validators that mutate the config.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, field_validator, model_validator

from lockgate.coordinator.cpu_plan import plan_here
from lockgate.gateway.config import ADMIN_TOKEN_ENV, RequestLimits, SamplingPolicy
from lockgate.gateway.records.advantages import AdvantageSpec
from lockgate.gateway.schema import PauseMode
from lockgate.trainer.config import LoraSpec, TrainerConfig

# `LOCKGATE_<SECTION>__<FIELD>` (nesting by `__`) sets `section.field`, between the file and --set.
ENV_PREFIX = "LOCKGATE_"
# The --max-lora-rank values vLLM 0.32 accepts (its LoRAConfig refuses any other).
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that serves adapters of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"rank {rank} is above the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]})")


def service_url(url: str) -> str:
    """An http(s) base URL of a service (a replica, a gateway), without a trailing slash."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("http", "https") or not rest.strip("/"):
        raise ValueError(f"'{url}' is not an http(s) URL like http://host:port")
    return url.rstrip("/")


class ModelSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: Path | None = Field(
        default=None,
        description="HF model dir. Unset: the tiny Qwen3-style model, built offline and cached.",
    )
    chat_format: str = Field(
        default="auto",
        description="The model's chat format, a `renderers` name (qwen3, llama-3, gpt-oss, "
        "deepseek-r1, glm-4.5, gemma4, default, ...). auto: detected from the model's files "
        "(gateway/calls/chat_format.py; docs/models.md); an undetectable model is an error.",
    )
    lora: LoraSpec | None = Field(
        default=None,
        description="Train low-rank adapters on the model instead of all its weights: the "
        "trainer publishes each step's adapter, the replicas serve the base model with LoRA on "
        "and load each new adapter at runtime, so several runs can share one fleet "
        "(docs/lora.md). null: full fine-tuning.",
    )

    @field_validator("lora")
    @classmethod
    def _rank_vllm_serves(cls, lora: LoraSpec | None) -> LoraSpec | None:
        if lora is not None:
            vllm_lora_rank(lora.rank)
        return lora


class ReplicasSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: int = Field(
        default=2,
        ge=1,
        description="Local vLLM replicas to start. auto: from this machine's usable CPU cores "
        "when the config is read (coordinator/cpu_plan.py: 2 on two cores, more replicas of "
        "more threads on more cores).",
    )
    urls: list[str] = Field(
        default_factory=list,
        description="Replicas already running elsewhere (e.g. `lockgate replicas`): used instead "
        "of starting any. `replicas: [URL, ...]` is short for this.",
    )
    host: str = Field(
        default="127.0.0.1", description="Address local replicas listen on (0.0.0.0: all)."
    )
    base_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Local replica i listens on base_port + i; unset: free ports.",
    )
    kv_cache_gib: int = Field(default=1, ge=1, description="VLLM_CPU_KVCACHE_SPACE per replica.")
    max_model_len: int = Field(default=1024, ge=64, description="Context length of the replicas.")
    startup_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Wait for /health this long: of the replicas started here, or of those at "
        "`urls` (a URL that never answers is an error naming it).",
    )
    device: Literal["auto", "cuda", "cpu"] = Field(
        default="auto",
        description="Where replicas started here run. auto: cuda when torch sees a GPU and the "
        "installed vLLM is not the CPU build, else cpu (docs/deploy.md, 'GPUs').",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="The replicas' --dtype. auto: bfloat16 on cuda, float32 on cpu."
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Share of each GPU's memory a replica takes (cuda). Unset: vLLM's default on "
        "GPUs of its own; on a GPU shared with a trainer rank, what the rank leaves.",
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per replica (cuda).")
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="Sequences a replica batches at once; unset: vLLM's."
    )
    enforce_eager: bool | None = Field(
        default=None,
        description="Run the model eagerly (no compilation, no CUDA graphs). Unset: eager on "
        "the CPU build of vLLM only, where compiling costs each start and buys nothing.",
    )
    gpus: list[int] | None = Field(
        default=None,
        description="GPUs of the replicas started here (indices among the visible ones): "
        "replica i takes entries [i*T, (i+1)*T) for tensor_parallel_size T. Unset: the first "
        "free ones.",
    )
    colocate: bool | None = Field(
        default=None,
        description="Share GPUs with the trainer ranks (one replica shard and one rank per GPU), "
        "gpu_memory_utilization set so both fit. Unset: with one GPU.",
    )
    colocate_margin_gib: float = Field(
        default=4.0,
        ge=0,
        description="GPU memory a trainer rank sharing a GPU needs beyond its sharded weights, "
        "gradients and Adam states (activations, CUDA context, NCCL buffers).",
    )
    max_loras: int = Field(
        default=4,
        ge=1,
        description="With model.lora: adapters a replica started here holds at once (vLLM's "
        "--max-loras). A sync holds a run's old and new adapter until the old one's calls end, "
        "so give two per run that shares the fleet.",
    )

    @model_validator(mode="before")
    @classmethod
    def _urls_shorthand(cls, data: Any) -> Any:
        return {"urls": data} if isinstance(data, list) else data

    @field_validator("count", mode="before")
    @classmethod
    def _count_from_cores(cls, value: Any) -> Any:
        return plan_here().replicas if value == "auto" else value

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        return [service_url(url) for url in urls]

    @model_validator(mode="after")
    def _ports_fit(self) -> ReplicasSection:
        if self.base_port is not None and self.base_port + self.count - 1 > 65535:
            raise ValueError("base_port + count - 1 exceeds 65535")
        return self


class GatewaySection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str | None = Field(
        default=None,
        description="A gateway already running elsewhere (e.g. `lockgate gateway`): `train` uses "
        "it and its replicas instead of starting any. `gateway: URL` is short for this.",
    )
    admin_token_env: str = Field(
        default=ADMIN_TOKEN_ENV,
        min_length=1,
        description="Environment variable holding the admin token: needed with `url`; a gateway "
        "started here takes it when set, else a fresh random one.",
    )
    host: str = Field(
        default="127.0.0.1",
        description="Address a gateway started here listens on (0.0.0.0: all interfaces).",
    )
    port: int = Field(default=0, ge=0, le=65535, description="Gateway port (0 picks a free one).")
    advertise_url: str | None = Field(
        default=None,
        description="The gateway's URL as agents on other hosts reach it: the base of the "
        "session URLs sent to an agent service (environment.url) and of RUN_DIR/enrolment.json. "
        "Unset: the URL the coordinator uses, where a wildcard host (0.0.0.0, ::) is replaced "
        "by this machine's address.",
    )
    startup_timeout_s: float = Field(
        default=60.0, gt=0, description="Wait this long for the gateway (started here or at `url`)."
    )
    sampling: SamplingPolicy = Field(default_factory=SamplingPolicy)
    max_pause_wait_s: float = Field(
        default=600.0, gt=0, description="A call held by a weight sync fails (503) after this."
    )
    limits: RequestLimits = Field(
        default_factory=RequestLimits,
        description="Bounds on one agent request's size and work (docs/gateway-api.md).",
    )

    @model_validator(mode="before")
    @classmethod
    def _url_shorthand(cls, data: Any) -> Any:
        return {"url": data} if isinstance(data, str) else data

    @field_validator("url", "advertise_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        return None if url is None else service_url(url)


class CollectiveSection(BaseModel):
    """Where the `collective` weights transport's group meets (gateway/sync/weights.py)."""

    model_config = ConfigDict(extra="forbid")
    address: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="The address of the trainer's host (rank 0 hosts the group's store there) "
        "as the replicas reach it: this machine's loopback suits replicas started here; "
        "replicas on other hosts need the trainer host's own address. Under launcher: ray "
        "it is rank 0's node, wherever Ray places it.",
    )
    port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="The group's store port on the trainer's host; 0: a free one at launch "
        "(under launcher: ray, one free on rank 0's node).",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto",
        description="torch.distributed backend of the group. auto: nccl where the replicas and "
        "the trainer both run on cuda, else gloo (CPU tensors).",
    )
    timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Each part of a transfer (each message, the load) fails after this long, "
        "so a member that dies fails the sync rather than hanging it.",
    )
    join_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Forming the group fails after this long (it takes about a second): a "
        "member that never joins, a replica dead since the last sync, fails it soon, and the "
        "sync is tried once more with the replicas that still answer.",
    )

    @model_validator(mode="after")
    def _join_within_timeout(self) -> CollectiveSection:
        if self.join_timeout_s > self.timeout_s:
            raise ValueError("sync.collective.join_timeout_s exceeds its timeout_s")
        return self


class SyncSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    transport: Literal["disk", "collective"] = Field(
        default="disk",
        description="How new weights reach the replicas: disk (the trainer writes a "
        "safetensors snapshot in the run dir that every replica reads: a volume they share) or "
        "collective (trainer rank 0 streams them over a torch.distributed group the replicas' "
        "workers join, gloo on CPU and NCCL on CUDA: no file, no shared volume; the "
        "`collective` section says where the group meets). docs/deploy.md compares them.",
    )
    collective: CollectiveSection = Field(default_factory=CollectiveSection)
    mode: PauseMode = Field(
        default="abort",
        description="How a weight sync treats calls in flight: abort (cut them, keep their "
        "tokens, continue under the new weights; versions per token), keep (vLLM freezes "
        "them; versions as spans), drain (let them finish under the old weights).",
    )
    partial_rollout: bool = Field(
        default=True,
        description="With mode=abort: continue cut calls under the new weights. Off: cut calls "
        "fail and their rollouts are dropped (counted), so no sample mixes versions.",
    )
    pause_timeout_s: float = Field(
        default=600.0, gt=0, description="Give up a pause (and keep serving) after this long."
    )
    stage: bool = Field(
        default=False,
        description="Before each pause, have the replicas prepare the load while they serve "
        "(disk transport, direct load on vLLM-CPU: the new kernel handles are built between "
        "engine steps), so the pause only swaps them in: shorter stalls for agents, but the "
        "same CPU work spread over the steps, the new weights in later, and a second copy of "
        "the packed weights until the swap.",
    )
    stage_slice_s: float = Field(
        default=0.2,
        gt=0,
        le=60,
        description="Staging holds each replica's engine this long at a time, then lets it run "
        "a step: longer slices get the new weights in sooner, shorter ones stall calls less.",
    )
    snapshot_layout: Literal["replicas", "hf"] = Field(
        default="replicas",
        description="How the trainer writes weight snapshots: replicas (the linear weights the "
        "replicas name, `GET /admin/weights/layout`, stored in their kernel layout: on "
        "vLLM-CPU with the direct load, joined and transposed so its kernel handles build "
        "about twice as fast; HF layout for the rest and wherever the replicas name none) or "
        "hf (HF layout throughout: snapshots transformers and any vLLM load, slower to load "
        "on vLLM-CPU). `lockgate export-hf` turns a snapshot back into HF layout.",
    )
    overlap: bool = Field(
        default=True,
        description="With max_staleness >= 1: the trainer starts the next step while the "
        "replicas load the last one's weights (the next sync still waits for this one). Off: "
        "every step waits for its own sync.",
    )

    @model_validator(mode="after")
    def _staging_is_disks(self) -> SyncSection:
        if self.transport == "collective" and self.stage:
            raise ValueError(
                "sync.stage prepares the load of a disk snapshot while the replicas serve; "
                "with sync.transport: collective there is none (set stage: false)"
            )
        return self


class TrainerSection(TrainerConfig):
    @model_validator(mode="before")
    @classmethod
    def _threads_from_cores(cls, data: Any) -> Any:
        """`num_threads: auto`: the threads per rank the CPU plan gives the trainer's ranks on
        this machine's usable cores (beside the replicas: one on two cores, its own cores'
        share on more)."""
        if isinstance(data, dict) and data.get("num_threads") == "auto":
            ranks = int(data.get("world_size", 1))
            data = {**data, "num_threads": plan_here(trainer_ranks=ranks).threads_per_rank}
        return data

    model_dir: Path | None = Field(  # type: ignore[assignment]
        default=None, description="Filled from model.path at launch; leave unset."
    )
    gpus: list[int] | None = Field(
        default=None,
        description="GPUs of the trainer ranks on this node (indices among the visible ones; "
        "rank r takes entry r), for trainer.device cuda. Unset: the first ones the replicas "
        "leave.",
    )
    weights: Literal["disk", "collective"] = Field(  # type: ignore[assignment]
        default="disk", exclude=True, description="Set sync.transport instead."
    )

    @field_validator("weights", mode="before")
    @classmethod
    def _weights_are_the_syncs(cls, value: object) -> str:
        if value != "disk":
            raise ValueError("how weights leave the trainer is set in sync.transport")
        return "disk"

    # The entropy term is the algorithm's choice, not the machinery's: it is set in
    # `algorithm.entropy_coef` and handed to the trainer at launch.
    entropy_coef: None = Field(  # type: ignore[assignment]
        default=None, exclude=True, description="Set algorithm.entropy_coef instead."
    )

    @field_validator("entropy_coef", mode="before")
    @classmethod
    def _entropy_is_the_algorithms(cls, value: object) -> None:
        if value is not None:
            raise ValueError("the entropy term is set in algorithm.entropy_coef")
        return None

    # Adapters concern the replicas and the gateway as much as the trainer: one option for all.
    lora: None = Field(  # type: ignore[assignment]
        default=None, exclude=True, description="Set model.lora instead."
    )

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_is_the_models(cls, value: object) -> None:
        if value is not None:
            raise ValueError("adapters are set in model.lora")
        return None


class LoopSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(default=20, ge=1, description="Trainer steps to run.")
    groups_per_step: int = Field(default=4, ge=1, description="GRPO groups in one trainer batch.")
    group_size: int = Field(default=8, ge=1, description="Rollouts per task (n).")
    max_staleness: int = Field(
        default=1,
        ge=0,
        description="η: 0 is on-policy; 1 lets step k+1's rollouts run while k trains.",
    )
    max_off_policy: int | None = Field(
        default=None,
        ge=0,
        description="Drop (and count) rollouts holding a trained token more than this many "
        "versions behind the trainer when their group is consumed. Unset: equal to "
        "max_staleness, so the bound η also holds for groups that finish late.",
    )
    sync_every: int = Field(default=1, ge=1, description="Weight sync after every this many steps.")
    min_group_size: int = Field(
        default=2, ge=1, description="Fewer usable rollouts drops the group."
    )
    rollout_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Per-rollout time limit. With rollouts: client, a group's: one still "
        "incomplete this long after its first session is closed and its open sessions failed.",
    )
    val_every: int = Field(
        default=0,
        ge=0,
        description="Validate every this many steps (and once at the start) with greedy "
        "rollouts of the environment's val_tasks(); 0 never does.",
    )
    val_concurrency: int = Field(
        default=8, ge=1, description="Validation rollouts running at once."
    )
    # Here and not in `environment`: it says who starts the groups the loop trains on, which
    # is the loop's business; the environment says what the agents are, and in client mode
    # the agents are not the run's (the environment then serves only validation).
    rollouts: Literal["dispatch", "client"] = Field(
        default="dispatch",
        description="Who starts the rollouts. dispatch: the loop picks the environment's tasks "
        "and runs its agent, group_size sessions per task. client: the loop starts none; "
        "clients holding the run's enrolment key (RUN_DIR/enrolment.json) create sessions "
        "(POST /v1/sessions with a task id and a group), run any agent on them and finish them "
        "with a reward; a group of group_size finished sessions is trained on, and a new group "
        "past the staleness gate is refused with a 429 and Retry-After "
        "(docs/bring-your-agent.md, 'Client-driven rollouts').",
    )

    @property
    def off_policy_bound(self) -> int:
        return self.max_staleness if self.max_off_policy is None else self.max_off_policy

    @model_validator(mode="after")
    def _bounds_leave_room_between_syncs(self) -> LoopSection:
        # Between two syncs the replicas keep one version for sync_every steps: the gate must let
        # that many steps of groups start on it, and the bound must accept what they generate,
        # or the run waits forever (gate) or drops every rollout it makes (bound).
        lag = self.sync_every - 1
        if self.max_staleness < lag:
            raise ValueError(
                f"max_staleness={self.max_staleness} with sync_every={self.sync_every} would stall "
                f"the run: the gate needs max_staleness >= sync_every - 1 = {lag}"
            )
        if self.off_policy_bound < lag:
            raise ValueError(
                f"max_off_policy={self.max_off_policy} with sync_every={self.sync_every} would "
                f"drop every rollout: it needs max_off_policy >= sync_every - 1 = {lag}"
            )
        return self


class AlgorithmSection(AdvantageSpec):
    """The learning algorithm's knobs, apart from the machinery that runs it: how advantages are
    estimated and shaped (`estimator`, `negative_advantage_weight`: the gateway's
    `AdvantageSpec`, so the viewer shows what was trained on), which groups are worth training
    on, and the entropy term."""

    model_config = ConfigDict(extra="forbid")
    drop_zero_variance: bool = Field(
        default=False, description="Drop groups whose rewards are all equal (they carry no signal)."
    )
    screen_size: int = Field(
        default=0,
        ge=0,
        description="Pass@k screening (0: off): run this many of a task's group_size rollouts "
        "first; when none scores above 0 the group is dropped (groups_dropped/screened_out) and "
        "the rest are never generated, else they run and the group trains whole. Spares the "
        "generation of tasks the policy cannot solve yet, most of what drop_zero_variance drops "
        "on a weak policy.",
    )
    entropy_coef: float = Field(
        default=0.0,
        description="Weight of the entropy bonus (subtracted from the loss). Negative values make "
        "it a penalty: the policy is pushed to sharpen what it samples (entropy minimisation).",
    )


_SOURCES = {
    "path": "a Python environment file",
    "command": "an agent program",
    "url": "an agent service",
}


class EnvironmentSection(BaseModel):
    """Where the agent comes from: a Python environment file (`path`), an agent command run per
    rollout (`command`) or an agent service called per rollout (`url`); exactly one of them."""

    model_config = ConfigDict(extra="forbid")
    path: Path | None = Field(
        default=Path("examples/toy/env.py"),
        description="Python file defining make_environment(**args); relative to the config file."
        " Not used with `command` or `url`.",
    )
    command: list[str] | None = Field(
        default=None,
        description="Agent program run once per rollout, any language (e.g. [python3, agent.py]);"
        ' it gets OPENAI_BASE_URL/OPENAI_API_KEY and prints {"reward": x} last. Needs `tasks`.',
    )
    url: HttpUrl | None = Field(
        default=None,
        description="Agent service the coordinator POSTs each rollout to (any language, any host;"
        " the contract: docs/bring-your-agent.md). Needs `tasks`.",
    )
    tasks: Path | None = Field(
        default=None,
        description='JSONL tasks for `command` or `url`, one {"id": ..., ...data} per line;'
        " relative to the config file.",
    )
    workdir: Path | None = Field(
        default=None,
        description="Working directory of `command`; relative to the config file, which is the"
        " default.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword args for make_environment; with `command` for CommandEnvironment"
        " (timeout_s, env, output_limit_kib, kill_grace_s); with `url` the service's options"
        " (max_concurrency, timeout_s, retries, retry_backoff_s, headers, answer_limit_kib).",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_source(cls, data: Any) -> Any:
        # Runs before defaults apply, so a `command` or `url` config does not inherit the
        # default `path`.
        if not isinstance(data, dict):
            return data
        external = [key for key in ("command", "url") if data.get(key) is not None]
        if not external:
            if "path" in data and data["path"] is None:
                raise ValueError("set `path` (a Python environment file), `command` or `url`")
            unused = [key for key in ("tasks", "workdir") if data.get(key) is not None]
            if unused:
                raise ValueError(f"{' and '.join(unused)} only apply with `command` or `url`")
            return data
        given = [key for key in ("path", "command", "url") if data.get(key) is not None]
        if len(given) > 1:
            named = [f"`{key}` ({_SOURCES[key]})" for key in given]
            raise ValueError(
                f"set {' or '.join(named)}, not {'both' if len(given) == 2 else 'all'}"
            )
        (source,) = external
        if data.get("tasks") is None:
            raise ValueError(f"`{source}` needs `tasks`: a JSONL file with one task per line")
        if source == "url" and data.get("workdir") is not None:
            raise ValueError("`workdir` only applies with `command`")
        return {**data, "path": None}


class WandbSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    project: str = Field(default="lockgate", description="W&B project.")
    entity: str | None = Field(default=None, description="W&B team or user; None: your default.")
    name: str | None = Field(default=None, description="Run name in W&B; None: the run's name.")
    group: str | None = Field(default=None, description="W&B run group (e.g. one per sweep).")
    tags: list[str] = Field(default_factory=list, description="W&B run tags.")
    mode: Literal["online", "offline"] = Field(
        default="online",
        description="offline writes under RUN_DIR/wandb for a later `wandb sync`.",
    )


class MetricsSection(BaseModel):
    """Where step records go besides RUN_DIR/metrics.jsonl (always written, the source of truth)."""

    model_config = ConfigDict(extra="forbid")
    tensorboard: bool = Field(
        default=False,
        description="Write TensorBoard event files to RUN_DIR/tensorboard (needs lockgate[tensorboard]).",
    )
    wandb: WandbSection | None = Field(
        default=None, description="Log to Weights & Biases (needs lockgate[wandb]); None: off."
    )


class RaySection(BaseModel):
    """Where `launcher: ray` places the run's parts, and what each takes of the cluster."""

    model_config = ConfigDict(extra="forbid")
    address: str | None = Field(
        default=None,
        description="The Ray cluster to join, as its GCS address `host:6379` (`auto`: the one "
        "`ray start` runs on this machine); run `lockgate train` on one of its nodes. Unset: "
        "$RAY_ADDRESS when set, else a local cluster started for the run and stopped with it.",
    )
    num_cpus: int | None = Field(
        default=None,
        ge=1,
        description="Logical CPUs of a local cluster started for the run (unset: this machine's).",
    )
    namespace: str = Field(
        default="lockgate", min_length=1, description="Ray namespace of the run's named actors."
    )
    replica_cpus: float = Field(default=1.0, gt=0, description="CPUs per replica (its bundle).")
    num_gpus: int | None = Field(
        default=None,
        ge=0,
        description="GPUs of a local cluster started for the run (unset: the ones Ray detects).",
    )
    replica_gpus: float | None = Field(
        default=None,
        ge=0,
        description="GPUs per replica (its bundle). Unset: replicas.tensor_parallel_size when "
        "the replicas run on cuda, else 0.",
    )
    trainer_cpus: float = Field(default=1.0, gt=0, description="CPUs per trainer rank.")
    trainer_gpus: float | None = Field(
        default=None,
        ge=0,
        description="GPUs per trainer rank. Unset: 1 when the trainer runs on cuda, else 0.",
    )
    placement_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Wait this long for Ray to place a placement group; then a clear error.",
    )
    replace_replicas: bool = Field(
        default=True,
        description="Replace a replica whose actor dies (killed, node lost) with a new one at "
        "the served weights, while the run goes on with the others.",
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables for every actor the run starts, and so every replica "
        "and trainer rank (e.g. HF_HOME on the nodes).",
    )

    @model_validator(mode="after")
    def _num_cpus_of_a_local_cluster(self) -> RaySection:
        for option in ("num_cpus", "num_gpus"):
            if self.address is not None and getattr(self, option) is not None:
                raise ValueError(
                    f"{option} sizes a local cluster started for the run; a cluster at "
                    f"`address` has what its nodes declare (ray start --{option.replace('_', '-')})"
                )
        return self


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(default="run", description="Run name; the run dir defaults to runs/<name>.")
    run_dir: Path | None = Field(default=None, description="Where logs, metrics and weights go.")
    seed: int = Field(default=0, description="Seed for task order and the trainer.")
    model: ModelSection = Field(default_factory=ModelSection)
    replicas: ReplicasSection = Field(default_factory=ReplicasSection)
    gateway: GatewaySection = Field(default_factory=GatewaySection)
    sync: SyncSection = Field(default_factory=SyncSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    loop: LoopSection = Field(default_factory=LoopSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    launcher: Literal["local", "ray"] = Field(
        default="local",
        description="local: every part on this machine; ray: replicas and trainer ranks placed "
        "on a Ray cluster (the `ray` section), the gateway and the loop here (docs/deploy.md).",
    )
    ray: RaySection = Field(default_factory=RaySection)
    trainer_first: bool | None = Field(
        default=None,
        description="Give the trainer's ranks the CPU before the rest of the run on this "
        "machine: this process's session (loop, gateways, environment, local replicas) is "
        "scheduled at autogroup nice 10 while the run lasts (coordinator/launch/cpu_priority.py). "
        "Unset: when local replicas of the CPU build of vLLM share the cores with a local "
        "trainer.",
    )

    @model_validator(mode="after")
    def _screen_smaller_than_group(self) -> RunConfig:
        screen, size = self.algorithm.screen_size, self.loop.group_size
        if screen and screen >= size:
            raise ValueError(
                f"algorithm.screen_size={screen} must be below group_size={size} "
                "(loop.group_size; 0 turns screening off)"
            )
        return self

    @model_validator(mode="after")
    def _screening_needs_dispatch(self) -> RunConfig:
        if self.algorithm.screen_size and self.loop.rollouts == "client":
            raise ValueError(
                "algorithm.screen_size screens the loop's own dispatch; with loop.rollouts: "
                "client the clients start every rollout (set screen_size: 0)"
            )
        return self

    @model_validator(mode="after")
    def _adapters_go_by_disk(self) -> RunConfig:
        if self.model.lora is None:
            return self
        if self.sync.transport == "collective":
            raise ValueError(
                "model.lora with sync.transport: collective is not built (a LoRA step publishes "
                "its adapter as files the replicas load); use sync.transport: disk"
            )
        if self.sync.stage:
            raise ValueError(
                "sync.stage prepares the load of a full snapshot; with model.lora a sync loads "
                "a small adapter and has nothing to stage (set stage: false)"
            )
        if self.sync.mode == "keep":
            raise ValueError(
                "sync.mode: keep freezes calls inside the replicas' engines, which with "
                "model.lora may serve other runs too; use abort or drain"
            )
        return self

    @model_validator(mode="after")
    def _ray_starts_its_parts(self) -> RunConfig:
        if self.launcher == "ray":
            given = [
                option
                for option, value in (
                    ("replicas.urls", self.replicas.urls),
                    ("gateway.url", self.gateway.url),
                )
                if value
            ]
            if given:
                raise ValueError(
                    f"launcher: ray places the replicas and starts the gateway itself; "
                    f"{' and '.join(given)} name parts started elsewhere (use launcher: local)"
                )
            _ray_assigns_gpus(self)
        return self


def _ray_assigns_gpus(config: RunConfig) -> None:
    """Under Ray each bundle's GPUs are Ray's to assign: a GPU list or colocation of the
    one-node plan would be silently ignored there."""
    given = [
        option
        for option, value in (
            ("replicas.gpus", config.replicas.gpus),
            ("trainer.gpus", config.trainer.gpus),
            ("replicas.colocate", config.replicas.colocate),
        )
        if value
    ]
    if given:
        raise ValueError(
            f"launcher: ray assigns each bundle's GPUs; {' and '.join(given)} place parts on "
            "this node's GPUs (use launcher: local, or fractional ray.replica_gpus / "
            "ray.trainer_gpus to share GPUs)"
        )


def env_overrides(environ: Mapping[str, str]) -> list[str]:
    """`--set` items from `LOCKGATE_<SECTION>__<FIELD>=value` variables (`__` nests: a name
    without one, like LOCKGATE_CACHE, is not an option), in a fixed order."""
    items = []
    for name, value in sorted(environ.items()):
        if name.startswith(ENV_PREFIX) and "__" in name:
            items.append(f"{name[len(ENV_PREFIX) :].lower().replace('__', '.')}={value}")
    return items


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `a.b=value` item (the value parsed as YAML) in `raw`, in place; returns it."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes section.field=value, got '{item}'")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {key}: '{part}' is not a section")
        node[leaf] = yaml.safe_load(value)
    return raw


def read_config_file(path: Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """A YAML or TOML file as a mapping, with `a.b=value` overrides (values parsed as YAML)
    applied; not yet validated. Shared by every command that takes a config file."""
    text = path.read_text()
    raw: Any = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the top level must be a mapping of sections")
    return apply_overrides(raw, overrides or [])


def load_config(path: Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML or TOML file, apply `a.b=value` overrides (values parsed as YAML), validate.

    Relative paths inside the file are taken relative to the file's directory; without a file
    (the defaults and the overrides alone), relative to the working directory.
    """
    if path is None:
        raw, base = apply_overrides({}, overrides or []), Path.cwd()
    else:
        raw, base = read_config_file(path, overrides), path.parent
    config = RunConfig.model_validate(raw)
    env = config.environment
    if env.path is not None and not env.path.is_absolute():
        env.path = (base / env.path).resolve()
    if env.tasks is not None and not env.tasks.is_absolute():
        env.tasks = (base / env.tasks).resolve()
    if env.command is not None:
        env.workdir = (base / (env.workdir or Path("."))).resolve()
    if config.model.path is not None and not config.model.path.is_absolute():
        config.model.path = (base / config.model.path).resolve()
    return config


def describe_options(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """One line per option (`section.field  type = default  description`) for `--help`."""
    lines: list[str] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines.extend(describe_options(annotation, key + "."))
            continue
        # An optional section (`X | None`, off by default): its line, then its own options.
        section = next(
            (a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)),
            None,
        )
        if section is not None:
            lines.append(f"  {key:<34} section, or null = off\n      {field.description or ''}")
            lines.extend(describe_options(section, key + "."))
            continue
        type_name = getattr(annotation, "__name__", str(annotation)).replace("typing.", "")
        default = (
            "(required)"
            if field.is_required()
            else f"= {field.get_default(call_default_factory=True)!r}"
        )
        lines.append(f"  {key:<34} {type_name} {default}\n      {field.description or ''}")
    return lines
