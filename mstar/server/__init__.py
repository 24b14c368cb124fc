"""OpenAI-compatible HTTP server for an `EngineClient`: `build_app(engine, served_model_name=...)`."""

from mstar.server.app import build_app
from mstar.server.metrics import ServerMetrics

__all__ = ["ServerMetrics", "build_app"]
