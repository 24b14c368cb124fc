"""Where the repository's files are, for tests in any folder under tests/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root
CONFIGS = ROOT / "configs"
SUPPORT = Path(__file__).resolve().parent  # scripts the tests run (tp_server.py)
