"""Counter-based sampling noise: the randomness of a token is a hash of (seed, index, vocab id).

A per-row torch.Generator would need a Python loop over the batch at every step, and one
generator shared by the batch makes a sample depend on what it was batched with. Hashing
instead gives every sample its own stream with no state to carry: a request with a seed gets
the same tokens whatever else runs beside it, in whichever slot, on whichever step it is
admitted (up to round-off differences of batched logits). Requests without a seed draw one
from the engine's torch.Generator at add_request time, so a run is reproducible from the
engine seed and the order of add_request calls.

The hash is Wellons' "lowbias32" in int32 arithmetic (wrapping multiply; logical shifts by
masking). The uniform has 23 bits, so Gumbel noise lies in [-2.8, 16.6]: a token whose
probability is below ~4e-9 relative to the most likely one is never sampled.
"""

from __future__ import annotations

import torch

_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_MASK32 = 0xFFFFFFFF
_VOCAB_SALT = 0x3C6EF372
_INDEX_SALT = 0x1B873593


def _to_i32(x: int) -> int:
    """Signed int32 spelling of a 32-bit pattern (torch int32 constants must fit)."""
    x &= _MASK32
    return x - (1 << 32) if x >= 1 << 31 else x


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (32 - s)) - 1)  # logical shift of an int32 bit pattern


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 tensors (bit patterns; signedness is irrelevant)."""
    x = x ^ _shr(x, 16)
    x = x * _to_i32(_M1)
    x = x ^ _shr(x, 15)
    x = x * _to_i32(_M2)
    return x ^ _shr(x, 16)


def mix32_int(x: int) -> int:
    """The same hash on a Python int, for host-side seed derivation."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * _M1) & _MASK32
    x ^= x >> 15
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def sample_key(seed: int, sample_index: int) -> int:
    """int32 key of one sample from a 64-bit seed and the sample's index among the n."""
    h = mix32_int((seed >> 32) ^ 0x9E3779B9)
    h = mix32_int((seed & _MASK32) ^ h)
    return _to_i32(mix32_int(sample_index ^ _INDEX_SALT ^ mix32_int(h)))


# the hash's multipliers and its token-index salt as int32 bit patterns (the Triton sampler's)
HASH_I32 = (_to_i32(_M1), _to_i32(_M2), _to_i32(_INDEX_SALT))


class GumbelNoise:
    """Gumbel(0, 1) noise of shape (b, vocab) keyed by (sample key, token index)."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        ids = torch.arange(vocab_size, dtype=torch.int32, device=device)
        self.vocab_hash = mix32(ids ^ _to_i32(_VOCAB_SALT))  # (vocab,)

    def __call__(self, keys: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        """keys (b,) int32 per-sample keys; token_index (b,) index of the token in the sample."""
        row = mix32(keys ^ mix32(token_index.to(torch.int32) ^ _to_i32(_INDEX_SALT)))  # (b,)
        bits = mix32(self.vocab_hash[None, :] ^ row[:, None])  # (b, vocab)
        u = (_shr(bits, 9).float() + 0.5) * (2.0**-23)  # (b, vocab) in (0, 1), exact
        return -torch.log(-torch.log(u))
