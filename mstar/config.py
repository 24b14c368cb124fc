"""Serve configuration: a YAML file plus `key.sub=value` overrides, parsed into a typed, immutable
`ServeConfig` and validated as a whole before anything is allocated.

The dataclasses below are the schema: each field is one YAML key, its type hint is the type the
key must have, its default applies when the key is absent, and its comment says what it means.
Parsing walks the dataclasses, so a key cannot be known to the parser but missing from the
schema. Every error names the full dotted key (`scheduler.max_num_seqs`) and what is expected.

Relative paths (`checkpoint`, `model_kwargs.speculative_draft`) resolve against the folder of the
YAML file that holds them; relative paths given as overrides resolve against the working directory,
where the command line was typed. A checkpoint need not exist when the config is loaded (the tiny
configs point at `checkpoints/`, which `mstar-make-tiny checkpoints/` fills); `check_paths` says
what is missing when the server is about to load it.
"""

from __future__ import annotations

import copy
import difflib
import os
import types
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml


class ServeConfigError(ValueError):
    """A serve config (YAML key or override) that mstar cannot run; the message names the key."""


ModelName = Literal["kimi_k3"]  # the model registry: keys mstar knows how to build
Dtype = Literal["float32", "bfloat16", "float16", "float64"]
Device = Literal["cpu", "cuda", "auto"]
# (batch bucket, drafts per row) pairs in increasing bucket order; written in YAML as a mapping.
DraftSchedule = tuple[tuple[int, int], ...]

_PATH_KEYS = ("checkpoint", "model_kwargs.speculative_draft")


# --- schema -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MlaKvConfig:
    """`resources.mla_kv`: the paged latent KV of the MLA layers (one pool per rank)."""

    page_size: int = 64  # tokens per page
    max_num_pages: int = 1792  # pages in the pool; must hold at least one max_seq_len request


@dataclass(frozen=True)
class KdaStateConfig:
    """`resources.kda_state`: per-request recurrent state of the KDA layers (state + conv window)."""

    # Slots in the pool. Slot 0 is a sink that padding rows of a captured batch write into, so at
    # most max_slots - 1 requests run at once: must exceed scheduler.max_num_seqs.
    max_slots: int = 65


@dataclass(frozen=True)
class DSparkKvConfig:
    """`resources.dspark_kv`: the paged latent KV of the DSpark draft's layers."""

    # Pages in the draft's pool; the page size is resources.mla_kv.page_size. When the section is
    # absent and speculation is on, it gets as many pages as resources.mla_kv.
    max_num_pages: int = 1792


@dataclass(frozen=True)
class ResourcesConfig:
    """`resources`: how large each per-request resource pool is."""

    mla_kv: MlaKvConfig = field(default_factory=MlaKvConfig)
    kda_state: KdaStateConfig = field(default_factory=KdaStateConfig)
    dspark_kv: DSparkKvConfig | None = None  # draft KV; None when speculation is off


@dataclass(frozen=True)
class SchedulerConfig:
    """`scheduler`: continuous batching limits."""

    max_num_seqs: int = 64  # requests running at once = the largest decode batch
    # Requests that prefill (a chunk of) their prompt in one step; a prefilling request is running,
    # so max_num_seqs also caps it (not an error, so that overriding max_num_seqs alone works).
    max_prefill_seqs: int = 8
    # Tokens one step may run: prefill chunks plus decode rows (each row with its drafts).
    max_num_batched_tokens: int = 8192
    # Split prompts longer than the token budget over several steps. Off: a prompt prefills in one
    # step, so the budget must hold max_seq_len tokens.
    chunked_prefill: bool = True
    # Requests queued for admission. The server admits at most max_num_seqs + max_waiting engine
    # requests (one per choice) at once and answers 429 with Retry-After beyond that.
    max_waiting: int = 1024


ApiKeys = tuple[str, ...]


