"""The stream writer reads a sequence's events into chunks and never changes the sequence: a
stop sequence in the text ends the stream after the tokens that precede it, and the handler's
scheduler (not the writer) then ends the call there."""

from __future__ import annotations

import asyncio
import json
import string

import pytest
from shardlm.common.v1 import common_pb2
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

from shardlm_server.gateway.batching.finish import CallLimits
from shardlm_server.gateway.batching.sequence import SequenceState, TokenEvent
from shardlm_server.gateway.batching.streaming import TokenStream
from shardlm_server.gateway.metrics import Metrics
from shardlm_server.gateway.text.tokenizer import Tokenizer

STOP = common_pb2.FINISH_REASON_STOP_SEQUENCE


@pytest.fixture(scope="module")
def characters(tmp_path_factory) -> Tokenizer:
    """One token per character, decoded by joining them."""
    folder = tmp_path_factory.mktemp("characters")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for char in string.ascii_lowercase + " .":
        vocab[char] = len(vocab)
    backend = BackendTokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.decoder = decoders.Fuse()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return Tokenizer.from_pretrained(folder)


def test_a_stop_sequence_ends_the_stream_and_leaves_the_sequence_as_it_was(characters):
    async def main():
        prompt = characters.encode("say", add_special_tokens=False)
        reply = characters.encode(" hi. stop here", add_special_tokens=False)
        seq = SequenceState(1, prompt + reply, common_pb2.SamplingParams())
        seq.start_call(CallLimits(50, 100), prefill_only=False)
        seq.generated = len(reply)  # as the scheduler left it: every reply token generated
        for token in reply:
            seq.events.put_nowait(TokenEvent(token))
        stream = TokenStream(characters, seq, stop_sequences=["."], usage=common_pb2.Usage(),
                             metrics=Metrics(), started_at=0.0)
        chunks = [chunk async for chunk in stream.chunks()]
        return seq, stream, chunks, prompt + reply

    seq, stream, chunks, history = asyncio.run(main())
    assert stream.text == " hi" and chunks[-1].finish_reason == STOP
    assert stream.count == 4  # " hi." : the count of tokens the client was sent
    assert seq.tokens == history and not seq.cancelled and seq.keep_generated is None


def _stream(characters, seq) -> TokenStream:
    return TokenStream(characters, seq, stop_sequences=[], usage=common_pb2.Usage(),
                       metrics=Metrics(), started_at=0.0)


def test_tokens_waiting_together_go_out_in_one_chunk_and_later_ones_in_their_own(characters):
    async def main():
        reply = characters.encode("abcde", add_special_tokens=False)
        seq = SequenceState(1, characters.encode("x", add_special_tokens=False),
                            common_pb2.SamplingParams())
        seq.start_call(CallLimits(50, 100), prefill_only=False)
        stream = _stream(characters, seq)
        for token in reply[:3]:  # a step that verified drafts: three tokens at once
            seq.events.put_nowait(TokenEvent(token))
        chunks = stream.chunks()
        first = await anext(chunks)
        seq.events.put_nowait(TokenEvent(reply[3]))
        second = await anext(chunks)
        seq.events.put_nowait(TokenEvent(reply[4], finish_reason=common_pb2.FINISH_REASON_LENGTH))
        seq.events.put_nowait(TokenEvent(reply[0]))  # after the end: never read
        last = await anext(chunks)
        return reply, first, second, last, [c async for c in chunks]

    reply, first, second, last, rest = asyncio.run(main())
    assert (first.token_ids, first.text) == (reply[:3], "abc")
    assert (second.token_ids, second.text) == (reply[3:4], "d")
    assert (last.token_ids, last.text) == (reply[4:], "e")
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.generated_tokens == 5 and rest == []


def test_tokens_before_an_error_are_sent_before_it_is_raised(characters):
    from shardlm.errors import UnavailableError

    from shardlm_server.gateway.batching.sequence import ErrorEvent

    async def main():
        reply = characters.encode("ab", add_special_tokens=False)
        seq = SequenceState(1, characters.encode("x", add_special_tokens=False),
                            common_pb2.SamplingParams())
        seq.start_call(CallLimits(50, 100), prefill_only=False)
        for token in reply:
            seq.events.put_nowait(TokenEvent(token))
        seq.events.put_nowait(ErrorEvent(UnavailableError("worker lost", reason="WORKER_LOST")))
        got = []
        with pytest.raises(UnavailableError):
            async for chunk in _stream(characters, seq).chunks():
                got.append(chunk)
        return reply, got

    reply, got = asyncio.run(main())
    assert [c.token_ids for c in got] == [reply]
