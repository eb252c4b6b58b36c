"""Sessions: conversations whose KV cache stays on the workers between calls.

The session keeps the whole token history (in its SequenceState) and, for chat sessions, the
messages so far, so that a session whose cache was evicted is rebuilt invisibly on its next call.
At most `max_sessions` exist at once (`--max-sessions`); idle sessions expire after
`idle_timeout_s` (`--session-idle-timeout`); under KV pressure the least recently used idle
session gives up its cache first.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

import grpc
from shardlm.errors import FailedPreconditionError, NotFoundError, ResourceExhaustedError

from shardlm_server.gateway.batching.sequence import Phase, SequenceState
from shardlm_server.gateway.config import default
from shardlm_server.gateway.details import clip


@dataclass
class Session:
    session_id: str
    seq: SequenceState
    owner: str = ""  # identity that created it, when auth is on
    messages: list[dict[str, str]] = field(default_factory=list)  # chat turns, with replies
    reply_parts: list[str] = field(default_factory=list)  # the assistant's reply being generated
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)

    def pending_reply(self) -> list[dict[str, str]]:
        """The assistant turn generated since the last chat Prefill, as a message."""
        text = "".join(self.reply_parts)
        return [{"role": "assistant", "content": text}] if text else []

    def chat_history(self) -> list[dict[str, str]]:
        """The conversation so far, the reply being generated included."""
        return self.messages + self.pending_reply()

    def begin_chat_turn(self, messages: list[dict[str, str]]) -> None:
        """A chat Prefill re-rendered the conversation as `messages`; a new reply starts."""
        self.messages = list(messages)
        self.reply_parts.clear()

    def add_reply_text(self, text: str) -> None:
        self.reply_parts.append(text)

    def touch(self) -> None:
        self.last_used = time.monotonic()


def not_found(session_id: str) -> NotFoundError:
    shown = clip(session_id)
    return NotFoundError(f"session '{shown}' does not exist or was released",
                         reason="SESSION_NOT_FOUND", metadata={"session_id": shown},
                         resource=("shardlm.session", shown))


class SessionStore:
    def __init__(self, idle_timeout_s: float = default("session_idle_timeout"),
                 max_sessions: int = default("max_sessions")) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, seq: SequenceState, owner: str = "") -> Session:
        if len(self._sessions) >= self.max_sessions:
            raise ResourceExhaustedError(
                f"too many sessions ({self.max_sessions}); release some with ResetCache",
                reason="QUEUE_FULL", retry_after_s=5.0)
        session = Session(secrets.token_urlsafe(12), seq, owner)
        self._sessions[session.session_id] = session
        return session

    def get(self, session_id: str, owner: str = "") -> Session:
        session = self._sessions.get(session_id)
        if session is None or (session.owner and session.owner != owner):
            raise not_found(session_id)  # someone else's session does not exist for you
        return session

    def acquire(self, session_id: str, owner: str = "") -> Session:
        """The session, marked busy: one Prefill or Decode at a time per session."""
        session = self.get(session_id, owner)
        if session.busy:
            raise FailedPreconditionError(
                f"session '{clip(session_id)}' is busy with another call", reason="SESSION_BUSY",
                metadata={"session_id": clip(session_id)}, code=grpc.StatusCode.FAILED_PRECONDITION)
        session.busy = True
        session.touch()
        return session

    def release_busy(self, session: Session) -> None:
        session.busy = False
        session.touch()

    def find(self, session_id: str, owner: str = "") -> Session | None:
        session = self._sessions.get(session_id)
        return session if session is not None and (not session.owner or session.owner == owner) \
            else None

    def remove(self, session_id: str) -> Session | None:
        return self._sessions.pop(session_id, None)

    def all(self) -> list[Session]:
        return list(self._sessions.values())

    def expired(self, now: float | None = None) -> list[Session]:
        now = time.monotonic() if now is None else now
        return [s for s in self._sessions.values()
                if not s.busy and now - s.last_used > self.idle_timeout_s]

    def eviction_candidates(self) -> list[Session]:
        """Idle sessions, least recently used first (those holding no cache give up none)."""
        idle = [s for s in self._sessions.values()
                if not s.busy and s.seq.phase is Phase.IDLE]
        return sorted(idle, key=lambda s: s.last_used)
