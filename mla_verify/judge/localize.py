"""Where a wrong output is wrong, for a failure no catalogued misreading (diagnose.py) explains.

Four questions, each answered by the simplest rule that fits:

1. Which output rows -- (batch entry, query token, head) -- are wrong, and which are right. A row is wrong
   when its relative L2 error is over ``FACTOR`` times the same-precision baseline's on that row (compare.py's
   rule, row by row) and over ``ROW_FLOOR``. The wrong set is named axis by axis when it is a product of
   such sets ("heads 64-127", "query tokens after the first", "batch entries with seq_len >= 300"), else by
   the query tokens' positions, else listed.
2. Which KV positions the wrong rows were computed from. The reference is re-run on a few wrong rows with
   each sequence cut into chunks, every chunk a request of its own over a page-size-1 view of the cache;
   merging chunk results by their LSE then gives the reference with any set of chunks masked, so whole
   families of rules are tried at once: positions >= X ignored, positions < X ignored, the causal limit off
   by d, a sliding window's start off by d or the window ignored, one key (or one chunk) missing. A rule is
   reported when its masked reference matches the kernel as diagnose.py demands of a misreading (``OUT_TOL``,
   ``TRUTH_MARGIN``). Wrong rows that are all 0 read no key at all (no masking gives 0): that is said instead.
3. Whether the wrong rows hold other rows' right answers: batch entries, query tokens or heads permuted or
   swapped (each wrong row within its tolerance of the reference of another row along one axis, one source
   per index); the mapping is named and the key search skipped.
4. Where non-finite values come from. +inf is what ``out`` was filled with before the call: elements never
   written. NaN is told apart by re-running the kernel with finite values in every cache slot that held NaN
   (the slots no sequence owns): NaN that vanish were read from those slots; NaN that stay are the kernel's
   own (exp(-inf - -inf) in a split whose keys are all masked, 0/0).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..problems.arithmetic import DEFAULT, Arithmetic
from ..problems.generate import dtype_name
from ..problems.problem import DecodeProblem
from ..problems.reference import ReferenceResult, reference_decode
from .compare import FACTOR, baseline_result, judged_rows, lse_allowed, lse_slack
from .explains import OUT_TOL, TRUTH_MARGIN, WHERE, Rerun, exact_bf16, finite_poison

# A row of a correct bf16 kernel is off by its output rounding (at most 2^-9 relative per element) plus its
# accumulation order; 2^-8 keeps rows whose baseline error is ~0 (one token, exact values) from counting as
# wrong for rounding alone. FACTOR x the baseline is the larger bound on every multi-token row.
ROW_FLOOR = 2.0 ** -8
MAX_CHUNKS = 4096  # chunks per re-run row: positions are resolved one by one in sequences up to this long
# Cost bounds, not tolerances: each re-run row is the reference recomputed over up to MAX_CHUNKS chunks of
# its keys (and the fine ones at their ends). Three rows (the first, last and a middle batch entry) tell a
# per-request fault from one in every request; two heads of each tell a per-head fault from a per-row one.
MAX_ROWS = 3  # wrong (batch entry, query token) rows the key search re-runs
MAX_HEADS = 2  # wrong heads of each
LISTED = 6  # entries named before "... and N more"


def localize(problem: DecodeProblem, out: torch.Tensor, truth: ReferenceResult, lse: torch.Tensor | None = None,
             lse_base: float = 2.0, rerun: Rerun | None = None, arithmetic: Arithmetic = DEFAULT) -> list[str]:
    """Lines (each starting with ``WHERE``) saying where ``out`` [B, q_len, H, L] (and ``lse`` [B, q_len, H]
    in ``lse_base``) are wrong and right; ``rerun`` runs the kernel again, to tell a NaN's cause; rows are
    judged against a baseline in the kernel's declared ``arithmetic``."""
    dtype = dtype_name(problem)
    out = judged_rows(out, truth)  # a ragged problem's padding rows: 0, neither wrong nor non-finite
    wide = exact_bf16(problem)
    baseline = baseline_result(wide, dtype, arithmetic)
    err, allowed = _row_errors(out, truth, baseline, dtype)
    wrong = err > allowed
    # a ragged problem's padding rows are neither wrong nor right: counted out, and either in a region's words
    padding = torch.zeros_like(wrong) if truth.valid is None else ~truth.valid.to(wrong.device)[..., None]
    rows = int((~padding).expand_as(wrong).sum())
    lines = []
    if not bool(wrong.any()):
        lines.append(WHERE + "every row of out (batch entry, query token, head) is within its tolerance (the "
                     f"worst row's error is {float((err / allowed).max()):.2g}x what it may be): no part of the "
                     "output is wrong on its own; what failed is a check above, or an error spread thinly over "
                     "all of it")
    else:
        right = _region_of(wide, ~wrong & ~padding, padding)
        rest = "" if bool((wrong | padding).all()) else \
            "; " + (f"right in {right}" if right else "the other rows are right")
        lines.append(WHERE + f"out is wrong in {_region_of(wide, wrong, padding) or _listing(wrong)}{rest} "
                     f"({int(wrong.sum())} of {rows} rows wrong)")
        lines += _nonfinite(problem, out, rerun)
        mapping = _mapping(out, truth, wrong, allowed)
        finite_wrong = wrong & torch.isfinite(out).all(-1).to(wrong.device)
        if mapping is not None:  # each wrong row is another row's right answer: no key was misread
            lines.append(mapping)
        elif bool(finite_wrong.any()) and not bool(out[finite_wrong].any()):  # no masking of keys makes 0
            lines.append(WHERE + "keys: none -- every finite wrong row of out is 0, as if it read no key (a "
                         "sequence cut to nothing: its length or its page count)")
        elif bool(finite_wrong.any()):
            lines.append(_key_rule(wide, out, truth, finite_wrong, dtype))
    if lse is not None and tuple(lse.shape) == tuple(truth.lse.shape):
        natural = lse.detach().to(torch.float64) * math.log(lse_base)
        want = truth.lse.to(torch.float64).to(natural.device)
        allowed_lse = lse_allowed(want, lse_slack(baseline, truth, dtype))
        bad = judged_rows(~((natural - want).abs() <= allowed_lse), truth, False)
        if bool(bad.any()):
            lines.append(WHERE + f"the LSE is wrong in {_region_of(wide, bad, padding) or _listing(bad)} "
                         f"({int(bad.sum())} of {rows} values)")
    return lines


