"""Claims the README and the `--help` texts make about defaults and behaviour, checked against the
code that decides them (the proto comments have tests/proto/test_comment_truths.py)."""

from __future__ import annotations

import re
from pathlib import Path

from shardlm_server.gateway.config import default, spec_of
from shardlm_server.gateway.serve.default_model import DEFAULT_MODEL_NAME

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def test_the_decode_call_sizing_the_readme_states_is_the_default():
    claim = re.search(r"as many as fit in `--decode-call-ms`, (\d+) ms, at the recent step\s+"
                      r"time, up to `--max-decode-steps`, (\d+)\)", README)
    assert claim, "the README no longer says how decode calls are sized"
    assert float(claim.group(1)) == default("decode_call_ms")
    assert int(claim.group(2)) == default("max_decode_steps")


def test_the_model_flag_names_the_model_served_by_default():
    assert default("model") is None  # unset means the default model
    assert DEFAULT_MODEL_NAME in spec_of("model").help
    assert "shakespeare" not in spec_of("model").help