@dataclass(frozen=True)
class ServerSection:
    """`server`: the HTTP front end's access control and per-request limits (see README, Operating)."""

    # Bearer keys accepted on every /v1/* route (any one of them). Empty: no key needed, unless
    # `mstar-serve --api-key` or the MSTAR_API_KEY environment variable gives some (all are merged).
    # Prefer the environment variable: a key in a config file or on a command line is easier to leak.
    api_keys: ApiKeys = ()
    protect_health: bool = False  # GET /health needs a key too (when keys are set); default open for probes
    protect_metrics: bool = False  # GET /metrics needs a key too (when keys are set)
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies are refused with 413
    max_n: int = 16  # choices per prompt (`n`); more is a 400
    max_tokens: int = 0  # cap on max_tokens / max_completion_tokens (also the omitted default); 0: the context
    retry_after_s: int = 1  # the Retry-After header of a 429 (engine requests beyond the waiting queue)
    # Consecutive failed engine steps after which the engine gives up: mstar-serve then exits with
    # status 3 (for a supervisor to restart it). A single failed step fails the requests in flight
    # with an error and the server goes on.
    max_step_failures: int = 3
    log_requests: bool = False  # log each request's prompt and parameters (never logged otherwise)
    max_headers: int = 100  # requests with more headers are refused with 431
    max_url_bytes: int = 8 * 1024  # a longer request path plus query string is refused with 414
    body_timeout_s: float = 30.0  # a request body must arrive whole within this long, else 408 (slow clients)
    keep_alive_timeout_s: int = 5  # an idle keep-alive connection is closed after this long (uvicorn's default)
    # Largest request line plus headers one request may send (h11's incomplete-event limit); more is
    # refused and the connection closed. nginx's default allows 4 x 8 KiB header buffers.
    max_header_bytes: int = 32 * 1024


@dataclass(frozen=True)
class ModelKwargs:
    """`model_kwargs`: choices fixed at server start (baked into weights layout and graph captures)."""

    speculative_tokens: int = 0  # k: DSpark drafts per verify step; 0 turns speculation off
    speculative_draft: Path | None = None  # DSpark draft checkpoint directory; required when k > 0
    # Drafts per row by decode batch bucket, e.g. {16: 7, 32: 4, 64: 0}: a batch of n rows uses the
    # smallest bucket >= n. Values are in 0..speculative_tokens; the largest bucket must cover
    # scheduler.max_num_seqs. Empty: speculative_tokens drafts at every batch size.
    speculative_schedule: DraftSchedule = ()
    mixed_prefill_decode: bool = True  # run prefill chunks and decode rows in the same step
    # Decode and verify steps of 1..64 sequences and prefill steps (up to 8 prompts, token buckets up to 8192)
    # replay CUDA graphs captured at startup (no effect on CPU). Startup fails, naming what is in the way,
    # when the model's steps cannot be captured (engine/cuda_graphs.py): set it false there.
    cuda_graphs: bool = True
    # Plan and launch each step while the one before runs on the device (engine/core.py): the host's
    # scheduling, detokenizing and stop checks hide behind the GPU. Speculative steps run synchronously
    # either way; false: every step finishes before the next is planned (for comparison). Unset: on for
    # CUDA devices (on a CPU every op runs at once, so nothing would overlap).
    async_scheduling: bool | None = None
    # Expert-parallel groups among the tp_size ranks (>= 1; must divide tp_size and the checkpoint's
    # num_experts). Group g of tp_size / moe_ep_size consecutive ranks owns experts g*E/ep .. (g+1)*E/ep - 1,
    # split over its ranks by intermediate dim. 1: pure TP (every rank holds a slice of every expert);
    # = tp_size: pure EP (whole experts). Per-rank expert memory is the same either way; see
    # mstar/distributed/expert_sharding.py and docs/multi_node.md.
    moe_ep_size: int = 1

    @property
    def max_drafts(self) -> int:
        """The most drafts any row can carry; sizes verify buffers and per-row state."""
        if not self.speculative_schedule:
            return self.speculative_tokens
        return max(drafts for _, drafts in self.speculative_schedule)

    def drafts_for_batch(self, num_rows: int) -> int:
        """Drafts per row for a decode batch of `num_rows` rows."""
        if not self.speculative_schedule:
            return self.speculative_tokens
        for bucket, drafts in self.speculative_schedule:
            if num_rows <= bucket:
                return drafts
        raise ValueError(f"a decode batch of {num_rows} rows is above every speculative_schedule bucket")


