"""How many sessions exist at once (`--max-sessions`) and how long an idle one lives: serve
settings like every other (flag, file, environment), enforced by the loaded model's session
store, whose own defaults are the serve defaults."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from shardlm.common.v1 import common_pb2
from shardlm.errors import ResourceExhaustedError

from shardlm_server.gateway.batching.sessions import SessionStore
from shardlm_server.gateway.config import ConfigError, Limits, default
from shardlm_server.gateway.metrics import Metrics
from shardlm_server.gateway.serve.config_sources import add_serve_arguments, resolve
from tests.gateway.api.test_runtime import TINY_MODEL, StandInPool, stand_in_runtime
from tests.gateway.batching.test_sequence import sequence


def limits(argv: list[str], environ: dict[str, str] | None = None) -> Limits:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    return resolve(vars(args), args.config, environ or {}).limits


def test_max_sessions_comes_from_the_flag_the_file_or_the_environment(tmp_path):
    assert limits([]).max_sessions == default("max_sessions") == 10_000
    assert limits(["--max-sessions", "3"]).max_sessions == 3
    config = tmp_path / "serve.toml"
    config.write_text("max_sessions = 4\n")
    assert limits(["--config", str(config)]).max_sessions == 4
    assert limits([], {"SHARDLM_MAX_SESSIONS": "5"}).max_sessions == 5
    with pytest.raises(ConfigError, match="--max-sessions"):
        limits(["--max-sessions", "0"])


def test_the_store_refuses_a_session_beyond_the_limit_until_one_ends():
    store = SessionStore(max_sessions=2)
    first = store.create(sequence())
    store.create(sequence())
    with pytest.raises(ResourceExhaustedError) as err:
        store.create(sequence())
    assert err.value.reason == "QUEUE_FULL"
    store.remove(first.session_id)
    store.create(sequence())
    assert len(store) == 2


def test_the_stores_defaults_are_the_serve_defaults():
    store = SessionStore()
    assert store.idle_timeout_s == default("session_idle_timeout")
    assert store.max_sessions == default("max_sessions")


def test_a_loaded_model_keeps_the_configured_sessions():
    async def scenario() -> SessionStore:
        runtime = stand_in_runtime(Metrics(), StandInPool())
        runtime.limits = Limits(max_sessions=7, session_idle_timeout_s=30.0)
        await runtime.load(str(TINY_MODEL), common_pb2.DTYPE_UNSPECIFIED, 0, None,
                           lambda _p: None)
        sessions = runtime.model.sessions
        await runtime.close()
        return sessions

    sessions = asyncio.run(scenario())
    assert (sessions.max_sessions, sessions.idle_timeout_s) == (7, 30.0)
