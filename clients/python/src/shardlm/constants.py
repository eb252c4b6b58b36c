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
# Weight dtypes by name, as the command lines and the SDK's `dtype=` take them.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