@dataclass(frozen=True)
class ServeConfig:
    """One served model: what to load, where to run it, and how large its pools and batches are."""

    model: ModelName  # registry key of the model implementation
    checkpoint: Path  # HF checkpoint directory (absolute once parsed)
    tp_size: int = 1  # tensor-parallel ranks, one per GPU (gloo processes on CPU)
    max_seq_len: int = 8192  # longest request, prompt plus output, in tokens
    dtype: Dtype = "bfloat16"  # activations and unquantized weights
    device: Device = "auto"  # "auto": CUDA when available, else CPU
    served_model_name: str = ""  # name in /v1/models and responses (default: the checkpoint folder's name)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    model_kwargs: ModelKwargs = field(default_factory=ModelKwargs)
    server: ServerSection = field(default_factory=ServerSection)

    @property
    def speculative(self) -> bool:
        return self.model_kwargs.speculative_tokens > 0

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON-ready values (paths as strings, the schedule as a mapping), for logging.
        `parse_serve_config(cfg.to_dict()) == cfg`."""
        return _plain(self)

    def with_overrides(self, *overrides: str) -> ServeConfig:
        """A copy with `key.sub=value` overrides applied and validated again."""
        return parse_serve_config(apply_overrides(self.to_dict(), overrides))


def _plain(value: Any) -> Any:
    if is_dataclass(value):
        return {f.name: _plain_field(f.name, getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def _plain_field(name: str, value: Any) -> Any:
    if name == "speculative_schedule":
        return dict(value)
    return _plain(value)


# --- loading ----------------------------------------------------------------------------------


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
    if not isinstance(raw, Mapping):
        raise ServeConfigError(f"a serve config must be a mapping of keys, got {type(raw).__name__}")
    raw = _absolute_paths(raw, Path(base_dir or Path.cwd()).absolute())
    cfg = _build(ServeConfig, raw, "")
    cfg = _fill_defaults(cfg)
    validate(cfg)
    return cfg


def _fill_defaults(cfg: ServeConfig) -> ServeConfig:
    """Defaults that depend on other keys."""
    if not cfg.served_model_name:
        cfg = replace(cfg, served_model_name=cfg.checkpoint.name)
    if cfg.speculative and cfg.resources.dspark_kv is None:
        pages = DSparkKvConfig(max_num_pages=cfg.resources.mla_kv.max_num_pages)
        cfg = replace(cfg, resources=replace(cfg.resources, dspark_kv=pages))
    return cfg


def _absolute_paths(raw: Mapping[str, Any], base: Path) -> dict[str, Any]:
    out = copy.deepcopy(dict(raw))
    for dotted in _PATH_KEYS:
        *parents, leaf = dotted.split(".")
        holder: Any = out
        for part in parents:
            holder = holder.get(part) if isinstance(holder, dict) else None
        if isinstance(holder, dict) and isinstance(holder.get(leaf), str | Path):
            holder[leaf] = str(Path(os.path.normpath(base / Path(holder[leaf]).expanduser())))
    return out


# --- overrides --------------------------------------------------------------------------------


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


# --- the schema as key names, for checks and suggestions --------------------------------------


def _section_class(hint: Any) -> type | None:
    """The dataclass a field holds (also through `X | None`), or None for a plain value."""
    for candidate in (hint, *get_args(hint)):
        if isinstance(candidate, type) and is_dataclass(candidate):
            return candidate
    return None


def _key_tree(cls: type) -> dict[str, Any]:
    """{key: subtree} for sections, {key: None} for values."""
    hints = get_type_hints(cls)
    tree: dict[str, Any] = {}
    for f in fields(cls):
        section = _section_class(hints[f.name])
        tree[f.name] = _key_tree(section) if section else None
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


def known_keys() -> list[str]:
    """Every dotted key a serve config may set (sections included)."""
    return list(_ALL_KEYS)


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


# --- typed parsing ----------------------------------------------------------------------------


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ServeConfigError(f"'{where or 'config'}' must be a mapping of keys, got {type(raw).__name__} ({raw!r})")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for key in raw:
        if key not in known:
            raise _unknown_key_error(where, key, _key_tree(cls))
    values = {}
    for f in fields(cls):
        key = _dotted(where, f.name)
        if f.name in raw:
            values[f.name] = _convert(hints[f.name], raw[f.name], key)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ServeConfigError(f"the required key '{key}' is missing")
    return cls(**values)


def _convert(hint: Any, value: Any, key: str) -> Any:
    options = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        if _section_class(hint) is not None:
            return _section_class(hint)()  # `scheduler:` with every key commented out: the defaults
        raise ServeConfigError(f"'{key}' must be set, got null")
    (hint,) = [t for t in options if t is not type(None)]
    section = _section_class(hint)
    if section is not None:
        return _build(section, value, key)
    if hint == DraftSchedule:
        return _parse_schedule(value, key)
    if hint == ApiKeys:
        return _parse_api_keys(value, key)
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        if value not in choices:
            raise ServeConfigError(f"'{key}' must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if hint is Path:
        if not isinstance(value, str | Path) or not str(value):
            raise ServeConfigError(f"'{key}' must be a directory path, got {type(value).__name__} ({value!r})")
        return Path(value)
    return _scalar(hint, value, key)


_TYPE_WORDS = {bool: "true or false", int: "an integer", str: "a string"}


def _scalar(hint: type, value: Any, key: str) -> Any:
    # bool is a subclass of int: `max_num_seqs: true` must not read as 1.
    ok = isinstance(value, hint) and (hint is bool or not isinstance(value, bool))
    if not ok:
        raise ServeConfigError(f"'{key}' must be {_TYPE_WORDS[hint]}, got {type(value).__name__} ({value!r})")
    return value


def _parse_schedule(value: Any, key: str) -> DraftSchedule:
    if isinstance(value, tuple | list) and all(isinstance(p, tuple | list) and len(p) == 2 for p in value):
        value = dict(value)  # the stored pairs form, as a ServeConfig holds it
    if not isinstance(value, Mapping):
        raise ServeConfigError(
            f"'{key}' must map decode batch buckets to drafts per row, e.g. {{16: 7, 32: 4, 64: 0}}; "
            f"got {type(value).__name__} ({value!r})"
        )
    for bucket, drafts in value.items():
        for what, v in (("bucket", bucket), ("draft count", drafts)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ServeConfigError(f"'{key}': {what} {v!r} must be an integer (in entry {bucket!r}: {drafts!r})")
    return tuple(sorted(value.items()))


def _parse_api_keys(value: Any, key: str) -> ApiKeys:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple):
        raise ServeConfigError(f"'{key}' must be a list of key strings, got {type(value).__name__}")
    for i, item in enumerate(value):
        problem = api_key_problem(item)
        if problem:
            raise ServeConfigError(f"'{key}[{i}]' {problem}")
    return tuple(value)


def api_key_problem(item: Any) -> str | None:
    """What is wrong with an API key (None when it can be used); the key itself is never quoted."""
    if not isinstance(item, str):
        return f"must be a string, got {type(item).__name__}"
    if not item:
        return "is empty; give a non-empty key"
    if any(c.isspace() or c == "," or not c.isprintable() for c in item):
        return "holds whitespace, a comma or an unprintable character; keys are single printable tokens"
    return None


# --- validation -------------------------------------------------------------------------------

_AT_LEAST = {
    "tp_size": 1,
    "max_seq_len": 1,
    "resources.mla_kv.page_size": 1,
    "resources.mla_kv.max_num_pages": 1,
    "resources.kda_state.max_slots": 2,
    "resources.dspark_kv.max_num_pages": 1,
    "scheduler.max_num_seqs": 1,
    "scheduler.max_prefill_seqs": 1,
    "scheduler.max_num_batched_tokens": 1,
    "scheduler.max_waiting": 1,
    "model_kwargs.speculative_tokens": 0,
    "model_kwargs.moe_ep_size": 1,
    "server.max_body_bytes": 1024,
    "server.max_n": 1,
    "server.max_tokens": 0,
    "server.retry_after_s": 1,
    "server.max_step_failures": 1,
}
_AT_MOST = {
    "server.max_n": 128,  # OpenAI's own bound, and what the request schema allows at most
}


def _get(cfg: ServeConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part) if value is not None else None
    return value


def validate(cfg: ServeConfig) -> None:
    """Raise ServeConfigError for out-of-range values and keys that contradict each other."""
    for key, least in _AT_LEAST.items():
        value = _get(cfg, key)
        if value is not None and value < least:
            raise ServeConfigError(f"'{key}' must be >= {least}, got {value}")
    for key, most in _AT_MOST.items():
        value = _get(cfg, key)
        if value is not None and value > most:
            raise ServeConfigError(f"'{key}' must be <= {most}, got {value}")
    _validate_scheduler(cfg)
    _validate_pools(cfg)
    _validate_speculation(cfg)
    _validate_expert_parallel(cfg)


def _validate_expert_parallel(cfg: ServeConfig) -> None:
    ep = cfg.model_kwargs.moe_ep_size
    if cfg.tp_size % ep:
        raise ServeConfigError(
            f"'model_kwargs.moe_ep_size' ({ep}) must divide 'tp_size' ({cfg.tp_size}): the ranks form moe_ep_size "
            "expert-parallel groups of equal size"
        )


def check_expert_parallel(cfg: ServeConfig, num_experts: int) -> None:
    """Raise ServeConfigError, naming the key, unless moe_ep_size splits the checkpoint's experts evenly."""
    ep = cfg.model_kwargs.moe_ep_size
    if num_experts % ep:
        raise ServeConfigError(
            f"'model_kwargs.moe_ep_size' ({ep}) must divide the checkpoint's num_experts ({num_experts}): "
            "each expert-parallel group owns num_experts / moe_ep_size whole experts"
        )


