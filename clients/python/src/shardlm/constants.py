"""Values that the SDK, the gateway and the workers must agree on, in one place.

Both server halves import this module (it pulls in nothing else), so neither has to import the
other to learn a port or a message-size limit.
"""

from __future__ import annotations

DEFAULT_HOST = "127.0.0.1"
DEFAULT_GATEWAY_PORT = 50051
DEFAULT_GATEWAY_ADDRESS = f"{DEFAULT_HOST}:{DEFAULT_GATEWAY_PORT}"
# Gateway <-> worker messages: debug taps of large models are big.
MAX_WORKER_MESSAGE_BYTES = 256 << 20
# Gateway -> worker connections carry an HTTP/2 ping this often, and one whose ping is not
# answered in WORKER_KEEPALIVE_TIMEOUT_MS is closed, failing its calls with UNAVAILABLE (a worker
# host that dropped off the network, where no TCP reset ever comes). Workers accept pings this often.
WORKER_KEEPALIVE_MS = 5000
WORKER_KEEPALIVE_TIMEOUT_MS = 5000
# A client's request to the gateway: a prompt is at most a few MiB of text or token ids.
MAX_REQUEST_BYTES = 8 << 20

# Weight and KV-cache dtypes as the CLI, config files and the engine spell them. Each is the
# lower-case tail of its shardlm.common.v1.Dtype enum value (DTYPE_BFLOAT16 <-> "bfloat16"),
# so both sides derive their name <-> enum maps from this tuple and the proto.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# Tokens per KV-cache block when a KvCacheConfig leaves block_size at 0.
DEFAULT_BLOCK_SIZE = 16
# Sequences the gateway decodes together at most (`serve --max-running`), and the number a
# worker sizes its default KV cache for when a KvCacheConfig leaves max_running_sequences at 0.
DEFAULT_MAX_RUNNING = 256
# The default KV cache (KvCacheConfig with memory_bytes and num_blocks 0) takes what
# max_running_sequences need, but at most this share of free GPU memory, or on CPU of the
# host's available memory.
DEFAULT_GPU_MEMORY_FRACTION = 0.9
DEFAULT_CPU_MEMORY_FRACTION = 0.5
# Seconds the ranks of a load wait for each other and for each collective when the LoadRequest
# leaves CommunicatorConfig.timeout_seconds at 0.
DEFAULT_COMM_TIMEOUT_S = 60.0
# Seconds a spawned or connected worker gets to start and answer its first GetInfo.
DEFAULT_WORKER_START_TIMEOUT_S = 120.0
# How the CPU quantized linears treat their input (`serve --activation-precision`, EngineOptions):
# exact float32 (the default, and what an empty EngineOptions field means); int8, the opt-in
# fast mode that rounds each 32-element block of the input as GGML's Q8_0 does; or int16, which
# rounds each 32-element block of the input and of the weights to 14-bit integers in prefills and
# batched steps (32 rows or more), near-exact.
ACTIVATION_PRECISIONS = ("exact", "int8", "int16")
# Speculative decoding without a draft model (`serve --speculation`, EngineOptions): "ngram"
# verifies prompt-lookup drafts, "off" decodes one token per step, "auto" (the default, and what
# an empty EngineOptions field means) is ngram on CPU and off on CUDA, where it is not measured.
SPECULATION_MODES = ("auto", "ngram", "off")
# How long a CPU worker may hold a decode step's tokens to send them with the next steps' in one
# message, when the gateway's --stream-interval-ms is unset (DecodeRequest.stream_interval_ms).
# On a CPU host the gateway's and the worker's gRPC threads take their time from the compute
# threads' cores, so fewer messages decode faster; a GPU worker, not measured, sends every step.
DEFAULT_CPU_STREAM_INTERVAL_MS = 20
# Drafts one sequence verifies in a step at most, when the planner chooses (a fixed count is
# EngineOptions.speculative_tokens).
DEFAULT_MAX_DRAFT_TOKENS = 8
# The most drafts per sequence and step a fixed count may ask for.
MAX_SPECULATIVE_TOKENS = 32
# Decode CUDA graphs serve batches and contexts up to these sizes (EngineOptions' zero values).
DEFAULT_CUDA_GRAPH_MAX_BATCH = 128
DEFAULT_CUDA_GRAPH_MAX_CONTEXT = 16384


def dtype_enum_name(name: str) -> str:
    """The shardlm.common.v1.Dtype value name of a dtype name: "bfloat16" -> "DTYPE_BFLOAT16"."""
    return f"DTYPE_{name.upper()}"
