"""bench.quant_bench's --quants: each setting reaches the kernels, and an unknown one is refused
before anything is timed."""

from __future__ import annotations

import sys

import pytest

from bench import quant_bench
from shardlm_server.worker import ops


def test_each_quants_setting_reaches_the_kernels():
    if ops.USE_REFERENCE or not ops.cpu_simd_active():
        pytest.skip("the subnormal kernels are compiled SIMD paths")
    try:
        quant_bench._use("avx2", "converted")
        assert not ops.cpu_subnormal_quants_active()
        quant_bench._use("avx2", "subnormal")
        assert ops.cpu_subnormal_quants_active()
    finally:
        quant_bench._use(ops.SIMD_LEVELS[-1], "auto")


def test_an_unknown_quants_setting_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["quant_bench", "--quants", "subnormal,sometimes"])
    with pytest.raises(SystemExit) as exit_info:
        quant_bench.main()
    assert exit_info.value.code == 2
    assert "unknown sometimes" in capsys.readouterr().err
