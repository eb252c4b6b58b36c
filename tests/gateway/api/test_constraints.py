"""Constrained decoding through ShardLM's own API, on a live gateway with a worker: every kind,
sessions (a turn's constraint spans its Prefill and Decodes), preemption by recompute, bad
constraints refused without touching other requests, usage and metrics."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2

from tests.gateway.smg_fixtures import chat_checkpoint, loaded_gateway

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 5},
                                           "ok": {"type": "boolean"},
                                           "size": {"enum": ["S", "M", "L"]}},
          "required": ["word", "ok", "size"], "additionalProperties": False}
WORDS = r"(to|be|or|not)( (to|be|or|not)){%d,%d}"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    live = loaded_gateway(chat_checkpoint(tmp_path_factory.mktemp("constrained")))
    yield live
    live.close()


def generate(gateway, constraint: dict | None, *, prompt: str = "To be, or not to be",
             max_new_tokens: int = 64, temperature: float = 0.0, seed: int | None = None):
    sampling = {"temperature": temperature, **({"seed": seed} if seed is not None else {})}
    request = gateway_pb2.GenerateRequest(text=prompt, sampling=sampling,
                                          stop={"max_new_tokens": max_new_tokens},
                                          constraint=constraint)
    chunks = list(gateway.stub.Generate(request))
    return "".join(c.text for c in chunks), chunks[-1]


def test_a_json_schema_gives_json_that_validates(gateway):
    for temperature, seed in ((0.0, None), (1.0, 7), (1.0, 8)):
        text, last = generate(gateway, {"json_schema": json.dumps(SCHEMA)},
                              temperature=temperature, seed=seed)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert last.finish_reason == common_pb2.FINISH_REASON_GRAMMAR_COMPLETE
        assert last.usage.constraint_kind == "json_schema"


@pytest.mark.parametrize("constraint, check", [
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ({"regex": WORDS % (2, 4)}, lambda t: re.fullmatch(WORDS % (2, 4), t)),
    ({"choice": {"choices": ["question", "nobler", "sea of troubles"]}},
     lambda t: t in ("question", "nobler", "sea of troubles")),
    ({"grammar": 'start: "(" item (", " item){1,3} ")"\nitem: "to" | "be"'},
     lambda t: re.fullmatch(r"\((to|be)(, (to|be)){1,3}\)", t)),
    ({"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),  # GBNF
])
def test_every_kind_constrains_the_text(gateway, constraint, check):
    text, last = generate(gateway, constraint, max_new_tokens=200)
    if "json_object" not in constraint:  # an open object may run to the budget on random weights
        assert last.finish_reason == common_pb2.FINISH_REASON_GRAMMAR_COMPLETE, text
        assert check(text), text
    assert last.usage.constraint_kind == next(iter(constraint))


def test_a_structural_tag_constrains_only_what_follows_its_trigger(gateway):
    tag = {"type": "structural_tag", "triggers": ["<f"], "structures": [
        {"begin": "<f=get>", "schema": SCHEMA, "end": "</f>"}]}
    text, last = generate(gateway, {"structural_tag": json.dumps(tag)}, max_new_tokens=48)
    for match in re.finditer(r"<f", text):  # every region opened is complete and valid
        region = re.match(r"<f=get>(.*?)</f>", text[match.start():])
        if region is not None:
            jsonschema.validate(json.loads(region.group(1)), SCHEMA)
    assert last.usage.constraint_kind == "structural_tag"


@pytest.mark.parametrize("constraint, reason, field", [
    ({"json_schema": "{not json"}, "INVALID_CONSTRAINT", "constraint.json_schema"),
    ({"json_schema": '{"type": "objekt"}'}, "INVALID_CONSTRAINT", "constraint.json_schema"),
    ({"json_schema": "[1, 2]"}, "INVALID_CONSTRAINT", "constraint.json_schema"),
    ({"regex": "a(b"}, "INVALID_CONSTRAINT", "constraint.regex"),
    ({"grammar": "start: missing_rule"}, "INVALID_CONSTRAINT", "constraint.grammar"),
    ({"choice": {"choices": []}}, "INVALID_CONSTRAINT", "constraint.choice"),
    ({"structural_tag": '{"type": "structural_tag"}'}, "INVALID_CONSTRAINT",
     "constraint.structural_tag"),
    ({"json_schema": json.dumps({"enum": ["x" * 1000] * 80})}, "CONSTRAINT_TOO_LARGE",
     "constraint.json_schema"),
])
def test_a_bad_constraint_is_refused_by_name(gateway, constraint, reason, field):
    with pytest.raises(grpc.RpcError) as caught:
        generate(gateway, constraint)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details()
    assert "Traceback" not in caught.value.details()
    assert gateway.metrics.value("shardlm_constraint_failures_total", {"reason": reason}) >= 1


def test_a_failing_constraint_touches_no_other_request(gateway):
    expected, _ = generate(gateway, {"regex": WORDS % (3, 6)})
    with ThreadPoolExecutor(8) as pool:
        good = [pool.submit(generate, gateway, {"regex": WORDS % (3, 6)}) for _ in range(4)]
        bad = [pool.submit(generate, gateway, {"regex": "(unclosed"}) for _ in range(4)]
        assert all(f.result()[0] == expected for f in good)
        for f in bad:
            with pytest.raises(grpc.RpcError):
                f.result()


def test_a_session_turn_keeps_its_constraint_across_decode_calls(gateway):
    choices = ["sea of troubles", "slings and arrows"]
    first = gateway.stub.Prefill(gateway_pb2.PrefillRequest(
        text="Or to take arms against a", sampling={"temperature": 0},
        constraint={"choice": {"choices": choices}}))
    text = first.first_token.text
    assert first.usage.constraint_kind == "choice"
    for _ in range(20):  # one token per call: the constraint goes on where it stopped
        chunks = list(gateway.stub.Decode(gateway_pb2.DecodeRequest(
            session_id=first.session_id, stop={"max_new_tokens": 1})))
        text += "".join(c.text for c in chunks)
        if chunks[-1].finish_reason == common_pb2.FINISH_REASON_GRAMMAR_COMPLETE:
            break
    assert text in choices
    done = list(gateway.stub.Decode(gateway_pb2.DecodeRequest(session_id=first.session_id)))
    assert [c.finish_reason for c in done] == [common_pb2.FINISH_REASON_GRAMMAR_COMPLETE]
    assert not done[0].token_ids
    # A Decode with a new constraint starts it at its first token; an empty one removes it.
    chunks = list(gateway.stub.Decode(gateway_pb2.DecodeRequest(
        session_id=first.session_id, constraint={"regex": "( (to|be)){2}"})))
    assert re.fullmatch("( (to|be)){2}", "".join(c.text for c in chunks))
    chunks = list(gateway.stub.Decode(gateway_pb2.DecodeRequest(
        session_id=first.session_id, constraint={}, stop={"max_new_tokens": 3})))
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].usage.constraint_kind == ""
    gateway.stub.ResetCache(gateway_pb2.ResetCacheRequest(session_ids=[first.session_id]))


def test_constrained_sequences_survive_preemption(tmp_path_factory):
    """A KV cache too small for every sequence at once: some are preempted and recomputed, and
    their constrained output is the same as when each runs alone."""
    live = loaded_gateway(chat_checkpoint(tmp_path_factory.mktemp("preempted")))
    try:
        for _ in live.stub.Load(gateway_pb2.LoadRequest(
                model_path=live.runtime.model.info.model_path,
                kv_cache={"block_size": 16, "num_blocks": 16})):
            pass
        prompts = [f"{w} to be, or not to be" for w in ("Once", "Twice", "Thrice", "Again")]
        pattern = WORDS % (40, 50)
        alone = [generate(live, {"regex": pattern}, prompt=p, max_new_tokens=120)[0]
                 for p in prompts]
        before = live.metrics.value("shardlm_preemptions_total")
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: generate(live, {"regex": pattern}, prompt=p,
                                                        max_new_tokens=120)[0], prompts))
        assert live.metrics.value("shardlm_preemptions_total") > before
        assert together == alone
        assert all(re.fullmatch(pattern, t) for t in alone)
    finally:
        live.close()


def test_tensor_parallel_workers_finish_a_completed_grammar_together(gateway, tmp_path_factory):
    """Only rank 0 runs the grammar: it tells rank 1 which sequences a step completed, so both
    stop them at the same token (before, rank 1 stepped on alone and the step timed out)."""
    split = loaded_gateway(chat_checkpoint(tmp_path_factory.mktemp("split")), workers=2)
    try:
        for regex in (WORDS % (2, 4), WORDS % (0, 30)):
            for constraint in ({"regex": regex}, {"choice": {"choices": ["to be", "or not"]}}):
                one, two = (generate(g, constraint, max_new_tokens=48) for g in (gateway, split))
                assert two[0] == one[0]
                assert two[1].finish_reason == one[1].finish_reason
        assert split.kv_used() == 0
    finally:
        split.close()


def test_metrics_count_kinds_compiles_and_masks(gateway):
    generate(gateway, {"choice": {"choices": ["be", "not"]}})
    assert gateway.metrics.value("shardlm_constrained_requests_total", {"kind": "choice"}) >= 1
    assert gateway.metrics.value("shardlm_constraint_compile_seconds_count",
                                 {"kind": "choice"}) >= 1
    assert gateway.metrics.value("shardlm_constraint_mask_seconds_count") >= 1
