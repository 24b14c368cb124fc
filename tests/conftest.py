"""Shared fixtures: the tiny checkpoints are written once per test session."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from mstar.tools.make_tiny import write_tiny

# Without a GPU, Triton kernels run in Triton's interpreter. The variable must be set before anything
# imports triton (the engine imports the kernel modules), so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a scalar into a loop bound with int() of a 1-element array, which
    numpy >= 2.4 refuses (triton-lang/triton#9171, fixed upstream after 3.6). Patch that one conversion."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    with contextlib.suppress(ImportError):  # no triton: the kernel tests skip
        _fix_interpreter_scalar_index()

# The tiny models are far too small to gain from intra-op threads, and on a 2-core machine OpenMP's
# spinning threads slow every op by ~100x as soon as another process competes for a core.
os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by subprocesses the tests start
torch.set_num_threads(1)



@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """(target_dir, draft_dir) of the deterministic tiny K3 and its DSpark draft."""
    return write_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_dir(tiny_dirs):
    return tiny_dirs[0]


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from mstar.models.kimi_k3.weights import load_model

    return load_model(tiny_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_model_fp64(tiny_dir):
    from mstar.models.kimi_k3.weights import load_model

    return load_model(tiny_dir, dtype=torch.float64)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    """The tiny checkpoint's tokenizer (read only by every test that takes it)."""
    from mstar.models.kimi_k3.tokenizer import KimiTokenizer

    return KimiTokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="session")
def draft(tiny_dirs):
    """The tiny DSpark draft, fp32 (read only)."""
    from mstar.models.dspark.model import K3DSparkModel

    return K3DSparkModel.from_checkpoint(tiny_dirs[1], dtype=torch.float32)
