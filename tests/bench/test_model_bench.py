"""bench.model_bench's target lines: which targets a run measures, and their verdicts."""

from __future__ import annotations

from bench.model_bench import targets


def _result(fmt="gguf", dtype="bfloat16", llama=True):
    return {
        "format": fmt, "dtype": dtype,
        "shardlm": {"decode_tokens_per_s": 130.0, "prefill_tokens_per_s": 400.0},
        "llama_cpp": {"decode_tokens_per_s": 100.0, "prefill_tokens_per_s": 250.0} if llama
        else "not run: llama-cpp-python is not installed",
        "roofline": {"pct_of_floor": 80.0},
        "agreement": {"tokens": 512, "shardlm": 0.996},
    }


def test_ratios_against_llama_cpp_and_agreement():
    got = {t["target"]: t for t in targets(_result())}
    decode = got["batch-1 decode vs llama.cpp in-process >= 1.3x"]
    assert abs(decode["value"] - 1.3) < 1e-9 and decode["pass"] is True
    prefill = got["prefill vs llama.cpp >= 2x"]
    assert abs(prefill["value"] - 1.6) < 1e-9 and prefill["pass"] is False
    assert got["top-1 agreement with float32 >= 99.5%"]["pass"] is True
    assert not any("floor" in name for name in got)  # GGUF: no safetensors floor target


def test_without_llama_cpp_only_our_targets():
    names = [t["target"] for t in targets(_result(fmt="safetensors", llama=False))]
    assert not any("llama.cpp" in n for n in names)
    assert "bfloat16 batch-1 decode >= 75% of the read-bandwidth floor" in names


def test_depth_targets_count_kv_bytes_in_the_floor():
    result = _result()
    result["depth"] = {
        "depth": 4096,
        "shardlm_kv_float16": {"decode_tokens_per_s": 90.0, "pct_of_floor": 55.0},
        "llama_cpp": {"decode_tokens_per_s": 60.0, "pct_of_floor": 40.0},
    }
    got = {t["target"]: t for t in targets(result)}
    ratio = got["decode at depth 4096 (float16 KV) vs llama.cpp >= 1.3x"]
    assert abs(ratio["value"] - 1.5) < 1e-9 and ratio["pass"] is True
    floor = got["decode at depth 4096: weights + KV at >= 60% of the read floor"]
    assert abs(floor["value"] - 0.55) < 1e-9 and floor["pass"] is False
