"""`shardlm serve` settings: one table, merged flags > file > environment > defaults, validated
once, shown in --help, and the engine options carried to the workers in every Load."""

from __future__ import annotations

import argparse
import asyncio
import json
from concurrent import futures

import grpc
import pytest
from shardlm.common.v1 import common_pb2
from shardlm.worker.v1 import worker_pb2, worker_pb2_grpc

from shardlm_server.gateway.config import (
    SETTINGS,
    ConfigError,
    Limits,
    ServeConfig,
    default,
    env_var,
    flag,
)
from shardlm_server.gateway.serve import cli
from shardlm_server.gateway.serve.config_sources import add_serve_arguments, resolve
from shardlm_server.gateway.workers.client import WorkerPool
from shardlm_server.worker import ops
from shardlm_server.worker.decode_runner import GraphConfig
from shardlm_server.worker.worker_servicer import WorkerServicer


def config(argv: list[str] = (), environ: dict[str, str] | None = None) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(list(argv))
    return resolve(vars(args), args.config, environ or {})


# ----------------------------------------------------------------- precedence


def test_defaults_come_from_the_table():
    cfg = config()
    assert cfg == ServeConfig()
    assert (cfg.port, cfg.block_size, cfg.cuda_graphs, cfg.tp) == (50051, 16, True, None)
    assert cfg.limits == Limits()  # the runtime's view keeps the same defaults


def test_flag_beats_file_beats_env_beats_default(tmp_path):
    file = tmp_path / "serve.toml"
    file.write_text("block_size = 32\nmax_running = 64\n")
    environ = {"SHARDLM_BLOCK_SIZE": "8", "SHARDLM_MAX_RUNNING": "4", "SHARDLM_MAX_WAITING": "9"}
    cfg = config(["--config", str(file), "--block-size", "64"], environ)
    assert cfg.block_size == 64  # flag over file and env
    assert cfg.max_running == 64  # file over env
    assert cfg.max_waiting == 9  # env over default
    assert cfg.prefill_token_budget == default("prefill_token_budget")
    assert cfg.limits.max_running == 64 and cfg.limits.max_waiting == 9


def test_config_file_can_come_from_the_environment(tmp_path):
    file = tmp_path / "serve.json"
    file.write_text(json.dumps({"port": 7000}))
    assert config([], {"SHARDLM_CONFIG": str(file)}).port == 7000


def test_toml_and_json_files_give_the_same_settings(tmp_path):
    toml = tmp_path / "serve.toml"
    toml.write_text('model = "/m"\ndtype = "float32"\ncuda_graphs = false\n'
                    'session_idle_timeout = 5\nmetrics_port = 9400\n')
    js = tmp_path / "serve.json"
    js.write_text(json.dumps({"model": "/m", "dtype": "float32", "cuda_graphs": False,
                              "session_idle_timeout": 5, "metrics_port": 9400}))
    from_toml, from_json = config(["--config", str(toml)]), config(["--config", str(js)])
    assert from_toml == from_json
    assert from_toml.session_idle_timeout == 5.0 and from_toml.cuda_graphs is False


def test_boolean_flags_and_env_words():
    assert config(["--no-cuda-graphs"], {"SHARDLM_CUDA_GRAPHS": "1"}).cuda_graphs is False
    assert config(["--cpu-simd"], {"SHARDLM_CPU_SIMD": "off"}).cpu_simd is True
    assert config([], {"SHARDLM_CUDA_GRAPHS": "0"}).cuda_graphs is False
    assert config([], {"SHARDLM_NO_MODEL": "true"}).no_model is True
    assert config([], {"SHARDLM_BLOCK_SIZE": "  "}).block_size == 16  # blank is unset


# ----------------------------------------------------------------- validation


