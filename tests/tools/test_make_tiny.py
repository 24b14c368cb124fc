"""The tiny checkpoints: deterministic, complete, and shaped as the issue requires."""

import hashlib
import subprocess
import sys

import torch

from mstar.models.dspark.weights import load_dspark_checkpoint
from mstar.models.kimi_k3.config import load_config
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.tools.make_tiny import write_tiny


def digest(folder):
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def test_tiny_is_deterministic(tiny_dirs, tmp_path):
    again = write_tiny(tmp_path)
    for a, b in zip(tiny_dirs, again, strict=True):
        assert digest(a) == digest(b)


def test_tiny_target_has_every_component(tiny_dir):
    cfg = load_config(tiny_dir)
    kinds = cfg.layer_kinds
    assert cfg.num_hidden_layers >= 6 and "kda" in kinds and kinds[-1] == "mla"
    assert -(-cfg.num_hidden_layers // cfg.attn_res_block_size) >= 3
    assert cfg.num_experts >= 8 and cfg.num_experts_per_token >= 2 and cfg.num_shared_experts >= 1
    assert not cfg.is_moe_layer(0) and cfg.quantization is not None


def test_tiny_tokenizer_matches_the_model(tiny_dir):
    cfg = load_config(tiny_dir)
    tok = KimiTokenizer.from_dir(tiny_dir)
    assert tok.vocab_size == cfg.vocab_size
    assert tok.eos_id == cfg.eos_token_id and tok.bos_id == cfg.bos_token_id and tok.pad_id == cfg.pad_token_id
    ids = tok.encode("def greet(name):\n    return f'hello {name}'\n")
    assert tok.decode(ids) == "def greet(name):\n    return f'hello {name}'\n"


def test_tiny_draft_matches_the_target(tiny_dirs):
    target_dir, draft_dir = tiny_dirs
    target = load_config(target_dir)
    draft_cfg, tensors = load_dspark_checkpoint(draft_dir)
    assert draft_cfg.num_hidden_layers == 2 and len(draft_cfg.target_layer_ids) == 3
    assert max(draft_cfg.target_layer_ids) < target.num_hidden_layers - 1
    draft_cfg.check_matches_target(target.hidden_size, target.num_hidden_layers, target.vocab_size)
    assert tensors["markov_head.markov_w1.weight"].shape == (target.vocab_size, draft_cfg.markov_rank)
    assert all(t.dtype == torch.float32 for t in tensors.values())


def test_generate_cli(tiny_dir, tiny_model):
    from mstar.models.kimi_k3.generate import greedy_generate

    ids = [5, 17, 300, 42]
    out = subprocess.run(
        [sys.executable, "-m", "mstar.cli", "--checkpoint", str(tiny_dir), "--prompt-ids", "5,17,300,42",
         "--max-new-tokens", "6", "--ignore-eos"],
        capture_output=True, text=True, check=True,
    )
    tokens = [int(t) for t in out.stdout.splitlines()[0].split()]
    assert tokens == greedy_generate(tiny_model, ids, 6)
