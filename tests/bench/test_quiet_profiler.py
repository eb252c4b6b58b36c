"""bench.quiet_profiler: torch.profiler's start/stop markers and its no-GPU report leave a
benchmark's stderr, and nothing else does."""

from __future__ import annotations

import os
import sys

import torch

from bench.quiet_profiler import is_chatter, quiet_profiler

START = "USDT:2026-11-24 18:56:08 15814:15814 SyncActivityProfilerHandler.cpp:39] profiler_start\n"
STOP = "USDT:2026-11-24 18:56:09 15814:15814 SyncActivityProfilerHandler.cpp:46] profiler_stop\n"
NO_GPU = ("ERROR:2026-11-24 18:56:09 15814:15814 DeviceProperties.cpp:56] gpuGetDeviceCount "
          "failed with code 35\n")
OTHER_ERROR = "ERROR:2026-11-24 18:56:09 15814:15814 CuptiActivityApi.cpp:12] buffer lost\n"


def test_only_the_markers_and_the_no_gpu_report_are_chatter():
    assert is_chatter(START, gpu_present=False) and is_chatter(STOP, gpu_present=True)
    assert is_chatter(NO_GPU, gpu_present=False)
    assert not is_chatter(NO_GPU, gpu_present=True)  # with a GPU present it means something
    assert not is_chatter(OTHER_ERROR, gpu_present=False)
    assert not is_chatter("profiler_start\n", gpu_present=False)  # not Kineto's own line
    assert not is_chatter(START.rstrip("\n") + " and more\n", gpu_present=False)


def test_the_rest_of_stderr_comes_through_in_order(capfd):
    print("before", file=sys.stderr)
    with quiet_profiler():
        os.write(2, (START + "a real problem\n" + OTHER_ERROR + STOP + NO_GPU).encode())
        os.write(2, b"last\n")
    print("after", file=sys.stderr)
    err = capfd.readouterr().err
    expected = "a real problem\n" + OTHER_ERROR + (NO_GPU if torch.cuda.is_available() else "")
    assert err == "before\n" + expected + "last\nafter\n"


def test_a_failing_block_still_restores_stderr(capfd):
    try:
        with quiet_profiler():
            os.write(2, b"partial output\n")
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    os.write(2, b"restored\n")
    assert capfd.readouterr().err == "partial output\nrestored\n"


def test_a_profiled_run_prints_no_profiler_chatter(capfd):
    from torch.profiler import ProfilerActivity, profile

    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert prof.key_averages()
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err
    assert torch.cuda.is_available() or "gpuGetDeviceCount" not in err