@pytest.mark.parametrize("argv, environ, message", [
    (["--kv-cache-mb", "-1"], {}, "--kv-cache-mb must be at least 0, not -1 (from --kv-cache-mb)"),
    (["--block-size", "0"], {}, "--block-size must be at least 1"),
    ([], {"SHARDLM_MAX_RUNNING": "-3"}, "(from SHARDLM_MAX_RUNNING)"),
    ([], {"SHARDLM_PORT": "http"}, "SHARDLM_PORT: expected an integer, not 'http'"),
    (["--step-timeout", "0"], {}, "--step-timeout must be positive"),
    (["--port", "70000"], {}, "--port must be at most 65535"),
    (["--dtype", "int8"], {}, "--dtype must be one of float32, bfloat16, float16"),
    ([], {"SHARDLM_CUDA_GRAPHS": "maybe"}, "SHARDLM_CUDA_GRAPHS: expected on/off"),
    (["--tp", "2", "--devices", "0,1"], {}, "--tp and --devices cannot be used together"),
    (["--devices", "0,1"], {"SHARDLM_TP": "2"}, "--tp from SHARDLM_TP; --devices from --devices"),
    (["--workers", "a:1", "--tp", "2"], {}, "--workers and --tp cannot be used together"),
    (["--devices", "0,x"], {}, "--devices must be comma-separated GPU ids"),
    (["--worker-tls-ca", "ca.pem", "--worker-tls-key", "k.pem"], {},
     "go together: --worker-tls-cert missing"),
    (["--tls-key", "k.pem"], {}, "--tls-cert and --tls-key go together"),
    (["--default-max-new-tokens", "500", "--max-new-tokens", "100"], {},
     "--default-max-new-tokens (500) must not exceed --max-new-tokens (100)"),
])
def test_bad_settings_name_the_setting_and_its_source(argv, environ, message):
    with pytest.raises(ConfigError) as err:
        config(argv, environ)
    assert message in str(err.value)


def test_bad_files(tmp_path):
    unknown = tmp_path / "a.toml"
    unknown.write_text("block_size = 16\nblok_size = 8\ncolour = 1\n")
    with pytest.raises(ConfigError, match=r"unknown keys in .*a.toml: blok_size, colour"):
        config(["--config", str(unknown)])
    wrong = tmp_path / "b.json"
    wrong.write_text(json.dumps({"port": "50051"}))
    with pytest.raises(ConfigError, match="port must be an integer, not '50051'"):
        config(["--config", str(wrong)])
    flag_as_number = tmp_path / "c.json"
    flag_as_number.write_text(json.dumps({"cuda_graphs": 0}))
    with pytest.raises(ConfigError, match="cuda_graphs must be true or false"):
        config(["--config", str(flag_as_number)])
    broken = tmp_path / "d.toml"
    broken.write_text("port = [")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        config(["--config", str(broken)])
    with pytest.raises(ConfigError, match="cannot read config file"):
        config(["--config", str(tmp_path / "missing.toml")])