def _validate_scheduler(cfg: ServeConfig) -> None:
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


def _validate_pools(cfg: ServeConfig) -> None:
    r, s = cfg.resources, cfg.scheduler
    if r.kda_state.max_slots <= s.max_num_seqs:
        raise ServeConfigError(
            f"'resources.kda_state.max_slots' ({r.kda_state.max_slots}) must be > 'scheduler.max_num_seqs' "
            f"({s.max_num_seqs}): slot 0 is the sink for padding rows, so set it to at least {s.max_num_seqs + 1}"
        )
    page = r.mla_kv.page_size
    pools = [("resources.mla_kv.max_num_pages", r.mla_kv.max_num_pages)]
    if r.dspark_kv is not None:
        pools.append(("resources.dspark_kv.max_num_pages", r.dspark_kv.max_num_pages))
    for key, pages in pools:
        if pages * page < cfg.max_seq_len:
            raise ServeConfigError(
                f"'{key}' ({pages} pages of {page} tokens = {pages * page}) cannot hold one request of "
                f"'max_seq_len' ({cfg.max_seq_len}) tokens; it needs at least {-(-cfg.max_seq_len // page)} pages"
            )


def _validate_speculation(cfg: ServeConfig) -> None:
    mk = cfg.model_kwargs
    k = mk.speculative_tokens
    if k > 0 and mk.speculative_draft is None:
        raise ServeConfigError(
            f"'model_kwargs.speculative_tokens' is {k} but 'model_kwargs.speculative_draft' is not set: "
            "give the DSpark draft checkpoint directory, or set speculative_tokens to 0"
        )
    for bucket, drafts in mk.speculative_schedule:
        if bucket < 1:
            raise ServeConfigError(f"'model_kwargs.speculative_schedule': bucket {bucket} must be >= 1")
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


