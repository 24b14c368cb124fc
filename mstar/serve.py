"""`mstar-serve --config FILE`: load a checkpoint, start the engine thread, serve the OpenAI API.

    mstar-serve --config configs/kimi_k3_tiny.yaml --port 8000 [key.sub=value ...]

The tiny configs point at `checkpoints/kimi_k3_tiny`, which is written (deterministically) on first
use if it is missing. SIGTERM or Ctrl-C drains: open requests finish, new ones are refused, then
the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import uvicorn

from mstar.config import ServeConfig, ServeConfigError, check_paths, load_serve_config, resolve_device
from mstar.engine.async_engine import AsyncEngine
from mstar.engine.core import EngineConfig, EngineCore, SpeculativeConfig
from mstar.engine.scheduler import SchedulerConfig

log = logging.getLogger("mstar.serve")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}
TINY_NAMES = ("kimi_k3_tiny",)
TENSOR_COMM_PROTOCOLS = ("SHM", "TCP", "NCCL", "GLOO")


class DrainingServer(uvicorn.Server):
    """uvicorn drains open requests on SIGTERM/SIGINT, then re-raises the signal so the process dies
    by it; an orderly drain is a normal exit for mstar-serve, so it returns instead."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def ensure_tiny_checkpoint(cfg: ServeConfig) -> None:
    """Write the deterministic tiny checkpoints if a tiny config points at a folder that is missing."""
    draft = cfg.model_kwargs.speculative_draft
    missing = not cfg.checkpoint.exists() or (draft is not None and not draft.exists())
    if not missing or cfg.checkpoint.name not in TINY_NAMES:
        return
    from mstar.tools.make_tiny import write_tiny

    log.info("writing the tiny checkpoints into %s (first use)", cfg.checkpoint.parent)
    write_tiny(cfg.checkpoint.parent)


def engine_config(cfg: ServeConfig, speculative: SpeculativeConfig | None = None) -> EngineConfig:
    s = cfg.scheduler
    return EngineConfig(
        max_seq_len=cfg.max_seq_len,
        page_size=cfg.resources.mla_kv.page_size,
        max_num_pages=cfg.resources.mla_kv.max_num_pages,
        max_kda_slots=cfg.resources.kda_state.max_slots,
        scheduler=SchedulerConfig(
            max_num_seqs=s.max_num_seqs,
            max_prefill_seqs=s.max_prefill_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            chunked_prefill=s.chunked_prefill,
            mixed_prefill_decode=cfg.model_kwargs.mixed_prefill_decode,
        ),
        speculative=speculative,
    )


def speculative_config(cfg: ServeConfig, dtype: torch.dtype, device: str) -> SpeculativeConfig | None:
    kw = cfg.model_kwargs
    if not kw.speculative_tokens:
        return None
    from mstar.models.dspark.model import K3DSparkModel

    log.info("loading the DSpark draft %s (k=%d, schedule %s)", kw.speculative_draft, kw.speculative_tokens,
             dict(kw.speculative_schedule) or "none")
    draft = K3DSparkModel.from_checkpoint(kw.speculative_draft, dtype=dtype).to(device)
    pages = cfg.resources.dspark_kv.max_num_pages if cfg.resources.dspark_kv else None
    return SpeculativeConfig(draft=draft, speculative_tokens=kw.speculative_tokens,
                             schedule=tuple(kw.speculative_schedule), max_num_pages=pages)


def build_engine(cfg: ServeConfig, *, progress: bool | None = None) -> AsyncEngine:
    from mstar.models.kimi_k3.tokenizer import KimiTokenizer
    from mstar.models.kimi_k3.weights import load_model

    if cfg.tp_size != 1:
        raise ServeConfigError(f"tp_size={cfg.tp_size}: tensor parallelism is not available yet; use tp_size: 1")
    ensure_tiny_checkpoint(cfg)
    check_paths(cfg)
    device = resolve_device(cfg)
    log.info("loading %s (%s on %s)", cfg.checkpoint, cfg.dtype, device)
    model = load_model(cfg.checkpoint, dtype=_DTYPES[cfg.dtype], device=device, progress=progress)
    tokenizer = KimiTokenizer.from_dir(cfg.checkpoint)
    core = EngineCore(model, tokenizer, engine_config(cfg, speculative_config(cfg, _DTYPES[cfg.dtype], device)))
    return AsyncEngine(core, cfg.served_model_name).start()


def serve_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="mstar-serve", description="Serve Kimi K3 behind an OpenAI-compatible API.")
    p.add_argument("--config", required=True, type=Path, help="serve config YAML (see configs/)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-comm-protocol", default="SHM", type=str.upper, choices=TENSOR_COMM_PROTOCOLS,
                   help="how tensor-parallel ranks exchange tensors (SHM = one node)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. scheduler.max_num_seqs=8")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        cfg = load_serve_config(args.config, args.overrides)
        engine = build_engine(cfg, progress=True)
    except (ServeConfigError, ValueError, FileNotFoundError) as e:
        print(f"mstar-serve: {e}", file=sys.stderr)
        raise SystemExit(2) from None

    from mstar.server.app import build_app

    app = build_app(engine, served_model_name=cfg.served_model_name)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=120))
    try:
        server.run()
    finally:
        engine.shutdown()
    log.info("drained and stopped")


if __name__ == "__main__":
    serve_main()
