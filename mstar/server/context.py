"""What every endpoint of one app shares."""

from __future__ import annotations

from dataclasses import dataclass

from mstar.engine.client import EngineClient
from mstar.server.admission import Admission
from mstar.server.metrics import ServerMetrics
from mstar.server.options import ServerOptions
from mstar.server.tokenize_pool import TokenizePool


@dataclass(frozen=True)
class ServerContext:
    engine: EngineClient
    served_model_name: str
    metrics: ServerMetrics
    created: int  # unix time the app was built: the model card's `created`
    options: ServerOptions
    admission: Admission
    tokenize: TokenizePool  # where prompts are tokenized: a thread, or a worker process for large ones
