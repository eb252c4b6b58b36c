"""Token sampling for a batch whose rows each carry their own parameters.

Everything is vectorised over the batch: penalties, temperature, top-k / top-p / min-p truncation
and the draw itself. On a GPU the draw uses the exponential race (argmax of p / E with E ~
Exp(1)), which samples the categorical distribution exactly and lets a seeded row take its noise
from a generator of its own key while unseeded rows share one call, so there is no host
synchronisation per row. The only device-to-host copy is that of the chosen ids (and logprobs
when asked), and `sample_on_device` leaves it to the caller, who may queue the next step's work
first.

On CPU those torch ops cost 1 to 6 ms a row (a sort of the whole vocabulary and a random number
per token: as much as a decode step of the default model), so rows are drawn by the compiled
`ops.sample_rows` instead: the same truncations, then the inverse of the survivors' cumulative
distribution at one uniform number a row, in tens to about a hundred microseconds a row; and the
penalties are one compiled pass (`ops.penalize_rows`).

A seeded row's randomness is a function of its sequence's seed and the position of the token it
draws (`draw_key`), not a generator's state carried from step to step: the same seed, prompt and
parameters give the same tokens however the sequence got to each position (batched with others,
preempted and recomputed, evicted and rebuilt, verifying drafts or not).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import torch

from shardlm_server.worker import ops
from shardlm_server.worker.grammar import StepMasks, apply_masks
from shardlm_server.worker.transfer import to_device, to_host_async

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplerSettings:
    """How one sequence's tokens are drawn: the wire's shardlm.common.v1.SamplingParams as the
    sampler applies them (converted by worker/convert.py)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # Hugging Face semantics, over prompt and generated tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def uses_output_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class TokenHistory:
    """Per-sequence state the penalties need, kept on the device and updated without syncs."""

    seen: torch.Tensor  # bool [V]: token appeared in the prompt or the output
    output_counts: torch.Tensor  # int32 [V]: times the token was generated

    @classmethod
    def from_prompt(cls, prompt: list[int], vocab_size: int, device: torch.device) -> TokenHistory:
        """A fresh history: `prompt` counts for the repetition penalty, nothing is output yet."""
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if prompt:
            seen[to_device(prompt, torch.long, device)] = True
        return cls(seen, torch.zeros(vocab_size, dtype=torch.int32, device=device))

    @classmethod
    def from_tokens(cls, tokens: list[int], output_start: int, vocab_size: int,
                    device: torch.device) -> TokenHistory:
        """The history of a sequence whose tokens from `output_start` on were generated (0:
        none was): every token counts for the repetition penalty, those for the output ones."""
        history = cls.from_prompt(tokens, vocab_size, device)
        if 0 < output_start < len(tokens):
            ids = to_device(tokens[output_start:], torch.long, device)
            history.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return history

    def with_outputs(self, token_ids: list[int]) -> TokenHistory:
        """A copy that has also generated `token_ids` (a draft's history at one of its rows)."""
        copy = TokenHistory(self.seen.clone(), self.output_counts.clone())
        ids = to_device(token_ids, torch.long, self.seen.device)
        copy.seen[ids] = True
        copy.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return copy

    def add_output(self, token_id: torch.Tensor) -> None:
        self.seen[token_id] = True
        self.output_counts.index_add_(0, token_id.view(1), torch.ones(1, dtype=torch.int32,
                                                                     device=token_id.device))


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SamplingRow:
    params: SamplerSettings
    history: TokenHistory | None = None
    position: int = 0  # of the token the row draws in its sequence: a seeded row's key

    @property
    def seeded(self) -> bool:
        return self.params.seed is not None and not self.params.greedy


_MASK64 = (1 << 64) - 1


def draw_key(seed: int, position: int) -> int:
    """The 64-bit key of a seeded draw: splitmix64's output number position + 1 from `seed`."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """A seeded row's uniform number in [0, 1): the key's top 53 bits."""
    return (draw_key(seed, position) >> 11) * 2.0**-53


_KEYED = threading.local()  # each thread's generators, by device


def keyed_generator(device: torch.device, seed: int, position: int) -> torch.Generator:
    """A generator on `device` seeded with the draw's key. One per device and thread, reseeded
    for each row: a kernel takes its generator's seed and offset when it is queued, so reseeding
    for the next row cannot change a draw already queued."""
    generators = _KEYED.__dict__.setdefault("by_device", {})
    generator = generators.get(device)
    if generator is None:
        generator = generators[device] = torch.Generator(device=device)
    return generator.manual_seed(draw_key(seed, position))


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device).unsqueeze(1)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The rows' penalties on a copy of `logits` (the caller keeps the raw ones for logprobs):
    one compiled pass on CPU, torch ops on a GPU."""
    if not any((r.params.uses_repetition_penalty or r.params.uses_output_penalties)
               and r.history is not None for r in rows):
        return logits
    penalize = penalize_on_cpu if logits.device.type == "cpu" else penalize_with_torch_ops
    return penalize(logits, rows)