def _largest_decode_step(cfg: ServeConfig) -> tuple[int, int]:
    """(rows, tokens) of the decode step with the most tokens: every row carries its drafts."""
    mk, max_rows = cfg.model_kwargs, cfg.scheduler.max_num_seqs
    if not mk.speculative_schedule:
        return max_rows, max_rows * (1 + mk.speculative_tokens)
    steps = []
    for bucket, drafts in mk.speculative_schedule:
        rows = min(bucket, max_rows)
        steps.append((rows, rows * (1 + drafts)))
    return max(steps, key=lambda step: step[1])


# --- runtime resolution -----------------------------------------------------------------------


def resolve_device(cfg: ServeConfig) -> str:
    """"cuda" or "cpu": `auto` picks CUDA when torch sees a GPU; `cuda` without one is an error."""
    import torch

    available = torch.cuda.is_available()
    if cfg.device == "auto":
        return "cuda" if available else "cpu"
    if cfg.device == "cuda" and not available:
        raise ServeConfigError("'device' is 'cuda' but torch sees no CUDA GPU; set device=cpu or device=auto")
    return cfg.device


def check_paths(cfg: ServeConfig) -> None:
    """Raise ServeConfigError, naming the key, when a checkpoint directory the config needs is missing."""
    needed = [("checkpoint", cfg.checkpoint)]
    if cfg.speculative:
        needed.append(("model_kwargs.speculative_draft", cfg.model_kwargs.speculative_draft))
    for key, path in needed:
        if not path.is_dir():
            hint = " (write the tiny checkpoints with `mstar-make-tiny checkpoints/`)" if "tiny" in path.name else ""
            raise ServeConfigError(f"'{key}': no checkpoint directory at {path}{hint}")