# ---------------------------------------------------------------- 1. which rows
def _row_errors(out: torch.Tensor, truth: ReferenceResult, baseline: ReferenceResult,
                dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (batch, token, head): relative L2 error of ``out`` (inf where not finite), and what is allowed."""
    o = out.detach().to(torch.float64)
    r = truth.out.to(torch.float64).to(o.device)
    norm = r.norm(dim=-1).clamp_min(1e-30)
    err = judged_rows(torch.where(torch.isfinite(o).all(-1), (o - r).norm(dim=-1) / norm, math.inf), truth)
    base = (baseline.out.to(o.device, torch.float64) - r).norm(dim=-1) / norm
    return err, (FACTOR[dtype] * base).clamp_min(ROW_FLOOR)


def _region_of(p: DecodeProblem, mask: torch.Tensor, padding: torch.Tensor) -> str | None:
    """``_region`` of ``mask``, else of ``mask`` with the padding rows (which no judgement reads) counted in."""
    return _region(p, mask) or (_region(p, mask | padding) if bool(padding.any()) else None)


def _region(p: DecodeProblem, mask: torch.Tensor) -> str | None:
    """``mask`` [B, Q, H] in words when it has a simple shape; None when only a listing would do."""
    if bool(mask.all()):
        return "every row"
    if not bool(mask.any()):
        return None
    bm, tm, hm = mask.any(2).any(1), mask.any(2).any(0), mask.any(1).any(0)
    if torch.equal(mask, bm[:, None, None] & tm[None, :, None] & hm[None, None, :]):
        return " and ".join(part for part in (_batch_set(p, bm), _token_set(tm), _head_set(hm)) if part)
    bt = mask.any(2)
    if torch.equal(mask, bt[:, :, None] & hm[None, None, :]):
        tokens = _token_positions(p, bt)
        return None if tokens is None else " and ".join(part for part in (tokens, _head_set(hm)) if part)
    return None


def _spans(indices: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"; at most LISTED spans, then how many indices are left."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans[:LISTED])
    rest = sum(b - a + 1 for a, b in spans[LISTED:])
    return text + (f" and {rest} more" if rest else "")


def _where(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


def _head_set(hm: torch.Tensor) -> str:
    if bool(hm.all()):
        return ""
    heads = _where(hm)
    return f"head {heads[0]}" if len(heads) == 1 else f"heads {_spans(heads)}"


def _token_set(tm: torch.Tensor) -> str:
    Q = tm.numel()
    if bool(tm.all()):
        return ""
    tokens = _where(tm)
    if len(tokens) == 1:
        return f"query token {tokens[0]}"
    if tokens == list(range(1, Q)):
        return "query tokens after the first"
    if tokens == list(range(Q - 1)):
        return "query tokens before the last"
    return f"query tokens {_spans(tokens)}"


def _batch_set(p: DecodeProblem, bm: torch.Tensor) -> str:
    """The batch entries of ``bm`` by a property of their sequences when one fits (and the batch is big enough
    for the rule to mean something), always with their indices and lengths."""
    if bool(bm.all()):
        return ""
    lens = p.seq_lens.to(bm.device).long()
    wrong = _where(bm)
    named = f"{'batch entry' if len(wrong) == 1 else 'batch entries'} {_spans(wrong)}"
    if len(wrong) <= LISTED:
        shown = ", ".join(str(int(lens[b])) for b in wrong)
        named += f" (seq_len{'s' if len(wrong) > 1 else ''} {shown})"
    if bm.numel() < 3:
        return named
    lo, hi, page = int(lens[bm].min()), int(lens[bm].max()), p.page_size
    rules = [(lens >= lo, f"seq_len >= {lo}"), (lens <= hi, f"seq_len <= {hi}"),
             (lens % page == 0, f"seq_len a multiple of the page size {page}"),
             (lens % page != 0, f"seq_len not a multiple of the page size {page}")]
    for fits, rule in rules:
        if torch.equal(fits, bm):
            return f"the batch entries with {rule}: {named}"
    return named


def _token_positions(p: DecodeProblem, bt: torch.Tensor) -> str | None:
    """(batch, token) rows by the position of the query token (seq_len - q_len + t; a ragged request's own
    q_len), when a threshold fits."""
    Q = bt.shape[1]
    own = p.request_q_lens().to(bt.device)[:, None]
    pos = p.seq_lens.to(bt.device).long()[:, None] - own + torch.arange(Q, device=bt.device)[None, :]
    lo, hi, page = int(pos[bt].min()), int(pos[bt].max()), p.page_size
    rows = p.valid_rows()  # a ragged request's own tokens
    real = torch.ones_like(bt) if rows is None else rows.to(bt.device)
    # a position at a page's last or first slot: a kernel that moves a row's causal limit where its tile or
    # page ends gets those rows wrong (with the key rule below, "the causal limit is off by +1")
    for fits, rule in ((pos >= lo, f">= {lo}"), (pos <= hi, f"<= {hi}"),
                       (pos % page == page - 1, f"at the last slot of a page (position % {page} == {page - 1})"),
                       (pos % page == 0, f"at the first slot of a page (position % {page} == 0)")):
        if torch.equal(fits & real, bt):
            return f"the query tokens at positions {rule} (position = seq_len - q_len + token)"
    return None


def _listing(mask: torch.Tensor) -> str:
    rows = mask.nonzero().tolist()
    shown = ", ".join("(batch {}, token {}, head {})".format(*r) for r in rows[:LISTED])
    return shown + (f" and {len(rows) - LISTED} more rows" if len(rows) > LISTED else "")


# ---------------------------------------------------------------- 3. rows holding other rows' answers
AXES = ("batch entry", "query token", "head")


def _mapping(out: torch.Tensor, truth: ReferenceResult, wrong: torch.Tensor, allowed: torch.Tensor) -> str | None:
    """The line naming how wrong rows hold other rows' right answers along one axis, or None when they do not
    (every wrong row must match some other row of the reference, index i always holding the same j's)."""
    o = out.detach().to(torch.float64)
    r = truth.out.to(torch.float64).to(o.device)
    idx = wrong.nonzero()
    if idx.shape[0] == 0 or not bool(torch.isfinite(o[wrong]).all()):
        return None
    got = o[wrong]  # [N, L]
    for axis, name in enumerate(AXES):
        n = o.shape[axis]
        if n < 2:
            continue
        sources = []
        for j in range(n):  # the reference row j along this axis, for every wrong row
            at = idx.clone()
            at[:, axis] = j
            want = r[at[:, 0], at[:, 1], at[:, 2]]
            sources.append((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30))
        err = torch.stack(sources, 1)  # [N, n]
        best = err.argmin(1)
        if not bool((err.gather(1, best[:, None])[:, 0] <= allowed[wrong].to(err.device)).all()):
            continue
        pairs: dict[int, int] = {}
        for i, j in zip(idx[:, axis].tolist(), best.tolist()):
            if pairs.setdefault(i, j) != j or i == j:
                break
        else:
            return WHERE + f"rows hold other rows' right answers: {_map_text(name, pairs)}"
    return None


def _map_text(name: str, pairs: dict[int, int]) -> str:
    """{0: 1, 1: 0} -> "batch entries 0 and 1 swapped"; else "batch entry 0 holds batch entry 2's, ..."."""
    plural = {"batch entry": "batch entries", "query token": "query tokens", "head": "heads"}[name]
    if all(pairs.get(j) == i for i, j in pairs.items()):
        swaps = sorted({tuple(sorted(p)) for p in pairs.items()})
        shown = "; ".join(f"{plural} {a} and {b} swapped" for a, b in swaps[:LISTED])
        return shown + (f" and {len(swaps) - LISTED} more swaps" if len(swaps) > LISTED else "")
    shown = ", ".join(f"{name} {i} holds {name} {j}'s" for i, j in sorted(pairs.items())[:LISTED])
    return shown + (f" and {len(pairs) - LISTED} more" if len(pairs) > LISTED else "")


# ---------------------------------------------------------------- 2. which keys
def _key_rule(p: DecodeProblem, out: torch.Tensor, truth: ReferenceResult, wrong: torch.Tensor, dtype: str) -> str:
    """The masking of KV positions under which the reference matches the wrong rows (by the bar a catalogued
    misreading must clear), or why none does."""
    picks = _pick_rows(wrong)
    Q = p.q_len
    lens, own_q = p.seq_lens.tolist(), p.request_q_lens().tolist()
    longest = max(lens[b] for b, _, _ in picks)
    step = 1 << max(0, math.ceil(math.log2(max(1, longest) / MAX_CHUNKS)))  # chunk length: a power of two
    bounds, seen = [], []
    for b, t, _ in picks:
        n, visible = lens[b], lens[b] - own_q[b] + t + 1
        first = 0 if p.window_left is None else max(0, visible - 1 - p.window_left)  # the window's start
        near = [*range(visible - 2 * Q - 1, visible + Q + 1), *range(first - 2, first + 3)]  # both ends, finely
        bounds.append(sorted({0, n, *range(step, n, step), *(x for x in near if 0 < x < n)}))
        seen.append((first, visible))
    chunks = _chunk_partials(p, picks, bounds)
    table: dict[tuple, list[float]] = {}
    truth_errors = []
    for (b, t, heads), bnd, (first, visible), (o, l) in zip(picks, bounds, seen, chunks):
        got = out[b, t, heads].detach().to(torch.float64).to(o.device)
        want = truth.out[b, t, heads].to(torch.float64).to(o.device)
        agree = _rel(torch.stack([_merge(o, l, bnd.index(first), bnd.index(visible))]), want)[0]
        if not agree < 1e-3:  # the chunked re-run must be the reference itself (fp32 against fp64: ~1e-6)
            return WHERE + f"keys: not searched (the chunked reference is {agree:.2g} off the reference)"
        truth_errors.append(_rel(want[None], got)[0])
        for rule, error in _rules(o, l, bnd, first, visible, got):
            table.setdefault(rule, []).append(error)
    scored = [(max(e), i, rule) for i, (rule, e) in enumerate(table.items()) if len(e) == len(picks)]  # i: order tried
    if not scored:
        return WHERE + "keys: no rule of the key search applies to every re-run row"
    # rules that mask the same keys (the window one late = its first key missing) differ by rounding only:
    # within 1% of the best, the first family tried (the simplest) names it
    best = min(e for e, _, _ in scored)
    _, error, rule = min((i, e, r) for e, i, r in scored if e <= 1.01 * best)
    tol = OUT_TOL["fp8" if dtype == "fp8" else "other"]
    worst_truth = min(truth_errors)
    what = _rule_text(rule, p.page_size, step)
    rows = f"{len(picks)} wrong row{'s' if len(picks) > 1 else ''} re-run"
    if error < tol and error * TRUTH_MARGIN < worst_truth:
        return WHERE + (f"keys: {what} -- the reference with those keys masked matches out on the {rows} "
                        f"(rel L2 {error:.2g}; {worst_truth:.2g} unmasked)")
    closest = f" (the closest: {what}, rel L2 {error:.2g}; {worst_truth:.2g} unmasked)" if error < worst_truth else ""
    return WHERE + (f"keys: no masking of KV positions explains the {rows}{closest}: the values are off, not "
                    "which of the sequence's keys are read")


def _pick_rows(wrong: torch.Tensor) -> list[tuple[int, int, list[int]]]:
    """Up to MAX_ROWS wrong (batch, token) rows, from as many batch entries as possible: the first, the last,
    then the middle; each with the same number (<= MAX_HEADS) of its wrong heads, its first and last."""
    pairs = wrong.any(2).nonzero().tolist()
    by_batch: dict[int, list[int]] = {}
    for b, t in pairs:
        by_batch.setdefault(b, []).append(t)
    firsts = [(b, ts[0]) for b, ts in by_batch.items()]
    order = [firsts[0], firsts[-1], firsts[len(firsts) // 2]] + [tuple(x) for x in (pairs[-1], pairs[len(pairs) // 2])]
    chosen = list(dict.fromkeys(order))[:MAX_ROWS]
    heads = [_where(wrong[b, t]) for b, t in chosen]
    count = min(MAX_HEADS, *(len(h) for h in heads))
    return [(b, t, sorted({h[0], h[-1]})[:count] if count > 1 else h[:1]) for (b, t), h in zip(chosen, heads)]


def _chunk_partials(p: DecodeProblem, picks: list[tuple[int, int, list[int]]],
                    bounds: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each picked row, the reference over each chunk [bounds[i], bounds[i+1]) of its sequence alone:
    (out [C, heads, L], natural-log lse [C, heads]) in float64. One reference call: every chunk is a
    q_len-1 request whose block table lists the chunk's cache rows (a page-size-1 view of the cache)."""
    D, page, device = p.query.shape[-1], p.page_size, p.device
    flat = p.kv_cache.reshape(-1, 1, D)
    width = max(b - a for bnd in bounds for a, b in zip(bnd, bnd[1:]))
    queries, tables, lengths = [], [], []
    for (b, t, heads), bnd in zip(picks, bounds):
        pos = torch.arange(bnd[-1], device=device)
        rows = p.block_table[b, pos // page].long() * page + pos % page  # flat cache row of each position
        lo = torch.tensor(bnd[:-1], device=device)
        hi = torch.tensor(bnd[1:], device=device)
        at = (lo[:, None] + torch.arange(width, device=device)[None, :]).clamp(max=bnd[-1] - 1)
        tables.append(rows[at])
        lengths.append(hi - lo)
        queries.append(p.query[b, t, torch.tensor(heads, device=device)][None, None].expand(len(bnd) - 1, 1, -1, -1))
    heads_count = len(picks[0][2])
    sub = DecodeProblem(torch.cat(queries), flat, torch.cat(tables).to(torch.int32), torch.cat(lengths).to(torch.int32),
                        p.dims.with_heads(heads_count), p.bmm1_scale, p.bmm2_scale)
    result = reference_decode(sub, precision=torch.float32)
    o, l = result.out[:, 0].to(torch.float64), result.lse[:, 0].to(torch.float64)
    sizes = [len(bnd) - 1 for bnd in bounds]
    return list(zip(o.split(sizes), l.split(sizes)))


def _merge(o: torch.Tensor, l: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The reference over chunks start..stop-1 from their partial results: their outputs weighted by their
    share of the softmax sum, exp(lse - max lse)."""
    w = torch.exp(l[start:stop] - l[start:stop].amax(0))  # [chunks, heads]
    return (w[..., None] * o[start:stop]).sum(0) / w.sum(0)[:, None]


def _rules(o: torch.Tensor, l: torch.Tensor, bnd: list[int], first: int, visible: int,
           got: torch.Tensor) -> list[tuple[tuple, float]]:
    """(rule, rel L2 of ``got`` against the reference masked by it) for every rule one row can test, the row
    seeing positions [first, visible): keys from X on ignored, keys before X ignored, the causal limit moved by
    d, the sliding window's start moved by d or the window ignored, one chunk dropped. Prefix sums make each
    family one pass."""
    w = torch.exp(l - l.amax(0))  # [C, heads]
    acc = torch.cat([torch.zeros_like(o[:1]), (w[..., None] * o).cumsum(0)])  # acc[k]: chunks < k
    tot = torch.cat([torch.zeros_like(w[:1]), w.cumsum(0)])
    k0, kv = bnd.index(first), bnd.index(visible)

    def kept(start: torch.Tensor | int, stop: torch.Tensor | int) -> list[float]:
        """Keeping chunks start..stop-1 (either may be a tensor of indices)."""
        return _rel((acc[stop] - acc[start]) / (tot[stop] - tot[start])[..., None], got)

    rules: list[tuple[tuple, float]] = []
    ends = list(range(k0 + 1, len(bnd)))
    for k, e in zip(ends, kept(k0, torch.tensor(ends, device=o.device))):  # keep [first, bnd[k])
        if k < kv:
            rules.append((("below", bnd[k]), e))
        if k != kv:
            rules.append((("limit", bnd[k] - visible), e))
    starts = list(range(kv))
    for k, e in zip(starts, kept(torch.tensor(starts, device=o.device), kv)):  # keep [bnd[k], visible)
        if k > k0:
            rules.append((("from", bnd[k]), e))
        if first > 0 and k != k0:  # a sliding window cuts this row
            rules.append((("no_window",), e) if k == 0 else (("window", bnd[k] - first), e))
    if kv - k0 > 1:
        cs = torch.arange(k0, kv, device=o.device)
        dropped = _rel((acc[kv] - acc[k0] - w[cs, :, None] * o[cs]) / (tot[kv] - tot[k0] - w[cs])[..., None], got)
        for c, e in zip(cs.tolist(), dropped):
            rules.append((("drop", bnd[c], bnd[c + 1]), e))
            if bnd[c + 1] - bnd[c] == 1:
                rules.append((("drop_rel", visible - bnd[c + 1]), e))
    return rules


def _rel(candidates: torch.Tensor, got: torch.Tensor) -> list[float]:
    """rel L2 of ``got`` [heads, L] against each candidate [K, heads, L]; inf where a candidate is not finite."""
    diff = (candidates - got[None]).flatten(1).norm(dim=1) / candidates.flatten(1).norm(dim=1).clamp_min(1e-30)
    return torch.nan_to_num(diff, nan=math.inf).tolist()


def _rule_text(rule: tuple, page: int, step: int) -> str:
    kind = rule[0]
    approx = f" (searched in steps of {step} positions)" if step > 1 else ""
    if kind == "below":
        return f"KV positions >= {rule[1]} are ignored{approx}"
    if kind == "from":
        return f"KV positions < {rule[1]} are ignored{approx}"
    if kind == "limit":
        d = rule[1]
        own = " (its own position is missing)" if d == -1 else ""
        return (f"the causal limit is off by {d:+d}: query token t sees the positions up to seq_len - q_len + t "
                f"{'+' if d > 0 else '-'} {abs(d)}{own}")
    if kind == "no_window":
        return "the sliding window is ignored: each query token sees every position up to its own"
    if kind == "window":
        d = rule[1]
        return (f"the sliding window starts {abs(d)} position{'s' if abs(d) > 1 else ''} "
                f"{'late' if d > 0 else 'early'}: query token t sees from seq_len - q_len + t - window_left "
                f"{'+' if d > 0 else '-'} {abs(d)}")
    if kind == "drop_rel":
        j = rule[1]
        return ("one key missing from each row: the query token's own position" if j == 0 else
                f"one key missing from each row: position seq_len - q_len + t - {j} (query token t)")
    lo, hi = rule[1], rule[2]
    if hi - lo == 1:
        return (f"one key missing from each row: position {lo} (block-table entry {lo // page}, "
                f"slot {lo % page})")
    return f"KV positions {lo}-{hi - 1} are missing from each row{approx}"


# ---------------------------------------------------------------- 4. non-finite values
def _nonfinite(p: DecodeProblem, out: torch.Tensor, rerun: Rerun | None) -> list[str]:
    wide = exact_bf16(p)
    lines = []
    inf_rows = torch.isinf(out).any(-1)
    if bool(inf_rows.any()):
        lines.append(WHERE + f"inf in {_region(wide, inf_rows) or _listing(inf_rows)}: out held +inf before the "
                     "call, so these elements were never written")
    nan_rows = torch.isnan(out).any(-1)
    if bool(nan_rows.any()):
        lines.append(WHERE + f"NaN in {_region(wide, nan_rows) or _listing(nan_rows)}: "
                     + _nan_cause(p, rerun, nan_rows))
    return lines


def _nan_cause(p: DecodeProblem, rerun: Rerun | None, nan_rows: torch.Tensor) -> str:
    own = ("the kernel makes them itself (e.g. exp(-inf - -inf) in a split whose keys are all masked, or "
           "0/0), so no read outside the sequences is needed to explain them")
    finite = finite_poison(p)
    if finite is None:
        return "the cache holds no NaN, so " + own
    if rerun is None:
        return "not told apart (the kernel was not re-run with finite values in the unused cache slots)"
    again = rerun(finite)
    if again is None or tuple(again.shape) != tuple(nan_rows.shape) + (p.dims.kv_lora_rank,):
        return "not told apart (the re-run with finite values in the unused cache slots gave no output)"
    still = torch.isnan(again).any(-1).to(nan_rows.device) & nan_rows
    if not bool(still.any()):
        return ("read from the unused cache slots (which hold NaN): with finite values there the kernel's output "
                "has no NaN, so it reads positions outside its sequences")
    if torch.equal(still, nan_rows):
        return "they stay NaN with finite values in every unused cache slot: " + own
    return (f"{int(still.sum())} of these rows stay NaN with finite values in the unused cache slots (the "
            "kernel's own NaN); the others were read from those slots")
