"""DSpark speculative-decoding draft for Kimi K3: config and checkpoint."""

from mstar.models.dspark.config import (
    FIXTURE_PATH,
    DSparkConfig,
    YarnRopeConfig,
    load_dspark_config,
    parse_dspark_config,
)
from mstar.models.dspark.weights import (
    EMBED_TOKENS,
    expected_dspark_tensors,
    load_dspark_checkpoint,
    random_dspark_tensors,
    save_dspark_checkpoint,
)

__all__ = [
    "EMBED_TOKENS",
    "FIXTURE_PATH",
    "DSparkConfig",
    "YarnRopeConfig",
    "expected_dspark_tensors",
    "load_dspark_checkpoint",
    "load_dspark_config",
    "parse_dspark_config",
    "random_dspark_tensors",
    "save_dspark_checkpoint",
]