def test_cli_prints_one_line_and_exits_2(capsys, monkeypatch):
    monkeypatch.setenv("SHARDLM_MAX_WAITING", "0")
    assert cli.main(["--no-model"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --max-waiting must be at least 1, not 0 (from SHARDLM_MAX_WAITING)\n"


def test_help_shows_every_flag_with_its_default_and_env_var(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for name in SETTINGS:
        assert flag(name) in text and env_var(name) in text, name
    for shown in ("[default: 16; env: SHARDLM_BLOCK_SIZE]", "[default: 50051; env: SHARDLM_PORT]",
                  "[default: on; env: SHARDLM_CUDA_GRAPHS]", "--no-cuda-graphs",
                  "[default: 128; env: SHARDLM_CUDA_GRAPH_MAX_BATCH]",
                  "[default: on; env: SHARDLM_CPU_SIMD]", "[default: 120.0; env: SHARDLM_STEP_TIMEOUT]"):
        assert shown in text, shown


# ----------------------------------------------------------------- engine options reach the workers


class _RecordingCall:
    """One Load stream as the worker client reads it: a LoadComplete, then the end."""

    def __init__(self) -> None:
        self._events = [worker_pb2.LoadResponse(complete=worker_pb2.LoadComplete()), grpc.aio.EOF]

    async def read(self):
        return self._events.pop(0)

    def cancel(self) -> None:
        pass


class _RecordingStub:
    def __init__(self) -> None:
        self.requests: list[worker_pb2.LoadRequest] = []

    def Load(self, request):  # noqa: N802 - the gRPC method name
        self.requests.append(request)
        return _RecordingCall()


def test_engine_env_vars_reach_the_load_request():
    cfg = config([], {"SHARDLM_CUDA_GRAPHS": "0", "SHARDLM_CUDA_GRAPH_MAX_BATCH": "32",
                      "SHARDLM_CPU_SIMD": "0", "SHARDLM_COMM_TIMEOUT": "7",
                      "SHARDLM_ACTIVATION_PRECISION": "int8", "SHARDLM_SPECULATION": "ngram",
                      "SHARDLM_SPECULATIVE_TOKENS": "4"})
    stub = _RecordingStub()
    options = cfg.load_options

    async def load() -> None:
        pool = WorkerPool(["127.0.0.1:1"], step_timeout_s=5)
        pool.stubs = [stub]
        await pool.load("/m", engine_options=options.engine,
                        comm_timeout_s=options.comm_timeout_s)
        await pool.close()

    asyncio.run(load())
    (request,) = stub.requests
    assert request.engine == worker_pb2.EngineOptions(
        disable_cuda_graphs=True, cuda_graph_max_batch=32, cuda_graph_max_context=16384,
        disable_cpu_simd=True, activation_precision="int8", speculation="ngram",
        speculative_tokens=4)
    assert request.comm.timeout_seconds == 7


def test_a_worker_runs_with_the_options_it_is_sent(llama_dir):
    """Gateway settings -> LoadRequest -> a real worker servicer: its engine takes the graph
    bounds and the CPU kernels leave their AVX2 paths, with no environment involved."""
    simd_supported = ops.cpu_simd_active()
    servicer = WorkerServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    async def load(cfg) -> None:
        pool = WorkerPool([f"127.0.0.1:{port}"], step_timeout_s=60)
        try:
            await pool.load(str(llama_dir), dtype=common_pb2.DTYPE_FLOAT32,
                            kv_cache=cfg.kv_cache(), engine_options=cfg.load_options.engine)
        finally:
            await pool.close()

    try:
        for argv, simd in ((["--no-cpu-simd", "--no-cuda-graphs",
                             "--cuda-graph-max-context", "512"], False), ([], True)):
            cfg = config(["--kv-cache-mb", "4", *argv])
            asyncio.run(load(cfg))
            engine = servicer._engine
            assert engine.graph_config == GraphConfig(enabled=cfg.cuda_graphs, max_batch=128,
                                                      max_context=cfg.cuda_graph_max_context)
            assert engine.runner.config == engine.graph_config
            assert ops.cpu_simd_active() is (simd and simd_supported)
    finally:
        ops.set_cpu_simd(True)
        server.stop(0)


def test_the_kv_cache_request_carries_its_dtype_and_the_running_sequences():
    default = config([]).kv_cache()
    assert default.dtype == common_pb2.DTYPE_UNSPECIFIED  # auto: the serving dtype
    assert default.max_running_sequences == config([]).max_running
    cfg = config(["--kv-cache-dtype", "bfloat16", "--max-running", "8"])
    assert (cfg.kv_cache().dtype, cfg.kv_cache().max_running_sequences) == (
        common_pb2.DTYPE_BFLOAT16, 8)
    with pytest.raises(ConfigError, match="kv_cache_dtype|kv-cache-dtype"):
        config(["--kv-cache-dtype", "int8"])
