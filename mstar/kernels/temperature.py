"""Temperature scaling that cannot make finite logits non-finite.

logits / T overflows once |logit| / T passes the dtype's range (3.4e38 in fp32): with a tiny
temperature a finite row turns into ±inf, its softmax into NaN, and a sampler picks the first +inf
(or a draft's multinomial raises). Here each row is first shifted so that its best logit is 0
(softmax, top-k/top-p/min-p and the exponential race are all unchanged by a per-row shift), so the
quotient can only overflow downwards, for tokens whose probability is 0 anyway; those are clamped
to the dtype's lowest finite value. Logits that were already -inf (masked tokens) or NaN stay as
they are, so masks survive and a bad row is still caught by the engine's finite check.
"""

from __future__ import annotations

import torch


def scale_by_temperature_finite(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """(logits - row max) / temperature (temperature > 0, broadcast against logits [..., V]; the max of the
    row's finite logits): finite wherever the logits are finite, the best finite logit of each row 0."""
    finite = torch.isfinite(logits)
    best = logits.masked_fill(~finite, float("-inf")).amax(dim=-1, keepdim=True)  # of the finite logits
    shift = torch.where(torch.isfinite(best), best, torch.zeros_like(best))
    scaled = ((logits - shift) / temperature).clamp_min(torch.finfo(logits.dtype).min)
    return torch.where(finite, scaled, logits)
