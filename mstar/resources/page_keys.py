"""Content keys of full KV pages: a chained hash, so a page's key names the whole prefix before it.

Page i of a sequence is keyed by hash(key of page i-1, the page_size tokens of page i): two
sequences share page i's key exactly when their first (i + 1) * page_size tokens are equal, which
is when the page's latent rows (and the KDA state at its end) are equal too. BLAKE2b with a 16-byte
digest makes an accidental collision, which would serve another prefix's rows, practically impossible.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT = b""  # the parent key of a sequence's first page


def root(salt: str | None) -> bytes:
    """The parent key of the first page of a sequence with this cache salt (vLLM's `cache_salt`): salted
    sequences share no page with unsalted ones nor with those of another salt, so one tenant cannot tell
    from its time to first token what another's prompts held."""
    if salt is None:
        return ROOT
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"cache_salt").digest()


def page_key(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def extend_keys(keys: list[bytes], tokens: list[int] | tuple[int, ...], page_size: int, first_parent: bytes = ROOT
                ) -> None:
    """Append to `keys` (those of the first len(keys) pages of `tokens`) the keys of every further full page;
    the first page's parent is `first_parent` (`root` of the sequence's salt)."""
    for first in range(len(keys) * page_size, len(tokens) - page_size + 1, page_size):
        keys.append(page_key(keys[-1] if keys else first_parent, tokens[first : first + page_size]))
