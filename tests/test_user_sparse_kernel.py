"""A sparse kernel of a kernel engineer's own, plugged in as a dense one is (Contract 1, docs/contracts.md): a file
in a scratch directory, written to FlashMLA's sparse signature from its documentation alone (nothing of this
suite imported), runs with ``mla-verify check --kernel file.py:fn`` and ``pytest --mla-kernel file.py:fn`` -- its
calling convention read from its signature, the packed format it reads from its envelope attribute -- and a copy
with one bug fails with a reproducer that ``mla-verify replay`` fails again. The trtllm-sparse convention
(FlashInfer's ``trtllm_batch_decode_with_kv_cache_mla(..., sparse_mla_top_k=...)``) is read the same way."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_cli import run_main

from mla_verify.backends.user_kernel import FLASHMLA_SPARSE, TRTLLM, TRTLLM_SPARSE, kernel_convention, load_kernel
from mla_verify.core.errors import UsageError

pytest_plugins = ["pytester"]
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")  # as in test_pytest_plugin.py

# The V3.2 cache: per token 512 fp8-e4m3 values, 4 fp32 scales (one per 128), 64 bf16 rope values; dequantized
# as FlashMLA's SM90 kernel does, bf16(fp8) * bf16(scale). MASK_MINUS1 is where the buggy copy differs.
USER_KERNEL = '''
import torch


def sparse_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits=None,
                  softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
                  extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None):
    """My sparse MLA decode over a V3.2 FP8 cache, in PyTorch."""
    P, page = k_cache.shape[:2]
    rows = k_cache.view(torch.uint8).reshape(P * page, 656)
    nope = rows[:, :512].contiguous().view(torch.float8_e4m3fn).to(torch.bfloat16).view(-1, 4, 128)
    scales = rows[:, 512:528].contiguous().view(torch.float32).to(torch.bfloat16)
    rope = rows[:, 528:].contiguous().view(torch.bfloat16)
    kv = torch.cat([(nope * scales[:, :, None]).view(-1, 512), rope], -1).float()  # [slots, 576]
    valid = indices >= 0 if MASK_MINUS1 else torch.ones_like(indices, dtype=torch.bool)
    if topk_length is not None:
        valid &= torch.arange(indices.shape[-1]) < topk_length[:, None, None]
    # [B, q_len, topk, 576]; -1 is the pool's last row. A masked entry's key is 0, never 0 * (what lies there)
    keys = kv[indices.long() % kv.shape[0]].masked_fill(~valid[..., None], 0.0)
    scores = torch.einsum("bqhd,bqkd->bqhk", q.float(), keys) * (softmax_scale or q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [B, q_len, H]
    out = torch.einsum("bqhk,bqkd->bqhd", torch.exp(scores - lse[..., None]).nan_to_num(0.0),
                       keys[..., :head_dim_v])
    if attn_sink is not None:
        out = out * torch.sigmoid(lse - attn_sink)[..., None]
    empty = ~valid.any(-1)[:, :, None]  # a row with no valid entry: out 0, LSE +inf
    out = out.masked_fill(empty[..., None], 0.0)
    lse = lse.masked_fill(empty, float("inf"))
    return out.to(torch.bfloat16), lse.transpose(1, 2)


sparse_decode.mla_verify_envelope = {"devices": ["cpu"], "formats": ["V32"]}
'''
# FlashInfer's trtllm-sparse convention over a bf16 cache [pages, 1, page, 576]: block tables [B, q_len, topk] of
# token slots, -1 masked; the LSE in base 2, [B * q_len, H]
USER_TRTLLM_SPARSE = '''
import math

import torch


def decode(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables,
           seq_lens, max_seq_len, out=None, bmm1_scale=1.0, bmm2_scale=1.0, return_lse=False, sparse_mla_top_k=0):
    B, Q, H, D = query.shape
    valid = block_tables >= 0
    keys = kv_cache.reshape(-1, D).float()[block_tables.clamp_min(0).long()].masked_fill(~valid[..., None], 0.0)
    scores = torch.einsum("bqhd,bqkd->bqhk", query.float(), keys) * bmm1_scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    o = torch.einsum("bqhk,bqkd->bqhd", torch.exp(scores - lse[..., None]).nan_to_num(0.0), keys[..., :kv_lora_rank])
    empty = ~valid.any(-1)[:, :, None]
    o = (o * bmm2_scale).masked_fill(empty[..., None], 0.0).to(torch.bfloat16)
    if out is not None:
        o = out.copy_(o)
    lse = lse.masked_fill(empty, float("inf")) / math.log(2)
    return (o, lse.reshape(B * Q, H)) if return_lse else o


decode.mla_verify_envelope = {"devices": ["cpu"], "formats": ["bf16"]}
'''
DRAWN = ("--max-examples", "5")


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of the user's: the kernel and a buggy copy of it; the suite's options unset."""
    for name in ("BACKEND", "KERNEL", "DEVICE", "PROFILE", "SEED", "HYPOTHESIS_DB", "SHARDS", "FIXTURES_DIR"):
        monkeypatch.delenv(f"MLA_VERIFY_{name}", raising=False)
    (tmp_path / "mine.py").write_text("MASK_MINUS1 = True\n" + USER_KERNEL)
    (tmp_path / "mine_buggy.py").write_text("MASK_MINUS1 = False\n" + USER_KERNEL)
    (tmp_path / "mine_trtllm.py").write_text(USER_TRTLLM_SPARSE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_convention_is_read_from_the_signature_and_the_format_from_the_envelope(scratch: Path) -> None:
    backend = load_kernel("mine.py:sparse_decode")
    assert (backend.kind, backend.envelope.formats, backend.envelope.devices) == ("sparse", ("V32",), ("cpu",))
    assert kernel_convention(lambda q, k_cache, indices=None: None) == FLASHMLA_SPARSE
    assert kernel_convention(lambda query, kv_cache, sparse_mla_top_k=0: None) == TRTLLM_SPARSE
    assert kernel_convention(lambda query, kv_cache, out=None: None) == TRTLLM


def test_check_passes_the_users_sparse_kernel_and_fails_its_buggy_copy_with_a_replaying_reproducer(
        capsys: pytest.CaptureFixture[str], scratch: Path) -> None:
    code, out, _ = run_main(capsys, "check", "--kernel", "mine.py:sparse_decode", "--device", "cpu", *DRAWN)
    assert code == 0, out
    assert "mine.py:sparse_decode: PASS" in out
    code, out, _ = run_main(capsys, "check", "--kernel", "mine_buggy.py:sparse_decode", "--device", "cpu", *DRAWN)
    assert code == 1, out
    assert "[minus1_read]" in out and re.search(r"minimal case: sparse V32/\S+ B=1 ", out), out
    reproducer = re.search(r"reproducer: (\S+\.json)", out).group(1)
    assert (scratch / reproducer).parent == scratch / "fixtures" / "regressions"
    code, out, _ = run_main(capsys, "replay", reproducer)
    assert code == 1 and "verdict: FAIL (recorded: FAIL)" in out, out
    assert "kernel output and LSE: bit-identical to the recorded run" in out
    code, out, _ = run_main(capsys, "replay", reproducer, "--kernel", "mine.py:sparse_decode")
    assert code == 0 and "verdict: PASS" in out, out  # the case, replayed on the right kernel


def test_pytest_mla_kernel_runs_the_users_sparse_kernel(pytester: pytest.Pytester, scratch: Path) -> None:
    (pytester.path / "mine.py").write_text((scratch / "mine.py").read_text())
    (pytester.path / "mine_buggy.py").write_text((scratch / "mine_buggy.py").read_text())
    result = pytester.runpytest(*QUIET, "--mla-kernel", "mine.py:sparse_decode", "--mla-profile", "dev")
    result.assert_outcomes(passed=1)
    result = pytester.runpytest(*QUIET, "--mla-kernel", "mine_buggy.py:sparse_decode", "--mla-profile", "dev")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*FAIL mine_buggy.py:sparse_decode: *", "*[[]minus1_read[]]*",
                                 "*  re-run: mla-verify replay */fixtures/regressions/*.json"])


