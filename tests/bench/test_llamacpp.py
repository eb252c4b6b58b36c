"""bench.llamacpp's crash probe: a llama.cpp that dies in its child process is reported, not run,
and one that exits by itself (a file it refuses) is left to LlamaCpp to report."""

from __future__ import annotations

from pathlib import Path

from bench import llamacpp


def test_a_child_killed_by_a_signal_is_a_crash(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(llamacpp, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    reason = llamacpp.crash_reason(tmp_path / "model.gguf", threads=1)
    assert reason is not None
    assert "signal 11" in reason and "-mno-amx-int8" in reason and "--force-reinstall" in reason


def test_a_child_that_exits_with_an_error_is_not_a_crash(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(llamacpp, "_PROBE", "raise SystemExit(3)")
    assert llamacpp.crash_reason(tmp_path / "model.gguf", threads=1) is None


def test_the_build_hints_keep_amx_int8_off():
    for hint in (llamacpp.INSTALL_HINT, llamacpp.REBUILD_HINT):
        assert "-DGGML_NATIVE=ON" in hint and "-DCMAKE_CXX_FLAGS=-mno-amx-int8" in hint
    script = (Path(__file__).parents[2] / "scripts" / "build_llama_server.sh").read_text()
    assert "-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8" in script
