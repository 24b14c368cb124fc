"""OpenAI-compatible HTTP server for an `EngineClient`: `build_app(engine, served_model_name=...)`.

The names below are imported on first use: a tokenizer worker process (server/tokenize_pool.py) imports
a module of this package and must not pay for the app's imports (the engine, torch: seconds, and
hundreds of MB a worker)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"build_app": "mstar.server.app", "ServerMetrics": "mstar.server.metrics"}

__all__ = ["ServerMetrics", "build_app"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mstar.server' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
