"""The SMG engine service (gateway/api/smg_service.py) and the load report, driven with a plain gRPC
client on SMG's own stubs against a live gateway."""

from __future__ import annotations

import asyncio
import io
import json
import time
import zipfile

import grpc
import pytest
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2

pytest.importorskip("smg_grpc_proto")
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2 as engine_pb2  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as engine_pb2_grpc  # noqa: E402

from shardlm_server.gateway.text.tokenizer import Tokenizer  # noqa: E402
from tests.gateway.smg_fixtures import chat_checkpoint, loaded_gateway  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("smg-llama"))


@pytest.fixture(scope="module")
def gateway(model):
    live = loaded_gateway(model)
    yield live
    live.close()


@pytest.fixture(scope="module")
def engine(gateway):
    return engine_pb2_grpc.VllmEngineStub(gateway.channel)


def prompt_ids(gateway, text: str) -> list[int]:
    return list(gateway.stub.Tokenize(gateway_pb2.TokenizeRequest(text=text)).token_ids)


def generate(engine, ids, *, stream: bool, request_id: str = "r", **sampling):
    request = engine_pb2.GenerateRequest(
        request_id=request_id, tokenized=engine_pb2.TokenizedInput(input_ids=ids), stream=stream,
        sampling_params=engine_pb2.SamplingParams(**sampling))
    return list(engine.Generate(request))


def test_generate_matches_shardlm_generate(gateway, engine):
    ids = prompt_ids(gateway, "To be, or not to be")
    reference = list(gateway.stub.Generate(gateway_pb2.GenerateRequest(
        token_ids={"token_ids": ids}, sampling={"temperature": 0}, stop={"max_new_tokens": 10})))
    expected = [t for m in reference for t in m.token_ids]
    whole = generate(engine, ids, stream=False, temperature=0, max_tokens=10)
    assert len(whole) == 1 and whole[0].WhichOneof("response") == "complete"
    complete = whole[0].complete
    assert list(complete.output_ids) == expected
    assert complete.prompt_tokens == len(ids) and complete.completion_tokens == len(expected)
    assert complete.finish_reason == ("length" if len(expected) == 10 else "stop")

    streamed = generate(engine, ids, stream=True, temperature=0, max_tokens=10)
    chunks = [m.chunk for m in streamed[:-1]]
    assert all(m.WhichOneof("response") == "chunk" for m in streamed[:-1])
    assert [t for c in chunks for t in c.token_ids] == expected
    assert chunks[-1].completion_tokens == len(expected)
    last = streamed[-1].complete
    assert last.finish_reason == complete.finish_reason and not last.output_ids


def test_stop_token_is_reported_as_matched(gateway, engine):
    ids = prompt_ids(gateway, "To be, or not to be")
    first = generate(engine, ids, stream=False, temperature=0, max_tokens=3)[0].complete
    stop_id = first.output_ids[1]
    done = generate(engine, ids, stream=False, temperature=0, max_tokens=3,
                    stop_token_ids=[stop_id])[0].complete
    assert done.finish_reason == "stop" and done.matched_token_id == stop_id
    assert list(done.output_ids) == list(first.output_ids[:2])


