"""The configuration: a YAML file plus `key.sub=value` overrides, parsed into one typed, immutable,
validated model that the engine takes as it is, and the environment knobs, read once.

The pydantic models below are the schema: each field is one YAML key, its type is the type the key
must have, its default applies when the key is absent, its comment says what it means, and the
checks that relate keys to each other are the models' validators. `EngineConfig` is what the engine
reads (sequence length, pools, batching, speculation, graphs); `ServeConfig` is an `EngineConfig`
plus what to load and how to serve it, so `mstar-serve` hands its config to the engine unchanged.
Every error names the full dotted key (`scheduler.max_num_seqs`) and what is expected; an unknown
key gets the closest known one as a suggestion.

Relative paths (`checkpoint`, `model_kwargs.speculative_draft`) resolve against the folder of the
YAML file that holds them; relative paths given as overrides resolve against the working directory,
where the command line was typed. A checkpoint need not exist when the config is loaded (the tiny
configs point at `checkpoints/`, which `mstar-make-tiny checkpoints/` fills); `check_paths` says
what is missing when the server is about to load it.

`Environment` declares every environment variable mstar reads; `Environment.read()` reads them once
at startup and the values are passed down from there (no module reads the environment itself).
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    model_validator,
)

if TYPE_CHECKING:
    import torch


class ServeConfigError(ValueError):
    """A config (YAML key, override or environment variable) that mstar cannot run; the message names it."""


class _Problem(ValueError):
    """Raised by a field's validator: what is wrong with the value, said after the key (and `suffix`,
    e.g. `[2]` for a list entry), which the validator does not know and the error message adds."""

    def __init__(self, message: str, suffix: str = ""):
        super().__init__(message)
        self.message, self.suffix = message, suffix


def _shown(value: Any) -> str:
    return f"{type(value).__name__} ({value!r})"


# --- value types that YAML writes differently from how a config holds them -------------------------


def _to_path(value: Any) -> Any:
    if isinstance(value, Path):
        return value
    if not isinstance(value, str) or not value:
        raise _Problem(f"must be a directory path, got {_shown(value)}")
    return Path(value)


def _to_schedule(value: Any) -> Any:
    if isinstance(value, tuple | list) and all(isinstance(p, tuple | list) and len(p) == 2 for p in value):
        value = dict(value)  # the stored pairs form, as a config holds it
    if not isinstance(value, Mapping):
        raise _Problem(f"must map decode batch buckets to drafts per row, e.g. {{16: 7, 32: 4, 64: 0}}; "
                       f"got {_shown(value)}")
    for bucket, drafts in value.items():
        for what, v in (("bucket", bucket), ("draft count", drafts)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise _Problem(f": {what} {v!r} must be an integer (in entry {bucket!r}: {drafts!r})")
        if bucket < 1:
            raise _Problem(f": bucket {bucket} must be >= 1")
    return tuple(sorted(value.items()))


def api_key_problem(item: Any) -> str | None:
    """What is wrong with an API key (None when it can be used); the key itself is never quoted."""
    if not isinstance(item, str):
        return f"must be a string, got {type(item).__name__}"
    if not item:
        return "is empty; give a non-empty key"
    if any(c.isspace() or c == "," or not c.isprintable() for c in item):
        return "holds whitespace, a comma or an unprintable character; keys are single printable tokens"
    return None


def _to_api_keys(value: Any) -> Any:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple):
        raise _Problem(f"must be a list of key strings, got {type(value).__name__}")
    for i, item in enumerate(value):
        problem = api_key_problem(item)
        if problem:
            raise _Problem(problem, suffix=f"[{i}]")
    return tuple(value)


DirPath = Annotated[Path, BeforeValidator(_to_path), PlainSerializer(str)]
# (batch bucket, drafts per row) pairs in increasing bucket order; written in YAML as a mapping.
ScheduleEntries = Annotated[tuple[tuple[int, int], ...], BeforeValidator(_to_schedule), PlainSerializer(dict)]
ApiKeys = Annotated[tuple[str, ...], BeforeValidator(_to_api_keys), PlainSerializer(list)]
ModelName = Literal["kimi_k3"]  # the model registry: keys mstar knows how to build
Dtype = Literal["float32", "bfloat16", "float16", "float64"]
Device = Literal["cpu", "cuda", "auto"]


# --- schema -----------------------------------------------------------------------------------------


class _Section(BaseModel):
    """A config section: strict types (`true` is not 1, "8" is not 8), no unknown keys, immutable."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_section_takes_defaults(cls, data: Any) -> Any:
        return {} if data is None else data  # `scheduler:` in YAML with every key commented out

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a config is immutable ({type(self).__name__}.{name}): build another with "
                             "with_overrides('key.sub=value')")


