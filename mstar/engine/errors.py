"""Errors the engine's front end raises to the HTTP server; kept free of torch and the model so
that the server can name them without importing the engine core."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (or is draining); no request can be served (HTTP 503)."""