def test_abort_ends_the_stream(gateway, engine):
    ids = prompt_ids(gateway, "Whether 'tis nobler")
    request = engine_pb2.GenerateRequest(
        request_id="to-abort", tokenized=engine_pb2.TokenizedInput(input_ids=ids), stream=True,
        sampling_params=engine_pb2.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    call = engine.Generate(request)
    first = next(call)
    assert first.WhichOneof("response") == "chunk"
    engine.Abort(engine_pb2.AbortRequest(request_ids=["to-abort", "unknown-id"]))
    rest = list(call)
    assert rest[-1].complete.finish_reason == "abort"
    assert rest[-1].complete.completion_tokens < 400
    assert gateway.call(_released(gateway))  # the scheduler let the sequence go


def test_abort_under_load_answers_at_once_and_frees_the_sequence_before_the_next_call(
        gateway, engine):
    ids = prompt_ids(gateway, "Now is the winter of our discontent")
    tokens = 300
    calls = [engine.Generate(engine_pb2.GenerateRequest(
        request_id=f"load-{i}", tokenized=engine_pb2.TokenizedInput(input_ids=ids + [i]),
        stream=True, sampling_params=engine_pb2.SamplingParams(
            temperature=0, max_tokens=tokens, ignore_eos=True))) for i in range(6)]
    for call in calls:
        assert next(call).WhichOneof("response") == "chunk"  # all six decode together
    metrics = gateway.metrics

    def decode_calls() -> tuple[float, float]:  # worker decode calls so far, and their sequences
        return (metrics.value("shardlm_decode_batch_size_sequences_count"),
                metrics.value("shardlm_decode_batch_size_sequences_sum"))

    started = time.monotonic()
    engine.Abort(engine_pb2.AbortRequest(request_ids=["load-0"]), timeout=5)
    answered_s = time.monotonic() - started
    calls_then, sequences_then = decode_calls()
    scheduler = gateway.runtime.model.scheduler
    deadline = time.monotonic() + 10
    while scheduler.running != 5:  # the worker call in flight ends; the next one leaves it out
        assert time.monotonic() < deadline, "the aborted sequence stayed in the batch"
        time.sleep(0.002)
    calls_now, sequences_now = decode_calls()
    # Calls that started after the abort and still carried all six sequences: at most one (an
    # abort landing as a call starts). Counted from the calls' sizes, not their number, since
    # on a busy machine this thread can wake several short calls later.
    assert (sequences_now - sequences_then) - 5 * (calls_now - calls_then) <= 1
    assert answered_s < 5  # a hang guard: Abort only signals the call's handler
    aborted = list(calls[0])
    assert aborted[-1].complete.finish_reason == "abort"
    for call in calls[1:]:  # the others go on undisturbed
        assert list(call)[-1].complete.completion_tokens == tokens
    assert gateway.call(_released(gateway))


async def _released(gateway) -> bool:
    """Whether the decode batch empties (the scheduler frees a released sequence on its next
    iteration, so this waits a little for it)."""
    scheduler = gateway.runtime.model.scheduler
    for _ in range(200):
        if scheduler.running == 0:
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.parametrize("sampling, field", [
    ({"n": 2}, "sampling_params.n"),
    ({"min_tokens": 3}, "sampling_params.min_tokens"),
])
def test_unsupported_requests_are_invalid_argument(gateway, engine, sampling, field):
    with pytest.raises(grpc.RpcError) as caught:
        generate(engine, [5, 6], stream=False, **sampling)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details()


SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}},
          "required": ["word"]}


