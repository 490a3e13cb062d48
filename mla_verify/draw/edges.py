"""The KV lengths where a kernel changes behaviour: the edges of the tiles and splits it cuts sequences into --
the sizes MLA decode kernels commonly use (envelope.SPLIT_SIZES) and those a kernel declares
(``Envelope.split_sizes``) -- and the lengths it treats specially (``Envelope.special_lengths``).

The premerge corner cases hold the common sizes' edges and the declared ones, and the strategies mix the
declared ones into the lengths they draw (strategies.py), as they do page edges. ``split_edges`` is the one rule
from sizes to lengths.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

from ..problems.envelope import Envelope

# the first split boundary, and the second: a full split merged with a partial one
SPLIT_MULTIPLES = (1, 2)


def split_edges(sizes: Iterable[int], q_len: int, multiples: Sequence[int] = SPLIT_MULTIPLES) -> tuple[int, ...]:
    """KV lengths at the edges of S-token splits, for each S in ``sizes`` and k in ``multiples``: k*S - 1 and
    k*S (the last split one short of full, and full), and k*S + 1 .. k*S + q_len - 1, where the split after the
    edge holds new tokens only, so that the first query tokens see none of it (an empty split for their rows;
    with q_len 1, k*S + 1: a one-token split). Sorted, each once."""
    lengths: set[int] = set()
    for size in sizes:
        for k in multiples:
            edge = k * size
            lengths.update((edge - 1, edge, *range(edge + 1, edge + max(q_len, 2))))
    return tuple(sorted(n for n in lengths if n >= 1))


@functools.cache
def declared_edges(env: Envelope, q_len: int) -> tuple[int, ...]:
    """The lengths ``env`` says its kernel is fragile at, for cases of ``q_len`` query tokens: its splits'
    edges (``split_edges``) and each special length L as L - 1, L, L + 1. Empty when it declares none."""
    special = (n + d for n in env.special_lengths for d in (-1, 0, 1))
    return tuple(sorted({*split_edges(env.split_sizes, q_len), *(n for n in special if n >= 1)}))
