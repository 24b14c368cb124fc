"""`mstar-serve --config FILE`: load a checkpoint, start the engine thread, serve the OpenAI API.

    mstar-serve --config configs/kimi_k3_tiny.yaml --port 8000 [--api-key KEY ...] [--log-requests]
                [key.sub=value ...]

The tiny configs point at `checkpoints/kimi_k3_tiny`, which is written (deterministically) on first
use if it is missing. SIGTERM or Ctrl-C drains: open requests finish, new ones are refused, then
the engine thread stops and the process exits 0.

API keys come from the config's `server.api_keys`, every `--api-key`, and `MSTAR_API_KEY` (comma-
separated), all accepted; the environment is read once, here (`mstar.config.Environment`). A failed
engine step fails the requests in flight and serving goes on; `server.max_step_failures` failures in
a row, or a crash of the engine thread, stop the engine: the server then stops and exits with
status 3 (EXIT_ENGINE_FAILED) after saying why on stderr.
Exit status 2: the config or the command line is wrong, or the HTTP port is in use (the socket is
bound before anything else starts).

Several nodes (docs/multi_node.md): every node runs mstar-serve with the same config and torchrun's
rendezvous (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`, `--nproc-per-node`, or their
environment variables; mstar/distributed/rendezvous.py). Node 0 serves HTTP as above; every other node
starts its ranks and serves nothing (mstar/distributed/launch.py: exit 0 after node 0 stopped them, 3 when
a rank or node 0 failed, 4 when node 0 did not answer within --rendezvous-timeout).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from mstar.config import (
    NO_ENV,
    Environment,
    ServeConfig,
    ServeConfigError,
    api_key_problem,
    check_expert_parallel,
    check_paths,
    load_serve_config,
    resolve_device,
    torch_dtype,
)
from mstar.distributed.rendezvous import Rendezvous, add_rendezvous_args, resolve_rendezvous
from mstar.server.options import ServerOptions

if TYPE_CHECKING:  # the engine (torch) is imported where it is built: a tokenizer worker re-imports this module
    from mstar.engine.async_engine import AsyncEngine
    from mstar.engine.faults import FaultInjector

log = logging.getLogger("mstar.serve")

TINY_NAMES = ("kimi_k3_tiny",)
TENSOR_COMM_PROTOCOLS = ("SHM", "TCP", "NCCL", "GLOO")
API_KEY_ENV = "MSTAR_API_KEY"
EXIT_ENGINE_FAILED = 3


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


def build_engine(cfg: ServeConfig, *, env: Environment = NO_ENV, progress: bool | None = None,
                 faults: FaultInjector | None = None, tensor_comm_protocol: str = "SHM",
                 rendezvous: Rendezvous | None = None) -> AsyncEngine:
    """Load the model and start the engine thread. `faults` (tests only) defaults to what
    `env.fault_inject` (MSTAR_FAULT_INJECT) asks for, when it is set. `rendezvous`: the nodes of a
    tensor-parallel config (default: all its ranks on this one)."""
    from mstar.engine.async_engine import AsyncEngine
    from mstar.engine.core import EngineCore, SpeculativeModels
    from mstar.engine.faults import FaultInjector
    from mstar.models.kimi_k3.tokenizer import KimiTokenizer
    from mstar.models.kimi_k3.weights import load_model

    if faults is None and env.fault_inject:
        faults = FaultInjector.from_spec(env.fault_inject)
        log.warning("fault injection is ON (MSTAR_FAULT_INJECT=%s): for tests only", env.fault_inject)

    ensure_tiny_checkpoint(cfg)
    check_paths(cfg)
    device = resolve_device(cfg)
    if cfg.tp_size > 1:  # one process per rank; this one is rank 0: it schedules, and drafts with speculation
        from mstar.distributed.worker import build_tp_engine
        from mstar.models.kimi_k3.config import load_config

        check_expert_parallel(cfg, load_config(cfg.checkpoint).num_experts)
        return build_tp_engine(cfg, SpeculativeModels.for_config(cfg, device), env=env, device=device,
                               tensor_comm_protocol=tensor_comm_protocol, rendezvous=rendezvous,
                               max_step_failures=cfg.server.max_step_failures, faults=faults)
    log.info("loading %s (%s on %s)", cfg.checkpoint, cfg.dtype, device)
    model = load_model(cfg.checkpoint, dtype=torch_dtype(cfg.dtype), device=device, progress=progress)
    tokenizer = KimiTokenizer.from_dir(cfg.checkpoint)
    core = EngineCore(model, tokenizer, cfg, SpeculativeModels.for_config(cfg, device), env=env)
    return AsyncEngine(core, cfg.served_model_name, max_step_failures=cfg.server.max_step_failures,
                       faults=faults).start()


def api_keys(cfg: ServeConfig, cli_keys: Sequence[str] = (), env: Environment = NO_ENV) -> tuple[str, ...]:
    """Every accepted key: the config's, then `--api-key`s, then MSTAR_API_KEY's (`env.api_keys`), without
    repeats. A malformed one is a ServeConfigError that says where it came from (never the key)."""
    keys = list(cfg.server.api_keys)
    for i, key in enumerate(cli_keys):
        problem = api_key_problem(key)
        if problem:
            raise ServeConfigError(f"--api-key #{i + 1} {problem}")
        keys.append(key)
    return tuple(dict.fromkeys(keys + list(env.api_keys)))


def server_options(cfg: ServeConfig, cli_keys: Sequence[str] = (), log_requests: bool = False,
                   env: Environment = NO_ENV) -> ServerOptions:
    srv, sched = cfg.server, cfg.scheduler
    return ServerOptions(
        api_keys=api_keys(cfg, cli_keys, env),
        protect_health=srv.protect_health,
        protect_metrics=srv.protect_metrics,
        max_body_bytes=srv.max_body_bytes,
        max_n=srv.max_n,
        max_tokens=srv.max_tokens,
        max_in_flight=sched.max_num_seqs + sched.max_waiting,
        retry_after_s=srv.retry_after_s,
        body_timeout_s=srv.body_timeout_s,
        max_headers=srv.max_headers,
        max_url_bytes=srv.max_url_bytes,
        log_requests=srv.log_requests or log_requests,
    )


def connection_settings(cfg: ServeConfig) -> dict:
    """The uvicorn.Config arguments that bound each connection (server/connection.py, and with it h11): the
    header deadline, the header size limit, the keep-alive timeout; a shutdown that does not wait for bodies."""
    from mstar.server.connection import connection_protocol

    srv = cfg.server
    return {"http": connection_protocol(srv.header_timeout_s), "timeout_keep_alive": srv.keep_alive_timeout_s,
            "h11_max_incomplete_event_size": srv.max_header_bytes}


def bind_http_socket(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before any rank, store or engine starts: those take ephemeral ports, and
    one of them could take the port the server is told to serve on. A port in use is a ServeConfigError."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ServeConfigError(f"cannot listen on {host}:{port} ({err.strerror}); choose another --port or stop "
                               "what holds it") from None
    return sock


def serve_other_node(cfg: ServeConfig, rendezvous: Rendezvous) -> int:
    """A node other than 0: its ranks, with node 0's setup. Its checkpoint must exist: only node 0 writes the
    tiny one on first use (two writers on one machine would race)."""
    from mstar.distributed.launch import serve_node

    check_paths(cfg)
    return serve_node(cfg, rendezvous)


def exit_now(status: int) -> None:
    """End the process with `status` once the logs are out, without the interpreter's finalization: after node 0
    is gone, the heartbeat thread can still be inside a TCPStore call, and finalizing under it aborts (SIGABRT
    instead of the status the launcher chose)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def serve_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="mstar-serve", description="Serve Kimi K3 behind an OpenAI-compatible API.")
    p.add_argument("--config", required=True, type=Path, help="serve config YAML (see configs/)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-comm-protocol", default="SHM", type=str.upper, choices=TENSOR_COMM_PROTOCOLS,
                   help="how tensor-parallel ranks exchange tensors (SHM = one node)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help=f"accept this bearer key on /v1/* (repeatable; also server.api_keys and {API_KEY_ENV}, "
                        "comma-separated, which keeps keys out of the process list)")
    p.add_argument("--log-requests", action="store_true",
                   help="log every request's prompt and parameters (prompts are never logged otherwise)")
    add_rendezvous_args(p)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. scheduler.max_num_seqs=8")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        env = Environment.read()
        cfg = load_serve_config(args.config, args.overrides)
        rendezvous = resolve_rendezvous(args, cfg.tp_size, env.rendezvous())
        if rendezvous.node_rank > 0:  # no HTTP here: this node runs its ranks for node 0
            exit_now(serve_other_node(cfg, rendezvous))
        options = server_options(cfg, args.api_key, args.log_requests, env)
        http_socket = bind_http_socket(args.host, args.port)
        engine = build_engine(cfg, env=env, progress=True, tensor_comm_protocol=args.tensor_comm_protocol,
                              rendezvous=rendezvous)
    except (ServeConfigError, ValueError, FileNotFoundError) as e:
        print(f"mstar-serve: {e}", file=sys.stderr)
        raise SystemExit(2) from None

    from mstar.server import access_log
    from mstar.server.app import build_app
    from mstar.server.tokenize_pool import TokenizePool

    tokenize = TokenizePool(engine.tokenizer, cfg.checkpoint, cfg.server.tokenize_workers)
    try:
        tokenize.start()
    except ValueError as e:
        engine.shutdown()
        print(f"mstar-serve: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if tokenize.workers:
        log.info("prompts of %d characters or more are tokenized in worker processes %s", tokenize.inline_max_chars,
                 tokenize.worker_pids())
    app = build_app(engine, served_model_name=cfg.served_model_name, options=options, tokenize=tokenize)
    access_log.install()  # query strings (which may hold a key) never reach the access log
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=120, **connection_settings(cfg)))
    log.info("access: %s; at most %d generations in flight, bodies up to %d bytes, n <= %d%s",
             f"{len(options.api_keys)} API key(s)" if options.api_keys else "open (no API key)",
             options.max_in_flight, options.max_body_bytes, options.max_n,
             "; logging prompts (--log-requests)" if options.log_requests else "")

    def engine_stopped(message: str) -> None:
        server.should_exit = True  # uvicorn's loop polls it: open requests (already failed) drain, then it returns

    engine.on_fatal = engine_stopped
    try:
        server.run(sockets=[http_socket])
    finally:
        tokenize.close()
        engine.shutdown()
    if engine.fatal_error is not None:
        print(f"mstar-serve: the engine stopped: {engine.fatal_error}. Exiting with status {EXIT_ENGINE_FAILED} "
              "so that a supervisor can restart the server.", file=sys.stderr)
        raise SystemExit(EXIT_ENGINE_FAILED)
    log.info("drained and stopped")


if __name__ == "__main__":
    serve_main()
