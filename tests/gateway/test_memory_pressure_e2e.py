"""Random concurrent loads in a KV cache too small for them at once, end to end: a gateway over
real workers (one, and two in tensor parallel) on a tiny float32 checkpoint with 4-token blocks.

The calls, Generates and two-turn sessions, share a prompt prefix (the prefix cache attaches
it), and each fits the cache alone; some sample with a seed, some have penalties, stop ids or
logprobs, some are constrained by a grammar, and some Generates are cancelled by their client
part-way. Together
they preempt one another and are recomputed (a session idle between its turns is evicted and
rebuilt); each call's tokens must be the tokens it gives alone (a cancelled one's, a beginning
of them), and when all are done no block is held."""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
from shardlm.common.v1 import common_pb2
from shardlm.gateway.v1 import gateway_pb2

from shardlm_server.gateway.api.runtime import Limits
from tests.gateway.conftest import LiveGateway

BLOCK, BLOCKS = 4, 24
# A grammar a call may complete at any word (GRAMMAR_COMPLETE), or run on to max_new_tokens.
WORDS = r"(to|be|or|not)( (to|be|or|not))*"


def keeps_to_words(text: str) -> bool:
    """Whether `text` begins a sentence of WORDS (a call may stop inside a word)."""
    return any(re.fullmatch(WORDS, text + rest) for rest in ("", "o", "e", "r", "t", "ot", "to"))


@dataclass
class Call:
    session: bool  # a session of two turns, else a Generate
    prompt: list[int]
    sampling: common_pb2.SamplingParams
    max_new: int
    constraint: common_pb2.Constraint | None = None
    stop_ids: list[int] = field(default_factory=list)  # the call stops after one of these
    cancel_after: int | None = None  # a Generate's client cancels it after this many tokens

    def stop(self, max_new: int) -> common_pb2.StopConditions:
        return common_pb2.StopConditions(max_new_tokens=max_new, ignore_eos=True,
                                         stop_token_ids=self.stop_ids)

    def run(self, live: LiveGateway, *, alone: bool = False,
            deadline_s: float | None = None) -> tuple[list[int], str]:
        """Its tokens and text; `alone`: never cancelled (the reference run)."""
        if self.session:
            return self._converse(live)
        return self._stream(live, None if alone else self.cancel_after, deadline_s)

    def _stream(self, live: LiveGateway, cancel_after: int | None,
                deadline_s: float | None) -> tuple[list[int], str]:
        call = live.stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(token_ids=self.prompt), sampling=self.sampling,
            stop=self.stop(self.max_new), constraint=self.constraint), timeout=deadline_s)
        tokens, text = [], ""
        try:
            for chunk in call:
                tokens += list(chunk.token_ids)
                text += chunk.text
                if cancel_after is not None and len(tokens) >= cancel_after:
                    call.cancel()
                    break
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                raise
        return tokens, text

    def _converse(self, live: LiveGateway) -> tuple[list[int], str]:
        """Two turns (the prompt's halves), each a Prefill and a Decode, max_new tokens in all.
        Between the turns the session is idle, its cache evictable."""
        half, first = len(self.prompt) // 2, self.max_new // 2
        session, tokens, text = "", [], ""
        for turn, new in ((self.prompt[:half], first),
                          (self.prompt[half:], self.max_new - first - 2)):
            reply = live.stub.Prefill(gateway_pb2.PrefillRequest(
                session_id=session, token_ids=gateway_pb2.TokenIds(token_ids=turn),
                sampling=self.sampling if not session else None, constraint=self.constraint))
            session = reply.session_id
            tokens.append(reply.first_token.token_id)
            text += reply.first_token.text
            for chunk in live.stub.Decode(gateway_pb2.DecodeRequest(session_id=session,
                                                                    stop=self.stop(new))):
                tokens += list(chunk.token_ids)
                text += chunk.text
            text += "\n"  # the turns' texts, one a line
        live.stub.ResetCache(gateway_pb2.ResetCacheRequest(session_ids=[session]))
        return tokens, text


