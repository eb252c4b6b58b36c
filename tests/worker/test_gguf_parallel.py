"""A GGUF model split over two worker processes: each rank dequantizes only its slices (column
slices of 256-wide K-quant blocks split inside a block), and the served greedy tokens still equal
transformers' on the same file."""

from __future__ import annotations

import pytest
import torch
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2

from shardlm_server.gateway.api.runtime import Limits
from shardlm_server.worker.gguf.file import SUPPORTED_TYPES
from tests.gateway.conftest import LiveGateway
from tests.gguf_files import GGUFSpec, T, every_type_once, write_gguf


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-tp")
    types = [t for t in SUPPORTED_TYPES if t != T.F32]
    write_gguf(folder / "model.gguf", every_type_once(GGUFSpec("llama"), types, offset=3))
    return folder


def test_two_ranks_serve_the_same_greedy_tokens_as_transformers(folder):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="model.gguf",
                                                     dtype=torch.float32).eval()
    prompt = [5, 77, 140, 9, 300, 31, 64, 12]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    gateway = LiveGateway(2, Limits())
    try:
        events = list(gateway.stub.Load(gateway_pb2.LoadRequest(
            model_path=str(folder / "model.gguf"), dtype=common_pb2.DTYPE_FLOAT32)))
        assert events[-1].model.tensor_parallel_size == 2
        assert events[-1].model.format == common_pb2.CHECKPOINT_FORMAT_GGUF
        chunks = gateway.stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(token_ids=prompt), sampling=common_pb2.SamplingParams(),
            stop=common_pb2.StopConditions(max_new_tokens=12, ignore_eos=True)))
        assert [i for c in chunks for i in c.token_ids] == expected
    finally:
        gateway.close()
