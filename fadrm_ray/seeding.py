"""Seeds derived from names: one random stream per piece of work, whoever computes it.

A piece of work (a recover group, a class's patch selection, an epoch of student views) gets a
generator seeded from a hash of what identifies it, not from a shared counter, so its draws do
not depend on which process ran it, in which order, or what else ran first.
"""
from __future__ import annotations

import hashlib

import torch

_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF  # torch.Generator.manual_seed takes a non-negative 63-bit seed


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from `parts`, joined by "|" as strings: the first 8 bytes of their SHA-256,
    little-endian. Stored results depend on these exact bytes, so the recipe must not change."""
    key = "|".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & _SEED_MASK


def seeded_generator(*parts: object) -> torch.Generator:
    """A CPU generator seeded with `derive_seed(*parts)`."""
    return torch.Generator().manual_seed(derive_seed(*parts))
