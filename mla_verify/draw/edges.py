"""The KV lengths at the edges of the splits and tiles a kernel cuts a sequence into.

``split_edges`` is the one rule from split sizes to lengths; the premerge corner cases take it for the sizes MLA
decode kernels commonly use (strategies.py), and for the sizes a kernel declares.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

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
