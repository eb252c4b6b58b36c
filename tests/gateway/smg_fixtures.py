"""Shared by the SMG tests: a tiny checkpoint with a chat template (SMG renders chats itself, so
both sides need the same template), and a live gateway that has loaded it."""

from __future__ import annotations

import json
from pathlib import Path

from shardlm.gateway.v1 import gateway_pb2

from shardlm_server.gateway.api.runtime import Limits
from tests.checkpoints import LLAMA, build_checkpoint
from tests.gateway.conftest import LiveGateway

# Plain enough for both jinja2 (ShardLM) and minijinja (SMG).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def chat_checkpoint(folder: Path) -> Path:
    build_checkpoint(folder, LLAMA)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config), encoding="utf-8")
    return folder


def loaded_gateway(model: Path) -> LiveGateway:
    gateway = LiveGateway(1, Limits())
    for _ in gateway.stub.Load(gateway_pb2.LoadRequest(model_path=str(model))):
        pass
    return gateway
