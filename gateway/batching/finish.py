"""When a generation call ends, and why: the gateway's one finish policy.

A call's limits are fixed when it starts (`call_limits`). The workers stop a sequence only on
what they are sent (`CallLimits.worker_stop`): its complete stop-id set (the caller's ids plus,
unless ignore_eos, the model's EOS ids as the workers reported them in ModelInfo) and its
remaining token budget; they keep no EOS list of their own. Every reason a client sees for a
generated token is decided here (`CallLimits.finish_reason`); only a stop sequence, which needs
the detokenized text, is matched later, by the stream writer.

Length limits: a call generates at most max_new_tokens (the caller's, else the server default)
and the history never grows past the context. Reaching max_new_tokens is FINISH_REASON_LENGTH;
reaching the context first is FINISH_REASON_CONTEXT_LENGTH. A Generate whose prompt plus an
explicit max_new_tokens cannot fit is refused up front (PROMPT_TOO_LONG); a session's Decode runs
on until the context is full.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.common.v1 import common_pb2
from shardlm.errors import FieldViolation, InvalidArgumentError, ResourceExhaustedError

from shardlm_server.gateway.kv.manager import KvManager

UNFINISHED = common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass(frozen=True)
class CallLimits:
    """The stop conditions of one generation call."""

    max_new_tokens: int  # what the caller asked for, or the server's default
    max_context: int  # the sequence's history may grow to this many tokens
    stop_token_ids: frozenset[int] = frozenset()  # the caller's
    eos_ids: frozenset[int] = frozenset()  # the model's; empty with ignore_eos

    def budget(self, history: int, generated: int) -> int:
        """Tokens the call may still generate, with `history` tokens in the sequence and
        `generated` of them produced by this call."""
        return max(0, min(self.max_new_tokens - generated, self.max_context - history))

    def worker_stop(self, history: int, generated: int) -> common_pb2.StopConditions:
        """What the workers apply from this step on: the whole stop-id set and the budget."""
        return common_pb2.StopConditions(
            max_new_tokens=max(self.budget(history, generated), 1),
            stop_token_ids=sorted(self.eos_ids | self.stop_token_ids))

    def finish_reason(self, token_id: int, history: int, generated: int, *,
                      grammar_complete: bool = False) -> int:
        """Why the call ends with `token_id` (history and generated counting it), or
        FINISH_REASON_UNSPECIFIED if it goes on. The first condition listed wins: a grammar
        completed by the last token of the budget reports the grammar, since the text is whole
        (an OpenAI client reads "length" as cut off)."""
        if token_id in self.eos_ids:
            return common_pb2.FINISH_REASON_EOS
        if token_id in self.stop_token_ids:
            return common_pb2.FINISH_REASON_STOP_TOKEN
        if grammar_complete:
            return common_pb2.FINISH_REASON_GRAMMAR_COMPLETE
        if generated >= self.max_new_tokens:
            return common_pb2.FINISH_REASON_LENGTH
        if history >= self.max_context:
            return common_pb2.FINISH_REASON_CONTEXT_LENGTH
        return UNFINISHED


def prefill_limits(max_context: int) -> CallLimits:
    """A Prefill call: one token, then the session parks."""
    return CallLimits(max_new_tokens=1, max_context=max_context)


def max_new_tokens_limit(configured: int, max_context: int) -> int:
    """The largest max_new_tokens a request may ask for: the server's cap, and never more than
    the context could ever hold after a one-token prompt."""
    return max(1, min(configured, max_context - 1))


def prompt_too_long(prompt: int, max_new: int, context: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"prompt of {prompt} tokens plus max_new_tokens {max_new} exceeds the context of "
        f"{context} tokens", reason="PROMPT_TOO_LONG",
        field_violations=[FieldViolation("prompt", f"{prompt} + {max_new} > {context}")],
        metadata={"prompt_tokens": prompt, "max_new_tokens": max_new,
                  "max_context_length": context})


def call_limits(stop: common_pb2.StopConditions, *, history: int, max_context: int,
                default_max_new_tokens: int, eos_ids: frozenset[int],
                kv: KvManager, strict: bool) -> CallLimits:
    """The limits of a Decode or Generate over `history` tokens. `strict` (Generate) refuses a
    prompt after which not even one token fits, or an explicit max_new_tokens that cannot fit
    after it; otherwise (a session's Decode) the call runs until the context is full, which may
    be at once (a budget of 0). Raises if the KV cache could never hold the call."""
    max_new = stop.max_new_tokens or default_max_new_tokens
    at_least = max_new if stop.max_new_tokens else 1
    if strict and history + at_least > max_context:
        raise prompt_too_long(history, at_least, max_context)
    limits = CallLimits(max_new_tokens=max_new, max_context=max_context,
                        stop_token_ids=frozenset(stop.stop_token_ids),
                        eos_ids=frozenset() if stop.ignore_eos else eos_ids)
    needed = kv.blocks_for(history + limits.budget(history, 0))
    if needed > kv.num_blocks:
        raise ResourceExhaustedError(
            "the KV cache is too small for this request; lower max_new_tokens",
            reason="KV_CACHE_FULL",
            metadata={"required_blocks": needed, "total_blocks": kv.num_blocks})
    return limits