class MlaKvConfig(_Section):
    """`resources.mla_kv`: the paged latent KV of the MLA layers (one pool per rank)."""

    page_size: int = Field(64, ge=1)  # tokens per page
    # Pages in the pool. Page 0 is a sink that padding rows of a captured batch write into, so the
    # pool holds (max_num_pages - 1) * page_size tokens: at least one max_seq_len request.
    max_num_pages: int = Field(1792, ge=1)


class KdaStateConfig(_Section):
    """`resources.kda_state`: per-request recurrent state of the KDA layers (state + conv window)."""

    # Slots in the pool. Slot 0 is a sink that padding rows of a captured batch write into, so at
    # most max_slots - 1 requests run at once: must exceed scheduler.max_num_seqs.
    max_slots: int = Field(65, ge=2)


class DSparkKvConfig(_Section):
    """`resources.dspark_kv`: the paged latent KV of the DSpark draft's layers."""

    # Pages in the draft's pool (page 0 is its sink too); the page size is resources.mla_kv.page_size.
    # When the section is absent and speculation is on, it gets as many pages as resources.mla_kv.
    max_num_pages: int = Field(1792, ge=1)


class ResourcesConfig(_Section):
    """`resources`: how large each per-request resource pool is."""

    mla_kv: MlaKvConfig = MlaKvConfig()
    kda_state: KdaStateConfig = KdaStateConfig()
    dspark_kv: DSparkKvConfig | None = None  # draft KV; None when speculation is off


class PrefixCacheConfig(_Section):
    """`prefix_cache`: requests whose tokens start with a prefix computed before (an earlier turn, a shared
    system prompt) reuse its KV pages and KDA state and prefill only the rest (README, Prefix caching)."""

    enabled: bool = True
    # Tokens between the KDA state snapshots a prefix can resume from (a multiple of resources.mla_kv.page_size):
    # a hit resumes at the longest cached prefix that ends on one. Prefill chunks stop at the last snapshot
    # boundary they cross, so a prompt of more than this many tokens may take one step more. Snapshots take the
    # KDA slots no running request holds: resources.kda_state.max_slots beyond scheduler.max_num_seqs + 1.
    kda_snapshot_interval: int = Field(512, ge=1)


class SchedulerConfig(_Section):
    """`scheduler`: continuous batching limits."""

    max_num_seqs: int = Field(64, ge=1)  # requests running at once = the largest decode batch
    # Requests that prefill (a chunk of) their prompt in one step; a prefilling request is running,
    # so max_num_seqs also caps it (not an error, so that overriding max_num_seqs alone works).
    max_prefill_seqs: int = Field(8, ge=1)
    # Tokens one step may run: prefill chunks plus decode rows (each row with its drafts).
    max_num_batched_tokens: int = Field(8192, ge=1)
    # Split prompts longer than the token budget over several steps. Off: a prompt prefills in one
    # step, so the budget must hold max_seq_len tokens.
    chunked_prefill: bool = True
    # Requests queued for admission. The server admits at most max_num_seqs + max_waiting engine
    # requests (one per choice) at once and answers 429 with Retry-After beyond that.
    max_waiting: int = Field(1024, ge=1)