@pytest.mark.parametrize("smg, shard", [
    ({"json_schema": json.dumps(SCHEMA)}, {"json_schema": json.dumps(SCHEMA)}),
    ({"json_object": True}, {"json_object": True}),
    ({"regex": "(to|be)( (or|not|to|be)){1,4}"}, {"regex": "(to|be)( (or|not|to|be)){1,4}"}),
    ({"grammar": 'start: "yes" | "no"'}, {"grammar": 'start: "yes" | "no"'}),
    ({"choice": {"choices": ["question", "nobler"]}}, {"choice": {"choices": ["question",
                                                                               "nobler"]}}),
    ({"structural_tag": json.dumps({"type": "structural_tag", "triggers": ["<f="], "structures": [
        {"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}]})},
     {"structural_tag": json.dumps({"type": "structural_tag", "triggers": ["<f="], "structures": [
         {"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}]})}),
])
def test_constraints_map_onto_shardlm_constraints(gateway, engine, smg, shard):
    ids = prompt_ids(gateway, "To be, or not to be")
    reference = list(gateway.stub.Generate(gateway_pb2.GenerateRequest(
        token_ids={"token_ids": ids}, sampling={"temperature": 0}, stop={"max_new_tokens": 24},
        constraint=shard)))
    expected = [t for m in reference for t in m.token_ids]
    assert reference[-1].usage.constraint_kind == next(iter(shard))
    complete = generate(engine, ids, stream=False, temperature=0, max_tokens=24, **smg)[0].complete
    assert list(complete.output_ids) == expected
    finished = reference[-1].finish_reason
    assert complete.finish_reason == ("length" if finished == common_pb2.FINISH_REASON_LENGTH
                                      else "stop")


def test_a_bad_constraint_is_invalid_argument_naming_it(engine):
    with pytest.raises(grpc.RpcError) as caught:
        generate(engine, [5, 6], stream=False, json_schema='{"type": "objekt"}')
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "json_schema" in caught.value.details() and "objekt" in caught.value.details()


def test_unserved_rpcs_are_unimplemented(engine):
    with pytest.raises(grpc.RpcError) as caught:
        engine.StartProfile(smg_common_pb2.StartProfileRequest())
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_flush_cache_empties_the_prefix_cache(gateway, engine):
    ids = prompt_ids(gateway, "Now is the winter of our discontent made glorious summer " * 4)
    generate(engine, ids, stream=False, temperature=0, max_tokens=2)
    again = generate(engine, ids, stream=False, temperature=0, max_tokens=2)[0].complete
    assert again.cached_tokens > 0  # the prompt's full blocks were published and reused
    done = engine.FlushCache(smg_common_pb2.FlushCacheRequest())
    assert done.success and "flushed" in done.message
    assert gateway.stub.GetLoad(gateway_pb2.GetLoadRequest()).prefix_cache_blocks == 0
    after = generate(engine, ids, stream=False, temperature=0, max_tokens=2)[0].complete
    assert after.cached_tokens == 0  # computed anew: nothing was left to share


def test_model_server_info_and_health(gateway, engine, model):
    info = engine.GetModelInfo(engine_pb2.GetModelInfoRequest())
    assert info.served_model_name == model.name and info.is_generation
    assert info.model_type == "llama" and list(info.architectures) == ["LlamaForCausalLM"]
    assert list(info.eos_token_ids) == [2] and info.bos_token_id == 1
    assert info.vocab_size == 1000 and info.max_context_length == 512
    server = engine.GetServerInfo(engine_pb2.GetServerInfoRequest())
    assert server.server_type == "shardlm-grpc" and server.block_size > 0
    assert engine.HealthCheck(engine_pb2.HealthCheckRequest()).healthy


def test_tokenizer_download_rebuilds_the_same_tokenizer(engine, model):
    chunks = list(engine.GetTokenizer(smg_common_pb2.GetTokenizerRequest()))
    assert chunks[-1].sha256 and not any(c.sha256 for c in chunks[:-1])
    data = b"".join(c.data for c in chunks)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        files = {name: archive.read(name) for name in archive.namelist()}
    assert set(files) == {"tokenizer.json", "tokenizer_config.json"}
    config = json.loads(files["tokenizer_config.json"])
    assert config["chat_template"] and config["bos_token"] == "<s>"
    original = Tokenizer.from_pretrained(model)
    text = "To be, or not to be, café 🙂"
    folder = model.parent / "downloaded-tokenizer"
    folder.mkdir(exist_ok=True)
    for name, body in files.items():
        (folder / name).write_bytes(body)
    rebuilt = Tokenizer.from_pretrained(folder)
    assert rebuilt.encode(text) == original.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert rebuilt.encode_chat(messages) == original.encode_chat(messages)


def test_load_report_in_both_apis(gateway, engine):
    report = gateway.stub.GetLoad(gateway_pb2.GetLoadRequest())
    assert report.loaded and report.block_size > 0
    assert report.kv_blocks_used + report.kv_blocks_free == report.kv_blocks_total
    assert report.prefix_cache_blocks == gateway.runtime.model.allocator.cached_blocks
    metrics = gateway.metrics
    assert metrics.value("shardlm_kv_blocks_total") == report.kv_blocks_total
    assert metrics.value("shardlm_prefix_cache_blocks") == report.prefix_cache_blocks
    session = gateway.stub.Prefill(gateway_pb2.PrefillRequest(text="To be"))
    try:
        held = gateway.stub.GetLoad(gateway_pb2.GetLoadRequest())
        assert held.sessions == report.sessions + 1
        assert held.kv_blocks_used > report.kv_blocks_used
        loads = engine.GetLoads(engine_pb2.GetLoadsRequest())
        assert loads.dp_rank_count == 1 and len(loads.loads) == 1
        load = loads.loads[0]
        assert load.num_used_tokens == held.kv_blocks_used * held.block_size
        assert load.max_total_num_tokens == held.kv_blocks_total * held.block_size
        assert 0 < load.token_usage <= 1
    finally:
        gateway.stub.ResetCache(gateway_pb2.ResetCacheRequest(session_ids=[session.session_id]))
    with pytest.raises(grpc.RpcError) as caught:
        engine.GetLoads(engine_pb2.GetLoadsRequest(dp_rank=1))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _next_batches(engine, start: int, count: int) -> list:
    stream = engine.SubscribeKvEvents(smg_common_pb2.SubscribeKvEventsRequest(
        start_sequence_number=start))
    got = []
    try:
        for batch in stream:
            if batch.events:  # load-only heartbeats carry none
                got.append(batch)
            if len(got) == count:
                return got
    finally:
        stream.cancel()
    return got


def test_kv_events_report_stored_blocks_a_resume_and_a_clear(gateway, engine):
    engine.FlushCache(smg_common_pb2.FlushCacheRequest())
    (opening,) = _next_batches(engine, 0, 1)
    assert opening.HasField("snapshot") and opening.events[0].WhichOneof("data") == "cleared"
    ids = prompt_ids(gateway, "Friends, Romans, countrymen, lend me your ears; " * 3)
    generate(engine, ids, stream=False, temperature=0, max_tokens=2)
    block = gateway.runtime.model.allocator.block_size
    batches = _next_batches(engine, opening.sequence_number, 1)
    assert batches[0].sequence_number == opening.sequence_number + 1
    stored = [b for e in batches[0].events if e.WhichOneof("data") == "stored"
              for b in e.stored.blocks]
    assert stored and all(b.block_size == block for b in stored)
    assert list(stored[0].token_ids) == ids[:block]  # what a router hashes to find it
    assert batches[0].load.max_total_num_tokens > 0
    # A subscriber that lost its stream resumes where it stopped: the same batch again.
    again = _next_batches(engine, opening.sequence_number, 1)
    assert again[0].SerializeToString() == batches[0].SerializeToString()
    engine.FlushCache(smg_common_pb2.FlushCacheRequest())
    cleared = _next_batches(engine, batches[0].sequence_number, 1)[0]
    assert [e.WhichOneof("data") for e in cleared.events] == ["cleared"]
    with pytest.raises(grpc.RpcError) as caught:
        _next_batches(engine, 5, 1)  # not a number this gateway ever sent
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS


def test_every_load_report_carries_throughput_hit_rate_and_queued_work(gateway, engine):
    ids = prompt_ids(gateway, "Once more unto the breach, dear friends, once more; " * 3)
    generate(engine, ids, stream=False, temperature=0, max_tokens=8)
    generate(engine, ids, stream=False, temperature=0, max_tokens=8)
    load = engine.GetLoads(engine_pb2.GetLoadsRequest()).loads[0]
    assert load.gen_throughput > 0 and 0 < load.cache_hit_rate < 1
    assert load.max_running_requests == gateway.runtime.limits.max_running
    assert load.num_waiting_reqs == 0 and load.num_waiting_uncached_tokens == 0
    # ShardLM's own GetLoad and the Prometheus gauges carry the same numbers.
    own = gateway.stub.GetLoad(gateway_pb2.GetLoadRequest())
    metrics = gateway.metrics
    assert own.max_running_sequences == load.max_running_requests
    assert metrics.value("shardlm_max_running_sequences") == load.max_running_requests
    assert own.prefix_cache_hit_rate == pytest.approx(load.cache_hit_rate)
    assert metrics.value("shardlm_prefix_cache_hit_ratio") == pytest.approx(load.cache_hit_rate)
    # A rate read later may have a second more to divide by: the same order, not the same value.
    for rate in (own.generated_tokens_per_second,
                 metrics.value("shardlm_generation_tokens_per_second")):
        assert load.gen_throughput / 3 < rate <= load.gen_throughput * 1.01
    assert own.waiting_uncached_prompt_tokens == 0
    assert metrics.value("shardlm_waiting_uncached_prompt_tokens") == 0
