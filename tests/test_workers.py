"""Per-worker device assignment (workers.py): round-robin over visible GPUs, overrides, slots across restarts."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from mla_verify.core.errors import UsageError
from mla_verify.run.workers import (
    FAKE_GPU_ENV,
    DeviceRequest,
    SlotTable,
    assign_device,
    assign_worker,
    parse_device_request,
)

AUTO = DeviceRequest("auto")
no_real_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="simulates GPUs, which needs a CPU-only host")


@pytest.mark.parametrize("text, expected", [
    ("auto", DeviceRequest("auto")), ("cpu", DeviceRequest("cpu")), ("cuda", DeviceRequest("cuda")),
    ("cuda:3", DeviceRequest("cuda", 3)), (" CUDA:0 ", DeviceRequest("cuda", 0)),
])
def test_parse_device_request(text, expected):
    assert parse_device_request(text) == expected


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "auto:1", "", "cuda:0,1"])
def test_invalid_device_is_a_one_line_usage_error(text):
    with pytest.raises(UsageError) as info:
        parse_device_request(text)
    assert "\n" not in str(info.value) and "--mla-device" in str(info.value)


def test_more_workers_than_gpus_share_fairly():
    devices = Counter(assign_device(AUTO, slot, gpu_count=3) for slot in range(8))
    assert set(devices) == {"cuda:0", "cuda:1", "cuda:2"}
    assert max(devices.values()) - min(devices.values()) <= 1


def test_more_gpus_than_workers_leave_the_rest_idle():
    assert [assign_device(AUTO, slot, gpu_count=8) for slot in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]


def test_outside_xdist_takes_the_first_gpu_or_the_cpu():
    assert assign_device(AUTO, None, gpu_count=4) == "cuda:0"
    assert assign_device(AUTO, None, gpu_count=0) == "cpu"
    assert assign_device(AUTO, 5, gpu_count=0) == "cpu"


def test_explicit_device_overrides_round_robin():
    assert assign_device(DeviceRequest("cpu"), 1, gpu_count=4) == "cpu"
    assert {assign_device(DeviceRequest("cuda", 2), slot, gpu_count=4) for slot in range(6)} == {"cuda:2"}
    # plain "cuda" insists on a GPU but still spreads workers
    assert [assign_device(DeviceRequest("cuda"), slot, gpu_count=2) for slot in range(3)] == \
        ["cuda:0", "cuda:1", "cuda:0"]


@pytest.mark.parametrize("request_, gpus", [(DeviceRequest("cuda"), 0), (DeviceRequest("cuda", 0), 0),
                                            (DeviceRequest("cuda", 2), 2)])
def test_unsatisfiable_cuda_request_is_a_usage_error(request_, gpus):
    with pytest.raises(UsageError, match="--mla-device"):
        assign_device(request_, 0, gpu_count=gpus)


@no_real_gpu
def test_cuda_visible_devices_indices_are_relative(monkeypatch):
    # CUDA_VISIBLE_DEVICES=2,3 shows two GPUs that torch calls cuda:0 and cuda:1; the physical ids 2 and 3
    # must never appear (they would be invalid devices inside this process).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv(FAKE_GPU_ENV, "2")
    assigned = [assign_worker(AUTO, f"gw{slot}", slot) for slot in range(4)]
    assert [a.device for a in assigned] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert all(a.simulated and a.run_device == "cpu" for a in assigned)
    assert assigned[1].label == "cuda:1 (simulated)"


@no_real_gpu
def test_no_gpu_means_cpu_and_nothing_simulated(monkeypatch):
    monkeypatch.delenv(FAKE_GPU_ENV, raising=False)
    a = assign_worker(AUTO, None, None)
    assert (a.worker, a.device, a.simulated, a.run_device) == ("main", "cpu", False, "cpu")
    monkeypatch.setenv(FAKE_GPU_ENV, "4")
    assert not assign_worker(DeviceRequest("cpu"), "gw1", 1).simulated


def test_fake_gpu_count_is_refused_where_cuda_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv(FAKE_GPU_ENV, "8")
    with pytest.raises(UsageError, match="CPU-only"):
        assign_worker(AUTO, "gw0", 0)
    monkeypatch.delenv(FAKE_GPU_ENV)
    a = assign_worker(AUTO, "gw3", 3)
    assert (a.device, a.simulated, a.run_device) == ("cuda:1", False, "cuda:1")


@no_real_gpu
def test_bad_fake_gpu_count_is_a_usage_error(monkeypatch):
    monkeypatch.setenv(FAKE_GPU_ENV, "two")
    with pytest.raises(UsageError, match=FAKE_GPU_ENV):
        assign_worker(AUTO, "gw0", 0)


def test_slots_are_dense_and_a_replacement_inherits_the_freed_slot():
    table = SlotTable()
    assert [table.claim(f"gw{i}") for i in range(4)] == [0, 1, 2, 3]
    assert table.claim("gw2") == 2  # re-entrant
    table.release("gw2")  # gw2 crashed; xdist starts gw4 in its place
    assert table.claim("gw4") == 2
    table.release("gw0")
    table.release("gw3")
    assert [table.claim("gw5"), table.claim("gw6")] == [0, 3]
    table.release("unknown")  # releasing a worker that holds nothing is harmless
    assert table.claim("gw7") == 4