class ServerSection(_Section):
    """`server`: the HTTP front end's access control and per-request limits (see README, Operating)."""

    # Bearer keys accepted on every /v1/* route (any one of them). Empty: no key needed, unless
    # `mstar-serve --api-key` or the MSTAR_API_KEY environment variable gives some (all are merged).
    # Prefer the environment variable: a key in a config file or on a command line is easier to leak.
    api_keys: ApiKeys = ()
    protect_health: bool = False  # GET /health needs a key too (when keys are set); default open for probes
    protect_metrics: bool = False  # GET /metrics needs a key too (when keys are set)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)  # larger request bodies are refused with 413
    max_n: int = Field(16, ge=1, le=128)  # choices per prompt (`n`); more is a 400 (128: OpenAI's own bound)
    # cap on max_tokens / max_completion_tokens (also the omitted default); 0: the context
    max_tokens: int = Field(0, ge=0)
    retry_after_s: int = Field(1, ge=1)  # the Retry-After header of a 429 (engine requests beyond the waiting queue)
    # Consecutive failed engine steps after which the engine gives up: mstar-serve then exits with
    # status 3 (for a supervisor to restart it). A single failed step fails the requests in flight
    # with an error and the server goes on.
    max_step_failures: int = Field(3, ge=1)
    log_requests: bool = False  # log each request's prompt and parameters (never logged otherwise)
    # Processes that parse bodies of 1 MiB or more and tokenize prompts of 64K characters or more, so that
    # a large request does not pause other clients' streams (server/tokenize_pool.py); smaller ones are
    # tokenized in a thread. 0: no processes.
    tokenize_workers: int = Field(2, ge=0, le=64)
    max_headers: int = 100  # requests with more headers are refused with 431
    max_url_bytes: int = 8 * 1024  # a longer request path plus query string is refused with 414
    body_timeout_s: float = 30.0  # a request body must arrive whole within this long, else 408 (slow clients)
    # the request line and headers must arrive whole within this long, else 408 (server/connection.py)
    header_timeout_s: float = Field(10.0, gt=0)
    keep_alive_timeout_s: int = 5  # an idle keep-alive connection is closed after this long (uvicorn's default)
    # Largest request line plus headers one request may send; more is a 431 and the connection is closed
    # (server/connection.py). nginx's default allows 4 x 8 KiB header buffers.
    max_header_bytes: int = 32 * 1024


class ModelKwargs(_Section):
    """`model_kwargs`: choices fixed at server start (baked into weights layout and graph captures)."""

    # k: DSpark drafts per verify step. 0 turns speculation off, whatever the other speculative_*
    # keys say: the schedule is then cleared and the draft is not loaded, so that overriding
    # speculative_tokens=0 alone turns off a config written for speculation.
    speculative_tokens: int = Field(0, ge=0)
    speculative_draft: DirPath | None = None  # DSpark draft checkpoint directory; required when k > 0
    # Drafts per row by decode batch bucket, e.g. {16: 7, 32: 4, 64: 0}: a batch of n rows uses the
    # smallest bucket >= n (mstar/speculative/schedule.py). Buckets are integers >= 1; with speculation
    # on, values are in 0..speculative_tokens and the largest bucket must cover scheduler.max_num_seqs.
    # Empty: speculative_tokens drafts at every batch size.
    speculative_schedule: ScheduleEntries = ()
    mixed_prefill_decode: bool = True  # run prefill chunks and decode rows in the same step
    # Decode and verify steps of 1..64 sequences and prefill steps (up to 8 prompts, token buckets up to 8192)
    # replay CUDA graphs captured at startup (no effect on CPU). Startup fails, naming what is in the way,
    # when the model's steps cannot be captured (engine/cuda_graphs.py): set it false there.
    cuda_graphs: bool = True
    # Plan and launch each step while the one before runs on the device (engine/core.py): the host's
    # scheduling, detokenizing and stop checks hide behind the GPU, speculative steps included (the next
    # verify step is planned from the device's accepted lengths); false: every step finishes before the
    # next is planned (for comparison). Unset: on for CUDA devices (on a CPU every op runs at once, so
    # nothing would overlap).
    async_scheduling: bool | None = None
    # Expert-parallel groups among the tp_size ranks (>= 1; must divide tp_size and the checkpoint's
    # num_experts). Group g of tp_size / moe_ep_size consecutive ranks owns experts g*E/ep .. (g+1)*E/ep - 1,
    # split over its ranks by intermediate dim. 1: pure TP (every rank holds a slice of every expert);
    # = tp_size: pure EP (whole experts). Per-rank expert memory is the same either way; see
    # mstar/distributed/expert_sharding.py and docs/multi_node.md.
    moe_ep_size: int = Field(1, ge=1)
    # With tp_size > 1, how the latent MoE's routed_expert_down_proj / up_proj are held: "sharded" splits them
    # over the ranks (1/tp of their bytes per rank, two more collectives per MoE layer), "replicated" keeps
    # both whole on every rank. Sharded measured faster at every decode batch on the H200 (8.8 GiB less
    # weight per TP8 rank too): benchmarks/emulate_rank/, mstar/distributed/sharding.py.
    latent_moe_layout: Literal["sharded", "replicated"] = "sharded"


