"""mstar-serve's tensor-parallel path as a script, for the tests: what serve.py runs once it builds its
engine with `build_tp_engine` (load the config, build the TP engine, serve, drain, stop the ranks).

    python tests/support/tp_server.py CONFIG PORT [key=value ...]

TP_SERVER_CONTROL_S (tests only) sets how long a follower waits to hear from rank 0 (default 10 s).
"""

from __future__ import annotations

import logging
import os
import sys

import uvicorn

from mstar.config import load_serve_config
from mstar.distributed.worker import Timeouts, build_tp_engine
from mstar.engine.core import SpeculativeModels
from mstar.serve import DrainingServer
from mstar.server.app import build_app


def main() -> None:
    config, port, *overrides = sys.argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_serve_config(config, overrides)
    timeouts = Timeouts(startup_s=120, control_s=float(os.environ.get("TP_SERVER_CONTROL_S", 10)))
    engine = build_tp_engine(cfg, SpeculativeModels.for_config(cfg, "cpu"), device="cpu", tensor_comm_protocol="GLOO",
                             timeouts=timeouts)
    app = build_app(engine, served_model_name=cfg.served_model_name)
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=int(port), log_level="warning",
                                           timeout_graceful_shutdown=60))
    try:
        server.run()
    finally:
        engine.shutdown()
    logging.getLogger("tp_server").info("drained and stopped")


if __name__ == "__main__":
    main()