def penalize_on_cpu(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """`apply_penalties` by ops.penalize_rows, on a copy."""
    empty = torch.empty(0)
    return ops.penalize_rows(
        logits.float().clone(),
        [r.history.seen if r.history is not None else empty for r in rows],
        [r.history.output_counts if r.history is not None else empty for r in rows],
        torch.tensor([r.params.repetition_penalty for r in rows], dtype=torch.float32),
        torch.tensor([r.params.frequency_penalty for r in rows], dtype=torch.float32),
        torch.tensor([r.params.presence_penalty for r in rows], dtype=torch.float32))


def penalize_with_torch_ops(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """`apply_penalties` by torch ops over the rows' histories stacked into [B, V] tensors (on
    CPU 9-18 ms at 32 rows of the default model's vocabulary, a seventh to a quarter of a decode
    step)."""
    device = logits.device
    if any(r.params.uses_repetition_penalty and r.history for r in rows):
        seen = torch.stack([
            r.history.seen if r.history is not None and r.params.uses_repetition_penalty
            else torch.zeros(logits.shape[1], dtype=torch.bool, device=device)
            for r in rows
        ])
        penalty = _column([r.params.repetition_penalty for r in rows], device)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if any(r.params.uses_output_penalties and r.history for r in rows):
        counts = torch.stack([
            r.history.output_counts if r.history is not None
            else torch.zeros(logits.shape[1], dtype=torch.int32, device=device)
            for r in rows
        ]).float()
        frequency = _column([r.params.frequency_penalty for r in rows], device)
        presence = _column([r.params.presence_penalty for r in rows], device)
        logits = logits - frequency * counts - presence * (counts > 0).float()
    return logits


def truncate(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p, then min-p exclude. The top token always survives."""
    params = [r.params for r in rows]
    if not any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        return logits
    device = logits.device
    vocab = logits.shape[1]
    ordered, order = logits.sort(dim=1, descending=True)
    rank = torch.arange(vocab, device=device).unsqueeze(0)
    top_k = to_device([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64, device)
    ordered = ordered.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    probs = ordered.softmax(dim=1)
    top_p = _column([p.top_p for p in params], device)
    # top_p = 1 keeps every token: the float32 running sum can pass 1 before the tail's tokens.
    excluded = ((probs.cumsum(dim=1) - probs) > top_p) & (top_p < 1.0)
    min_p = _column([p.min_p for p in params], device)
    excluded |= probs < min_p * probs[:, :1]
    excluded[:, 0] = False
    ordered = ordered.masked_fill(excluded, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow],
                     masks: StepMasks | None = None) -> DeviceSample:
    """Choose one token per row of `logits` ([B, V] float32) without waiting on the device.
    `masks` (constrained decoding) leave their rows only the tokens their grammars allow, after
    the penalties; the truncations and the draw then see only those.

    The rows' penalty histories are read, not updated: call `record_outputs` with the chosen ids
    before the next sampling call of the same sequences.
    """
    raw = logits
    logits = apply_penalties(logits, rows)
    if masks is not None:
        logits = apply_masks(logits, masks)
    draw = sample_on_cpu if logits.device.type == "cpu" else sample_with_torch_ops
    return _with_logprobs(raw, draw(logits, rows), rows)


def sample_with_torch_ops(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The device path's choice (int64 [B]): argmax for greedy rows, else the exponential race
    over the truncated distribution, with no host synchronisation."""
    device = logits.device
    chosen = logits.argmax(dim=1)
    if all(r.params.greedy for r in rows):
        return chosen
    greedy = to_device([r.params.greedy for r in rows], torch.bool, device)
    temperature = _column([r.params.temperature or 1.0 for r in rows], device)
    probs = truncate(logits / temperature, rows).softmax(dim=1)
    noise = torch.empty_like(probs).exponential_()
    for i, row in enumerate(rows):
        if row.seeded:
            noise[i].exponential_(generator=keyed_generator(device, row.params.seed, row.position))
    drawn = (probs / noise).argmax(dim=1)
    return torch.where(greedy, chosen, drawn)


def sample_on_cpu(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The CPU path's choice (int64 [B]): ops.sample_rows with one uniform number per sampled
    row, a seeded row's from its key."""
    logits = logits.float().contiguous()
    if all(r.params.greedy for r in rows):
        # The kernel's greedy rows are torch's argmax (the first largest logit) at a quarter of
        # its time (12 against 43 µs a 49,152-token row, 0.2 against 0.65 ms at 32 rows).
        return ops.sample_rows(logits, *_greedy_parameters(len(rows)))
    uniform = torch.zeros(len(rows), dtype=torch.float64)
    shared = [i for i, r in enumerate(rows) if not r.params.greedy and r.params.seed is None]
    if shared:
        uniform[shared] = torch.rand(len(shared), dtype=torch.float64)
    for i, row in enumerate(rows):
        if row.seeded:
            uniform[i] = seeded_uniform(row.params.seed, row.position)
    params = [r.params for r in rows]
    return ops.sample_rows(
        logits,
        torch.tensor([p.temperature for p in params], dtype=torch.float32),
        torch.tensor([p.top_k for p in params], dtype=torch.int64),
        torch.tensor([p.top_p for p in params], dtype=torch.float32),
        torch.tensor([p.min_p for p in params], dtype=torch.float32),
        uniform)


@functools.lru_cache(maxsize=64)
def _greedy_parameters(rows: int) -> tuple[torch.Tensor, ...]:
    """ops.sample_rows' parameters after the logits for `rows` greedy rows (temperature 0, the
    truncations off, no uniform numbers), made once per batch size: the kernel only reads them."""
    return (torch.zeros(rows), torch.zeros(rows, dtype=torch.int64), torch.ones(rows),
            torch.zeros(rows), torch.zeros(rows, dtype=torch.float64))


def record_outputs(ids: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Add each row's chosen id (a device tensor, [B]) to its penalty history."""
    for i, row in enumerate(rows):
        if row.history is not None:
            row.history.add_output(ids[i])


@dataclass
class DeviceSample:
    """The result of one sampling call, on the device until `to_host` copies it (asynchronously on a
    GPU: synchronise the stream, or an event recorded after `to_host`, before `tokens`)."""

    ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None = None  # float32 [B]
    top_ids: torch.Tensor | None = None  # int64 [B, k]
    top_logprobs: torch.Tensor | None = None  # float32 [B, k]

    def to_host(self) -> DeviceSample:
        return DeviceSample(*(None if t is None else to_host_async(t) for t in
                              (self.ids, self.logprobs, self.top_ids, self.top_logprobs)))

    def tokens(self, rows: list[SamplingRow]) -> list[SampledToken]:
        ids = self.ids.tolist()
        if self.logprobs is None:
            return [SampledToken(t) for t in ids]
        lps = self.logprobs.tolist()
        tops = (
            [list(zip(i, v, strict=True)) for i, v in
             zip(self.top_ids.tolist(), self.top_logprobs.tolist(), strict=True)]
            if self.top_ids is not None and self.top_logprobs is not None
            else [[] for _ in rows]
        )
        out = []
        for row, tok, lp, pairs in zip(rows, ids, lps, tops, strict=True):
            if not row.params.logprobs:
                out.append(SampledToken(tok))
            else:
                out.append(SampledToken(tok, lp, pairs[: row.params.top_logprobs]))
        return out


def _with_logprobs(raw: torch.Tensor, chosen: torch.Tensor, rows: list[SamplingRow]) -> DeviceSample:
    """Log-probabilities under the model's own distribution (before penalties and temperature),
    so they do not depend on how a client chose to sample."""
    want = max((r.params.top_logprobs for r in rows if r.params.logprobs), default=-1)
    if want < 0:
        return DeviceSample(chosen)
    logprobs = raw.log_softmax(dim=1)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    if not want:
        return DeviceSample(chosen, chosen_lp)
    top_lp, top_ids = logprobs.topk(min(want, MAX_TOP_LOGPROBS), dim=1)
    return DeviceSample(chosen, chosen_lp, top_ids, top_lp)