class EngineConfig(_Section):
    """What the engine runs: the longest request, its pools, its batching and its speculation."""

    max_seq_len: int = Field(8192, ge=1)  # longest request, prompt plus output, in tokens
    resources: ResourcesConfig = ResourcesConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()
    model_kwargs: ModelKwargs = ModelKwargs()

    @property
    def speculative(self) -> bool:
        return self.model_kwargs.speculative_tokens > 0

    @property
    def dspark_kv_pages(self) -> int:
        """Pages of the draft's KV pool: resources.dspark_kv's, or as many as the target's."""
        r = self.resources
        return (r.dspark_kv or r.mla_kv).max_num_pages

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON-ready values (paths as strings, the schedule as a mapping), for logging.
        `parse_serve_config(cfg.to_dict()) == cfg`."""
        return self.model_dump()

    def with_overrides(self, *overrides: str) -> EngineConfig:
        """A copy with `key.sub=value` overrides applied and validated again."""
        return _validated(type(self), apply_overrides(self.to_dict(), overrides), Path.cwd())

    def _with_derived_defaults(self) -> EngineConfig:
        """Defaults that depend on other keys, filled once the config is valid."""
        mk, r = self.model_kwargs, self.resources
        if not self.speculative:
            if not mk.speculative_schedule:
                return self
            return self.model_copy(update={"model_kwargs": mk.model_copy(update={"speculative_schedule": ()})})
        if r.dspark_kv is not None:
            return self
        pages = DSparkKvConfig(max_num_pages=self.dspark_kv_pages)
        return self.model_copy(update={"resources": r.model_copy(update={"dspark_kv": pages})})

    @model_validator(mode="after")
    def _check_engine(self) -> EngineConfig:
        _check_scheduler(self)
        _check_pools(self)
        if self.speculative:
            _check_speculation(self)
        return self


class ServeConfig(EngineConfig):
    """One served model: what to load, where to run it, and the engine config it runs with."""

    model: ModelName  # registry key of the model implementation
    checkpoint: DirPath  # HF checkpoint directory (absolute once parsed)
    tp_size: int = Field(1, ge=1)  # tensor-parallel ranks, one per GPU (gloo processes on CPU)
    dtype: Dtype = "bfloat16"  # activations and unquantized weights
    device: Device = "auto"  # "auto": CUDA when available, else CPU
    served_model_name: str = ""  # name in /v1/models and responses (default: the checkpoint folder's name)
    server: ServerSection = ServerSection()

    def _with_derived_defaults(self) -> ServeConfig:
        cfg = super()._with_derived_defaults()
        return cfg if cfg.served_model_name else cfg.model_copy(update={"served_model_name": cfg.checkpoint.name})

    @model_validator(mode="after")
    def _check_serving(self) -> ServeConfig:
        mk = self.model_kwargs
        if self.speculative and mk.speculative_draft is None:
            raise ServeConfigError(
                f"'model_kwargs.speculative_tokens' is {mk.speculative_tokens} but 'model_kwargs.speculative_draft' "
                "is not set: give the DSpark draft checkpoint directory, or set speculative_tokens to 0"
            )
        if self.tp_size % mk.moe_ep_size:
            raise ServeConfigError(
                f"'model_kwargs.moe_ep_size' ({mk.moe_ep_size}) must divide 'tp_size' ({self.tp_size}): the ranks "
                "form moe_ep_size expert-parallel groups of equal size"
            )
        return self


# --- checks that relate keys to each other ----------------------------------------------------------


def _check_scheduler(cfg: EngineConfig) -> None:
    s = cfg.scheduler
    if s.max_num_batched_tokens < s.max_num_seqs:
        raise ServeConfigError(
            f"'scheduler.max_num_batched_tokens' ({s.max_num_batched_tokens}) must be >= "
            f"'scheduler.max_num_seqs' ({s.max_num_seqs}): a full decode batch takes one token per request"
        )
    if not s.chunked_prefill and s.max_num_batched_tokens < cfg.max_seq_len:
        raise ServeConfigError(
            f"'scheduler.max_num_batched_tokens' ({s.max_num_batched_tokens}) must be >= 'max_seq_len' "
            f"({cfg.max_seq_len}) when 'scheduler.chunked_prefill' is false: a prompt then prefills in one step"
        )


def _check_pools(cfg: EngineConfig) -> None:
    r, s = cfg.resources, cfg.scheduler
    if r.kda_state.max_slots <= s.max_num_seqs:
        raise ServeConfigError(
            f"'resources.kda_state.max_slots' ({r.kda_state.max_slots}) must be > 'scheduler.max_num_seqs' "
            f"({s.max_num_seqs}): slot 0 is the sink for padding rows, so set it to at least {s.max_num_seqs + 1}"
        )
    page = r.mla_kv.page_size
    pools = [("resources.mla_kv.max_num_pages", r.mla_kv.max_num_pages)]
    if r.dspark_kv is not None or cfg.speculative:
        pools.append(("resources.dspark_kv.max_num_pages", cfg.dspark_kv_pages))
    interval = cfg.prefix_cache.kda_snapshot_interval
    if cfg.prefix_cache.enabled and interval % page:
        raise ServeConfigError(
            f"'prefix_cache.kda_snapshot_interval' ({interval}) must be a multiple of 'resources.mla_kv.page_size' "
            f"({page}): a snapshot is keyed by the page it ends at; try {max(page, interval // page * page)}"
        )
    needed = 1 + -(-cfg.max_seq_len // page)  # page 0 is the sink: it holds no request's tokens
    for key, pages in pools:
        if pages < needed:
            raise ServeConfigError(
                f"'{key}' ({pages} pages of {page} tokens, page 0 the sink: {(pages - 1) * page} tokens) cannot hold "
                f"one request of 'max_seq_len' ({cfg.max_seq_len}) tokens; it needs at least {needed} pages"
            )


def _check_speculation(cfg: EngineConfig) -> None:
    mk = cfg.model_kwargs
    k = mk.speculative_tokens
    for bucket, drafts in mk.speculative_schedule:
        if not 0 <= drafts <= k:
            raise ServeConfigError(
                f"'model_kwargs.speculative_schedule': bucket {bucket} maps to {drafts}; drafts per row must be "
                f"in 0..'model_kwargs.speculative_tokens' ({k})"
            )
    if mk.speculative_schedule and mk.speculative_schedule[-1][0] < cfg.scheduler.max_num_seqs:
        raise ServeConfigError(
            f"'model_kwargs.speculative_schedule': the largest bucket ({mk.speculative_schedule[-1][0]}) must "
            f"cover 'scheduler.max_num_seqs' ({cfg.scheduler.max_num_seqs})"
        )
    budget = cfg.scheduler.max_num_batched_tokens
    rows, tokens = _largest_decode_step(cfg)
    if tokens > budget:
        raise ServeConfigError(
            f"'scheduler.max_num_batched_tokens' ({budget}) cannot hold a decode step of {rows} rows with "
            f"{tokens // rows - 1} drafts each ({tokens} tokens); raise it or lower 'model_kwargs.speculative_tokens' "
            "/ 'model_kwargs.speculative_schedule'"
        )


def _largest_decode_step(cfg: EngineConfig) -> tuple[int, int]:
    """(rows, tokens) of the decode step with the most tokens: every row carries its drafts."""
    mk, max_rows = cfg.model_kwargs, cfg.scheduler.max_num_seqs
    if not mk.speculative_schedule:
        return max_rows, max_rows * (1 + mk.speculative_tokens)
    steps = []
    for bucket, drafts in mk.speculative_schedule:
        rows = min(bucket, max_rows)
        steps.append((rows, rows * (1 + drafts)))
    return max(steps, key=lambda step: step[1])


def check_expert_parallel(cfg: ServeConfig, num_experts: int) -> None:
    """Raise ServeConfigError, naming the key, unless moe_ep_size splits the checkpoint's experts evenly."""
    ep = cfg.model_kwargs.moe_ep_size
    if num_experts % ep:
        raise ServeConfigError(
            f"'model_kwargs.moe_ep_size' ({ep}) must divide the checkpoint's num_experts ({num_experts}): "
            "each expert-parallel group owns num_experts / moe_ep_size whole experts"
        )


