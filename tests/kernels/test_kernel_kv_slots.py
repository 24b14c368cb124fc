"""The latent KV kernels (mstar/kernels/kv_slots.py) against the torch they replace: the shifted addressing
against resources/latent_kv.shift_slots on the CPU (random page tables, ragged rows per sequence, shifts up to
the furthest a verify step in flight may keep; outputs poisoned first, the allocator's freed blocks on the
GPU), the rows' write against PagedLatentKV.write's index_put of the cat (caches poisoned with NaN). Without
CUDA through Triton's interpreter."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels.kv_slots import shifted_slots, write_latent_rows  # noqa: E402
from mstar.models.kimi_k3.norm import rms_norm  # noqa: E402
from mstar.resources.latent_kv import shift_slots  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_step(rng: random.Random, page_size: int):
    B = rng.randint(1, 9)
    rows = [rng.choice([1, 1, 4, 8, rng.randint(1, 300)]) for _ in range(B)]
    computed = [rng.randint(0, 600) for _ in range(B)]
    advance = [rng.randint(0, 8) for _ in range(B)]
    pages = [-(-(c + n + a) // page_size) for c, n, a in zip(computed, rows, advance, strict=True)]
    width = max(pages) + rng.randint(0, 2)
    table = torch.zeros(B, width, dtype=torch.long)
    for b, n in enumerate(pages):
        table[b, :n] = torch.randperm(4096)[:n] + 1
    row_seq = torch.tensor([b for b, n in enumerate(rows) for _ in range(n)])
    positions = torch.tensor([c + j for c, n in zip(computed, rows, strict=True) for j in range(n)])
    lens = torch.tensor([c + n for c, n in zip(computed, rows, strict=True)])
    return table, row_seq, positions, lens, torch.tensor(advance)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_shifted_slots_match_the_torch_arithmetic(page_size):
    rng = random.Random(page_size)
    for _ in range(20):
        step = random_step(rng, page_size)
        expected = shift_slots(*step, page_size)
        if DEVICE == "cuda":
            junk = [torch.full((n,), -7, dtype=torch.long, device=DEVICE) for n in (8, 64, 512, 4096)]
            del junk
        got = shifted_slots(*(t.to(DEVICE) for t in step), page_size)
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g.cpu(), e)


def test_shapes_that_do_not_match_are_refused():
    table, row_seq, positions, lens, advance = random_step(random.Random(0), 16)
    with pytest.raises(ValueError, match="shifted_slots takes"):
        shifted_slots(table, row_seq[:-1], positions, lens, advance, 16)


SINK = 0  # the runner's padding rows all write slot 0 (page 0 is never a request's)
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def torch_write(cache: torch.Tensor, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
    """What GpuMixerOps did before the kernel: PagedLatentKV.write of the cat."""
    cache.view(-1, cache.shape[-1])[slots] = torch.cat([c_kv, k_pe], dim=-1).to(cache.dtype)


def random_rows(rng: random.Random, latent: int, rope: int, page_size: int, dtype: torch.dtype):
    """(pages, slots, c_kv, k_pe, padding) of a step: the real rows on distinct slots past page 0 in random order,
    then `padding` rows on the sink; c_kv a tensor of its own, k_pe the last columns of kv_a (as the layer leaves
    them). Drawn from `rng` alone (the global generator's later draws stay as they were)."""
    gen = torch.Generator().manual_seed(rng.getrandbits(32))
    pages = rng.randint(2, 5)
    real, padding = rng.randint(0, 12), rng.choice([0, 1, 3])
    slots = torch.randperm((pages - 1) * page_size, generator=gen)[:real] + page_size
    slots = torch.cat([slots, torch.full((padding,), SINK)]).to(rng.choice([torch.int32, torch.int64]))
    n = slots.shape[0]
    kv_a = torch.randn(n, latent + rope, generator=gen).to(dtype)
    return pages, slots, torch.randn(n, latent, generator=gen).to(dtype), kv_a[:, latent:], padding


# Triton's interpreter truncates fp32 to bf16 (its casts ignore the rounding mode); the GPU rounds to nearest even
ROUNDS_LIKE_TORCH = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                       reason="the interpreter truncates fp32 to bf16")


@pytest.mark.parametrize("cache_dtype,rows_dtype", [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
    pytest.param(torch.float32, torch.bfloat16, id="bf16_rows_into_fp32"),
    pytest.param(torch.bfloat16, torch.float32, id="fp32_rows_into_bf16", marks=ROUNDS_LIKE_TORCH)])
