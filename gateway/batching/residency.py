"""What a sequence's KV cache becomes outside the steps that compute it: kept or freed when its
call ends, given up by idle sessions when another sequence needs room (least recently used
first), and dropped with a session that expired. The batch loop (gateway/batching/loop.py) and
the handlers' side of the scheduler call these; the blocks themselves are the KV manager's
(gateway/kv/manager.py).
"""

from __future__ import annotations

import logging
import time

from shardlm_server.gateway.batching.sequence import Phase, SequenceState
from shardlm_server.gateway.batching.sessions import SessionStore
from shardlm_server.gateway.kv.manager import KvManager

log = logging.getLogger("shardlm.gateway")
EXPIRY_CHECK_S = 1.0  # idle sessions are looked for at most this often


class CacheResidency:
    def __init__(self, kv: KvManager, sessions: SessionStore) -> None:
        self.kv = kv
        self.sessions = sessions
        self._next_expiry_check = 0.0

    def drop(self, seq: SequenceState) -> None:
        """Every way a sequence loses its cache: the blocks go, the workers forget it, and it is
        rebuilt from its history if used again."""
        self.kv.release(seq.seq_id)
        seq.forget()

    def park_or_free(self, seq: SequenceState) -> None:
        """The call is over: a session's sequence keeps its cache (less what its client was not
        sent), a Generate's is freed."""
        if seq.ephemeral:
            self.drop(seq)
            seq.phase = Phase.DONE
            return
        if seq.keep_generated is not None:
            seq.trim(seq.keep_generated)
        self.kv.trim(seq.seq_id, seq.computed + 1)  # its computed tokens and the pending one
        seq.phase = Phase.IDLE

    def make_room(self, seq: SequenceState, tokens: int) -> None:
        """Idle sessions give up their caches, least recently used first, until `seq` has room
        for `tokens` tokens (or none is left)."""
        if self.kv.has_room(seq.seq_id, tokens):
            return
        idle = {s.seq.seq_id: s for s in self.sessions.eviction_candidates() if s.seq is not seq}
        for seq_id in self.kv.make_room(seq.seq_id, tokens, idle):
            log.info("evicting idle session %s to free KV blocks", idle[seq_id].session_id)
            idle[seq_id].seq.forget()

    def expire_idle_sessions(self) -> None:
        """Remove the sessions idle past their timeout, and their caches. A scan of every
        session: at most once a second, not at every step."""
        now = time.monotonic()
        if now < self._next_expiry_check:
            return
        self._next_expiry_check = now + EXPIRY_CHECK_S
        for session in self.sessions.expired(now):
            self.sessions.remove(session.session_id)
            self.drop(session.seq)
            session.seq.phase = Phase.DONE