# --- the environment --------------------------------------------------------------------------------

DEFAULT_PROFILE_START, DEFAULT_PROFILE_COUNT = 10, 5


class ProfileWindow(BaseModel):
    """`MSTAR_TORCH_PROFILE=DIR[:START[:COUNT]]`: trace engine steps START .. START+COUNT-1 into DIR."""

    model_config = ConfigDict(frozen=True)

    directory: Path
    start: int = Field(DEFAULT_PROFILE_START, ge=0)  # past the first steps, which compile kernels and warm allocators
    count: int = Field(DEFAULT_PROFILE_COUNT, ge=1)


def _to_profile_window(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    directory, *numbers = value.split(":")
    if len(numbers) > 2 or not directory or not all(n.strip().isdigit() for n in numbers):
        raise _Problem(f"={value!r}: expected DIR[:START[:COUNT]] with whole numbers, e.g. /tmp/prof:10:5")
    start, count = ([int(n) for n in numbers] + [DEFAULT_PROFILE_START, DEFAULT_PROFILE_COUNT][len(numbers):])[:2]
    if count < 1:
        raise _Problem(f"={value!r}: COUNT must be >= 1")
    return ProfileWindow(directory=Path(directory), start=start, count=count)


def _to_threshold(value: Any) -> Any:
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and text.isdigit():
        return int(text)
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    raise _Problem(f"must be a non-negative integer (steps of more tokens run the MoE as bf16 grouped GEMMs), "
                   f"got {value!r}")


def _to_env_api_keys(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    keys = [k.strip() for k in value.split(",") if k.strip()]
    for i, key in enumerate(keys):
        problem = api_key_problem(key)
        if problem:
            raise _Problem(problem, suffix=f" entry {i + 1}")
    return tuple(keys)


class Environment(BaseModel):
    """Every environment variable mstar reads (each field's alias is the variable), read once at startup
    by `Environment.read()` and passed down as values. Not YAML keys: they choose how a process runs
    (profiling, test faults, secrets, a kernel threshold), not what it serves."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True, validate_by_alias=True)

    # Steps of more tokens than this run the routed experts as bf16 grouped GEMMs on weights dequantized
    # once per layer (kernels/moe_bf16.py; sm_90 only); fewer run the MXFP4 kernel.
    moe_bf16_tokens: Annotated[int, BeforeValidator(_to_threshold)] = Field(6144, alias="MSTAR_MOE_BF16_TOKENS")
    # A torch.profiler trace of a window of engine steps (engine/profiling.py). Off unless set.
    torch_profile: Annotated[ProfileWindow | None, BeforeValidator(_to_profile_window)] = Field(
        None, alias="MSTAR_TORCH_PROFILE")
    # Test-only fault injection (engine/faults.py spells the entries). Off unless set.
    fault_inject: str | None = Field(None, alias="MSTAR_FAULT_INJECT")
    # API keys (comma-separated), accepted besides server.api_keys and --api-key; kept out of the process list.
    api_keys: Annotated[tuple[str, ...], BeforeValidator(_to_env_api_keys)] = Field((), alias="MSTAR_API_KEY")
    # torchrun's rendezvous, as job schedulers set it (mstar/distributed/rendezvous.py parses and checks
    # them; mstar-serve's --nnodes, --node-rank, ... flags win over them).
    master_addr: str | None = Field(None, alias="MASTER_ADDR")
    master_port: str | None = Field(None, alias="MASTER_PORT")
    nnodes: str | None = Field(None, alias="NNODES")
    world_size: str | None = Field(None, alias="WORLD_SIZE")
    local_world_size: str | None = Field(None, alias="LOCAL_WORLD_SIZE")
    node_rank: str | None = Field(None, alias="NODE_RANK")
    group_rank: str | None = Field(None, alias="GROUP_RANK")

    def rendezvous(self) -> dict[str, str]:
        """torchrun's variables that are set, by their names (what `resolve_rendezvous` reads)."""
        names = ("master_addr", "master_port", "nnodes", "world_size", "local_world_size", "node_rank", "group_rank")
        fields = type(self).model_fields
        return {fields[name].alias: getattr(self, name) for name in names if getattr(self, name) is not None}

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Environment:
        """The variables from `environ` (default: the process environment); an empty one counts as unset."""
        environ = os.environ if environ is None else environ
        names = [info.alias for info in cls.model_fields.values()]
        try:
            return cls.model_validate({name: environ[name] for name in names if environ.get(name)})
        except ValidationError as e:
            problem = e.errors()[0]
            cause = (problem.get("ctx") or {}).get("error")
            name = problem["loc"][0]
            if isinstance(cause, _Problem):
                space = "" if cause.message.startswith("=") else " "
                raise ServeConfigError(f"{name}{cause.suffix}{space}{cause.message}") from None
            raise ServeConfigError(f"{name}={environ.get(name)!r}: {problem['msg']}") from None


NO_ENV = Environment()  # every variable unset: the defaults (tests, tools that take no environment)


# --- loading ----------------------------------------------------------------------------------------


def load_serve_config(path: str | Path, overrides: Sequence[str] = ()) -> ServeConfig:
    """Read the YAML at `path`, apply `overrides` (`key.sub=value`), validate, return the config."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ServeConfigError(f"no serve config at {path}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ServeConfigError(f"{path} is not valid YAML: {e}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ServeConfigError(f"{path} must hold a mapping of config keys, got {type(raw).__name__}")
    try:
        raw = _absolute_paths(raw, path.absolute().parent)
        return parse_serve_config(apply_overrides(raw, overrides))
    except ServeConfigError as e:
        raise ServeConfigError(f"{path}: {e}") from None


def parse_serve_config(raw: Mapping[str, Any], base_dir: str | Path | None = None) -> ServeConfig:
    """Build and validate a ServeConfig from a mapping (a YAML file's content). Relative paths
    resolve against `base_dir` (default: the working directory)."""
    return _validated(ServeConfig, raw, Path(base_dir or Path.cwd()))


def _validated(cls: type[EngineConfig], raw: Mapping[str, Any], base: Path) -> Any:
    if not isinstance(raw, Mapping):
        raise ServeConfigError(f"a serve config must be a mapping of keys, got {type(raw).__name__}")
    try:
        cfg = cls.model_validate(_absolute_paths(raw, base.absolute()))
    except ValidationError as e:
        raise ServeConfigError(_first_problem(e)) from None
    return cfg._with_derived_defaults()


def _path_keys(cls: type[BaseModel], where: str = "") -> list[str]:
    """The dotted keys whose values are paths (they resolve against the YAML file's folder)."""
    keys = []
    for name, info in cls.model_fields.items():
        section = _section_class(info.annotation)
        if section is not None:
            keys += _path_keys(section, _dotted(where, name))
        elif _holds_path(info.annotation):
            keys.append(_dotted(where, name))
    return keys


def _holds_path(hint: Any) -> bool:
    return hint is Path or any(_holds_path(arg) for arg in get_args(hint))


def _absolute_paths(raw: Mapping[str, Any], base: Path) -> dict[str, Any]:
    out = copy.deepcopy(dict(raw))
    for dotted in _PATH_KEYS:
        *parents, leaf = dotted.split(".")
        holder: Any = out
        for part in parents:
            holder = holder.get(part) if isinstance(holder, dict) else None
        if isinstance(holder, dict) and isinstance(holder.get(leaf), str | Path) and holder[leaf]:
            holder[leaf] = str(Path(os.path.normpath(base / Path(holder[leaf]).expanduser())))
    return out


# --- errors -----------------------------------------------------------------------------------------

_EXPECTED = {
    "int_type": "must be an integer",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "model_type": "must be a mapping of keys",
    "dict_type": "must be a mapping of keys",
}


def _first_problem(error: ValidationError) -> str:
    """One message for a failed validation, naming the key: an unknown key first (a misspelt key
    leaves its value at the default, which may be what fails next), else the first problem."""
    problems = error.errors()
    unknown = [p for p in problems if p["type"] == "extra_forbidden"]
    return _message(unknown[0] if unknown else problems[0])


def _message(problem: Mapping[str, Any]) -> str:
    loc = [str(part) for part in problem["loc"]]
    key, kind, value = ".".join(loc), problem["type"], problem.get("input")
    ctx = problem.get("ctx") or {}
    if kind == "extra_forbidden":
        where = ".".join(loc[:-1])
        return _unknown_key_error(where, loc[-1], _level(where)).args[0]
    if kind == "missing":
        return f"the required key '{key}' is missing"
    if kind == "value_error":
        cause = ctx["error"]
        if isinstance(cause, _Problem):
            space = "" if cause.message.startswith(":") else " "
            return f"'{key}{cause.suffix}'{space}{cause.message}"
        return str(cause)  # a check that relates keys names them itself
    if value is None:
        return f"'{key}' must be set, got null"
    if kind in _EXPECTED:
        return f"'{key}' {_EXPECTED[kind]}, got {_shown(value)}"
    if kind == "literal_error":
        return f"'{key}' must be one of {ctx['expected']}, got {value!r}"
    if kind == "greater_than_equal":
        return f"'{key}' must be >= {ctx['ge']}, got {value}"
    if kind == "less_than_equal":
        return f"'{key}' must be <= {ctx['le']}, got {value}"
    return f"'{key}': {problem['msg']} (got {_shown(value)})"


# --- overrides --------------------------------------------------------------------------------------


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `raw` with each `key.sub=value` override set. Values parse as YAML (scalars, flow
    mappings such as `{16: 7, 64: 0}`, `null`); an override replaces the whole value at its key."""
    if isinstance(overrides, str):
        raise TypeError("overrides is a sequence of 'key=value' strings, not one string")
    out = copy.deepcopy(dict(raw))
    for text in overrides:
        key, sep, value_text = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ServeConfigError(f"override {text!r} must look like key.sub=value, e.g. scheduler.max_num_seqs=8")
        try:
            _check_known_key(key)
        except ServeConfigError as e:
            raise ServeConfigError(f"override {text!r}: {e}") from None
        try:
            value = yaml.safe_load(value_text)
        except yaml.YAMLError as e:
            raise ServeConfigError(f"override {text!r}: the value for '{key}' is not valid YAML: {e}") from None
        _set_dotted(out, key, value)
    return out


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    holder = raw
    for i, part in enumerate(parents):
        child = holder.get(part)
        if child is None:
            child = holder[part] = {}
        if not isinstance(child, dict):
            section = ".".join(parents[: i + 1])
            raise ServeConfigError(f"cannot set '{key}': '{section}' holds {child!r}, not a mapping")
        holder = child
    holder[leaf] = value


# --- the schema as key names, for checks and suggestions --------------------------------------------


def _section_class(hint: Any) -> type[BaseModel] | None:
    """The section model a field holds (also through `X | None`), or None for a plain value."""
    for candidate in (hint, *getattr(hint, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, _Section):
            return candidate
    return None


def _key_tree(cls: type[BaseModel]) -> dict[str, Any]:
    """{key: subtree} for sections, {key: None} for values."""
    tree: dict[str, Any] = {}
    for name, info in cls.model_fields.items():
        section = _section_class(info.annotation)
        tree[name] = _key_tree(section) if section else None
    return tree


def _dotted(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _all_keys(tree: Mapping[str, Any], where: str = "") -> list[str]:
    keys = []
    for key, sub in tree.items():
        keys.append(_dotted(where, key))
        if sub:
            keys += _all_keys(sub, _dotted(where, key))
    return keys


_KEY_TREE = _key_tree(ServeConfig)
_ALL_KEYS = _all_keys(_KEY_TREE)
_PATH_KEYS = _path_keys(ServeConfig)


def known_keys() -> list[str]:
    """Every dotted key a serve config may set (sections included)."""
    return list(_ALL_KEYS)


def _level(where: str) -> Mapping[str, Any]:
    level = _KEY_TREE
    for part in where.split(".") if where else ():
        level = level[part]
    return level


def _unknown_key_error(where: str, key: str, level: Mapping[str, Any]) -> ServeConfigError:
    return ServeConfigError(
        f"unknown key '{_dotted(where, key)}'{_suggestion(where, str(key), level)}; "
        f"known keys{' under ' + repr(where) if where else ''}: {', '.join(level)}"
    )


def _suggestion(where: str, key: str, level: Mapping[str, Any]) -> str:
    # The same name in another section (max_num_seqs written at the top level) is the likeliest slip.
    elsewhere = [k for k in _ALL_KEYS if k.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f" (did you mean '{elsewhere[0]}'?)"
    close = difflib.get_close_matches(key, list(level), n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{_dotted(where, close[0])}'?)"
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in _ALL_KEYS}
    close = difflib.get_close_matches(key, list(by_leaf), n=1, cutoff=0.6)
    return f" (did you mean '{by_leaf[close[0]]}'?)" if close else ""


def _check_known_key(key: str) -> None:
    level: Mapping[str, Any] | None = _KEY_TREE
    where = ""
    for part in key.split("."):
        if level is None:
            raise ServeConfigError(f"'{where}' is a single value with no sub-keys; set '{where}=...' whole")
        if part not in level:
            raise _unknown_key_error(where, part, level)
        level, where = level[part], _dotted(where, part)


# --- runtime resolution -----------------------------------------------------------------------------


def resolve_device(cfg: ServeConfig) -> str:
    """"cuda" or "cpu": `auto` picks CUDA when torch sees a GPU; `cuda` without one is an error."""
    import torch

    available = torch.cuda.is_available()
    if cfg.device == "auto":
        return "cuda" if available else "cpu"
    if cfg.device == "cuda" and not available:
        raise ServeConfigError("'device' is 'cuda' but torch sees no CUDA GPU; set device=cpu or device=auto")
    return cfg.device


def torch_dtype(name: Dtype) -> torch.dtype:
    """The torch dtype a `dtype` key names."""
    import torch

    return getattr(torch, name)


def check_paths(cfg: ServeConfig) -> None:
    """Raise ServeConfigError, naming the key, when a checkpoint directory the config needs is missing."""
    needed = [("checkpoint", cfg.checkpoint)]
    if cfg.speculative:
        needed.append(("model_kwargs.speculative_draft", cfg.model_kwargs.speculative_draft))
    for key, path in needed:
        if not path.is_dir():
            hint = " (write the tiny checkpoints with `mstar-make-tiny checkpoints/`)" if "tiny" in path.name else ""
            raise ServeConfigError(f"'{key}': no checkpoint directory at {path}{hint}")