def random_calls(seed: int) -> list[Call]:
    rng = random.Random(seed)
    shared = [1] + [rng.randrange(3, 990) for _ in range(rng.randint(2, 9))]
    calls = []
    for i in range(6):
        prompt = shared + [rng.randrange(3, 990) for _ in range(rng.randint(1, 6))]
        sampling = common_pb2.SamplingParams()
        if rng.random() < 0.5:
            sampling.MergeFrom(common_pb2.SamplingParams(temperature=0.9, top_k=50,
                                                         seed=seed * 10 + i))
        if rng.random() < 0.5:  # counted over the tokens generated so far, recomputed or not
            sampling.MergeFrom(common_pb2.SamplingParams(
                frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2))
        call = Call(session=rng.random() < 0.3, prompt=prompt, sampling=sampling,
                    max_new=rng.randint(8, BLOCKS * BLOCK - len(prompt) - 2))
        if rng.random() < 0.3:
            call.constraint = common_pb2.Constraint(regex=WORDS)
        if rng.random() < 0.3:  # about one token in fifty stops the call
            call.stop_ids = [rng.randrange(3, 990) for _ in range(20)]
        if rng.random() < 0.3:
            sampling.MergeFrom(common_pb2.SamplingParams(logprobs=True, top_logprobs=2))
        if not call.session and rng.random() < 0.3:
            call.cancel_after = rng.randint(1, call.max_new - 1)
        calls.append(call)
    return calls


@pytest.mark.parametrize("workers", [1, 2])
def test_random_loads_under_memory_pressure_give_each_call_its_own_tokens(llama_dir, workers):
    live = LiveGateway(workers, Limits())
    try:
        list(live.stub.Load(gateway_pb2.LoadRequest(
            model_path=str(llama_dir), dtype=common_pb2.DTYPE_FLOAT32,
            kv_cache=common_pb2.KvCacheConfig(block_size=BLOCK, num_blocks=BLOCKS))))
        preempted = 0.0
        for seed in range(3):
            calls = random_calls(seed)
            alone = [call.run(live, alone=True) for call in calls]
            before = live.metrics.value("shardlm_preemptions_total")
            with ThreadPoolExecutor(len(calls)) as pool:
                together = list(pool.map(lambda call: call.run(live), calls))
            preempted += live.metrics.value("shardlm_preemptions_total") - before
            for call, (own, text), (got, _) in zip(calls, alone, together, strict=True):
                # A constraint may complete, a stop id stop the call, before max_new_tokens.
                assert len(own) == call.max_new or call.constraint or call.stop_ids
                assert got == own[:len(got)]
                assert len(got) == len(own) or call.cancel_after is not None
                if call.constraint is not None:  # each turn's text keeps to the grammar
                    assert all(keeps_to_words(t) for t in text.splitlines()), text
        assert preempted > 0  # the loads did press on the cache
        assert live.kv_used() == 0
    finally:
        live.close()


def test_reconfiguring_the_cache_under_load_ends_every_call_and_serves_on(llama_dir):
    """ResetCache of all with a new cache while calls are queued, prefilling and decoding: each
    ends, complete or UNAVAILABLE (none waits for its deadline), and the new cache serves the
    same tokens."""
    live = LiveGateway(1, Limits())
    try:
        list(live.stub.Load(gateway_pb2.LoadRequest(
            model_path=str(llama_dir), dtype=common_pb2.DTYPE_FLOAT32,
            kv_cache=common_pb2.KvCacheConfig(block_size=BLOCK, num_blocks=BLOCKS))))
        calls = [c for c in random_calls(0) if not c.session]
        alone = [call.run(live, alone=True)[0] for call in calls]

        def outcome(call: Call) -> list[int] | grpc.StatusCode:
            try:
                return call.run(live, alone=True, deadline_s=30)[0]  # a call left behind
            except grpc.RpcError as error:
                return error.code()

        for round_, delay in enumerate((0.0, 0.02, 0.05, 0.1)):
            with ThreadPoolExecutor(len(calls)) as pool:
                ended = [pool.submit(outcome, call) for call in calls]
                time.sleep(delay)
                live.stub.ResetCache(gateway_pb2.ResetCacheRequest(
                    all=True, kv_cache=common_pb2.KvCacheConfig(
                        block_size=BLOCK, num_blocks=BLOCKS + 1 + round_ % 2)))
                for own, done in zip(alone, ended, strict=True):
                    assert done.result() in (own, grpc.StatusCode.UNAVAILABLE)
        assert [call.run(live, alone=True)[0] for call in calls] == alone
        assert live.kv_used() == 0
    finally:
        live.close()