def test_latent_rows_land_where_torch_writes_them(cache_dtype, rows_dtype):
    """Random steps at K3's row, the mini's and widths no power of two: every slot no row names stays NaN; the rest
    hold bit for bit what torch writes (rounded to the cache's dtype alike), the sink one of its padding rows."""
    rng = random.Random(str(cache_dtype) + str(rows_dtype))
    for latent, rope in ((512, 64), (64, 16), (40, 24)) * 3:
        page_size = rng.choice([16, 64])
        pages, slots, c_kv, k_pe, padding = random_rows(rng, latent, rope, page_size, rows_dtype)
        expected = torch.full((pages, page_size, latent + rope), float("nan"), dtype=cache_dtype)
        got = expected.to(DEVICE, copy=True)
        torch_write(expected, slots, c_kv, k_pe)
        write_latent_rows(got, slots.to(DEVICE), c_kv.to(DEVICE), k_pe.to(DEVICE))
        got = got.cpu().view(-1, latent + rope)
        expected = expected.view(-1, latent + rope)
        if padding:
            written = torch.cat([c_kv, k_pe], dim=-1)[-padding:].to(cache_dtype).view(BITS[cache_dtype])
            assert (got[SINK].view(BITS[cache_dtype]) == written).all(-1).any(), "the sink holds no padding row"
            got[SINK] = expected[SINK]
        assert torch.equal(got.view(BITS[cache_dtype]), expected.view(BITS[cache_dtype])), (latent, rope)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_normed_latent_rows_are_what_the_norm_then_the_write_store(dtype):
    """norm=(weight, eps): the rows stored are rms_norm(c_kv) (models/kimi_k3/norm.py) written as above, at K3's
    row, the mini's and a width no power of two, with weights away from one and latents of varied scale; every
    other slot stays NaN. Within a rounding of the reference (the sum of squares is summed in another order)."""
    rng = random.Random(f"norm {dtype}")
    for latent, rope in ((512, 64), (64, 16), (40, 24)) * 2:
        page_size = rng.choice([16, 64])
        pages, slots, c_kv, k_pe, padding = random_rows(rng, latent, rope, page_size, dtype)
        gen = torch.Generator().manual_seed(rng.getrandbits(32))
        c_kv = (c_kv.float() * torch.rand(c_kv.shape[0], 1, generator=gen) * 8).to(dtype)
        weight = (torch.rand(latent, generator=gen) * 2 + 0.25).to(dtype)
        eps = rng.choice([1e-6, 1e-5])
        expected = torch.full((pages, page_size, latent + rope), float("nan"), dtype=dtype)
        got = expected.to(DEVICE, copy=True)
        torch_write(expected, slots, rms_norm(c_kv, weight, eps), k_pe)
        write_latent_rows(got, slots.to(DEVICE), c_kv.to(DEVICE), k_pe.to(DEVICE), norm=(weight.to(DEVICE), eps))
        got, expected = got.cpu().view(-1, latent + rope), expected.view(-1, latent + rope)
        if padding:
            got[SINK], expected[SINK] = 0, 0  # one of the padding rows wins (the test above checks which)
        assert torch.equal(got.isnan(), expected.isnan()), "a row went to another slot"
        step = 1e-6 if dtype == torch.float32 else 2**-7  # a rounding of the dtype, relative
        torch.testing.assert_close(got.nan_to_num(), expected.nan_to_num(), rtol=2 * step, atol=step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_query_rows_are_normed_in_the_same_launch(dtype):
    """query=(q, weight, eps, out): out = rms_norm(q) (the layer's q_a_layernorm) for every row of the step, q a
    column slice of a wider GEMM output, at K3's query width (1,536), the mini's and one no power of two, beside
    the normed latent rows, which stay what they are without it; out poisoned first."""
    rng = random.Random(f"query {dtype}")
    for latent, rope, width in ((512, 64, 1536), (64, 16, 96), (40, 24, 200)):
        page_size = rng.choice([16, 64])
        pages, slots, c_kv, k_pe, _ = random_rows(rng, latent, rope, page_size, dtype)
        gen = torch.Generator().manual_seed(rng.getrandbits(32))
        n = slots.shape[0]
        first = (torch.randn(n, width + 48, generator=gen) * torch.rand(n, 1, generator=gen) * 8).to(dtype)
        q = first[:, 48:]  # the query's columns of a stacked projection's output
        q_weight = (torch.rand(width, generator=gen) * 2 + 0.25).to(dtype)
        weight = (torch.rand(latent, generator=gen) * 2 + 0.25).to(dtype)
        out = torch.full((n, width), float("nan"), dtype=dtype, device=DEVICE)
        alone = torch.full((pages, page_size, latent + rope), float("nan"), dtype=dtype, device=DEVICE)
        both = alone.clone()
        write_latent_rows(alone, slots.to(DEVICE), c_kv.to(DEVICE), k_pe.to(DEVICE), norm=(weight.to(DEVICE), 1e-6))
        write_latent_rows(both, slots.to(DEVICE), c_kv.to(DEVICE), k_pe.to(DEVICE), norm=(weight.to(DEVICE), 1e-6),
                          query=(q.to(DEVICE), q_weight.to(DEVICE), 1e-5, out))
        assert torch.equal(both.isnan(), alone.isnan())
        assert torch.equal(both.nan_to_num(), alone.nan_to_num())
        step = 1e-6 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(out.cpu(), rms_norm(q, q_weight, 1e-5), rtol=2 * step, atol=step)


def test_latent_rows_that_do_not_fit_are_refused():
    cache = torch.zeros(2, 16, 80)
    slots, c_kv, k_pe = torch.arange(3), torch.zeros(3, 64), torch.zeros(3, 16)
    for bad in ((cache, slots, c_kv, k_pe[:, :8]), (cache, slots, c_kv.t().contiguous().t(), k_pe),
                (cache, slots.float(), c_kv, k_pe), (cache.transpose(0, 1), slots, c_kv, k_pe),
                (cache, slots[:2], c_kv, k_pe)):
        with pytest.raises(ValueError, match="write_latent_rows takes"):
            write_latent_rows(*bad)
    for weight in (torch.ones(32), torch.ones(64, dtype=torch.float64), torch.ones(128)[::2]):
        with pytest.raises(ValueError, match="norm weight"):
            write_latent_rows(cache, slots, c_kv, k_pe, norm=(weight, 1e-6))
    q = torch.zeros(3, 24)
    for query, match in (((q, torch.ones(16), 1e-6, torch.empty(3, 24)), "query weight"),
                         ((q[:2], torch.ones(24), 1e-6, torch.empty(2, 24)), "query takes"),
                         ((q, torch.ones(24), 1e-6, torch.empty(3, 24, dtype=torch.float64)), "query takes"),
                         ((q.t().contiguous().t(), torch.ones(24), 1e-6, torch.empty(3, 24)), "query takes")):
        with pytest.raises(ValueError, match=match):
            write_latent_rows(cache, slots, c_kv, k_pe, query=query)
