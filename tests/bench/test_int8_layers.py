"""bench.int8_layers: each layout's random layer is held as the kernels read it, and a tiny run
prints one table row per layout (timings mean nothing on CI; only the shape is checked)."""

from __future__ import annotations

import sys

import pytest

from bench import int8_layers
from shardlm_server.worker import ops
from shardlm_server.worker.ops import activations

if ops.USE_REFERENCE:
    pytest.skip("SHARDLM_OPS=reference: nothing compiled to time", allow_module_level=True)


@pytest.mark.parametrize("layout", activations.INT8_LAYOUTS)
def test_every_layout_has_a_layer(layout):
    weight = int8_layers.layer(layout, 16, 256)
    assert weight.qtype == layout and weight.shape == (16, 256)


def test_a_tiny_run_prints_a_row_per_layout(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["int8_layers", "--shape", "16,256", "--rows", "1,5",
                                      "--layouts", "Q4x8,IQ2XXSx8", "--rounds", "1",
                                      "--budget", "0.001", "--simd", "avx2", "--no-vnni"])
    try:
        int8_layers.main()
    finally:
        ops.set_cpu_simd(True)
        ops.set_cpu_vnni(True)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| IQ")
            or line.startswith("| Q4")]
    assert [r.split()[1] for r in rows] == ["Q4x8", "IQ2XXSx8"]
    assert all(r.count("x)") == 2 for r in rows)
    assert activations.activation_precision() == "exact"