def test_a_named_convention_is_recorded_and_a_wrong_one_is_one_line(capsys: pytest.CaptureFixture[str],
                                                                     scratch: Path) -> None:
    backend = load_kernel("mine.py:sparse_decode", convention=FLASHMLA_SPARSE)
    assert backend.source is not None and backend.source["convention"] == FLASHMLA_SPARSE
    again = load_kernel("mine.py:sparse_decode", recorded=backend.source)  # a worker's, or a replay's
    assert type(again) is type(backend)
    with pytest.raises(UsageError, match=r"unknown calling convention 'flashmla'.*known: trtllm, "):
        load_kernel("mine.py:sparse_decode", convention="flashmla")
    code, _, err = run_main(capsys, "check", "--convention", "trtllm-sparse", "--device", "cpu")
    assert code == 2 and "--convention names the calling convention of --kernel callables" in err


@pytest.mark.parametrize("named", [(), ("--convention", TRTLLM_SPARSE)], ids=["read", "named"])
def test_check_passes_a_users_trtllm_sparse_kernel(capsys: pytest.CaptureFixture[str], scratch: Path,
                                                   named: tuple[str, ...]) -> None:
    code, out, _ = run_main(capsys, "check", "--kernel", "mine_trtllm.py:decode", *named, "--device", "cpu", *DRAWN)
    assert code == 0, out
    assert "mine_trtllm.py:decode: PASS" in out
