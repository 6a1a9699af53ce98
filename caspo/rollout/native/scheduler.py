"""The engine's bookkeeping: which request runs in which slot, what its prefill computes, when it leaves.

Pure Python over token ids, no tensors: the model runner (`model_runner.py`) turns its
decisions into device work. One `Scheduler` lives for one `generate` call:

    admit         waiting requests take free slots, strictly in request order, lowest slot first, once
                  `admit_batch` slots are free (or every waiting request fits, or nothing runs): one prefill
                  round then serves many finished sequences instead of one or two per decode step;
    plan_prefill  the admitted prompts' prefill: which K/V each copies from a resident slot (prefix
                  sharing), in waves, and the forwards of at most max_prefill_tokens padded positions
                  that compute the rest, longest pieces together; a chain of prompts admitted together
                  computes in one wave when recomputing its links costs at most `recompute_budget`
                  positions;
    decoding      the sequences decoded ahead: all but those at their last token;
    postprocess   append each sampled token, retire finished sequences and free their slots.

Every decision depends on the requests and the settings alone, never on timing, so the
schedule (and with it every completion) is reproducible.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from caspo.rollout.base import Request, SamplingParams
from caspo.rollout.native.prefix import PrefixIndex, SharedPrefix
from caspo.rollout.stop_strings import StopStrings, stop_context


@dataclass
class SequenceState:
    """One admitted request: its slot, how many positions of the slot hold its K/V, what it has sampled."""

    index: int  # position in the request list
    request: Request
    slot: int
    length: int = 0  # positions of the slot holding this sequence's K/V
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logprobs_full: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: str = ""
    # The sequence that computed this one's prompt K/V: itself, or the one it copied the whole prompt from
    # (directly or through another copy). Slots of one prompt group hold byte-identical prompt K/V.
    prompt_group: int = -1
    prompt: list[int] = field(init=False)

    def __post_init__(self):
        self.prompt = list(self.request.prompt_ids)


@dataclass
class PromptPiece:
    """Prompt positions [start, start + count) of `seq`, computed by one prefill forward."""

    seq: SequenceState
    start: int
    count: int


@dataclass
class PrefillWave:
    """Prompts whose shared prefixes are ready: copy those first, then run the forwards in order."""

    shares: list[tuple[SequenceState, SharedPrefix]] = field(default_factory=list)
    forwards: list[list[PromptPiece]] = field(default_factory=list)

    @property
    def shared_tokens(self) -> int:
        return sum(shared.length for _, shared in self.shares)

    @property
    def computed_tokens(self) -> int:
        return sum(piece.count for pieces in self.forwards for piece in pieces)


class Scheduler:
    def __init__(self, requests: list[Request], *, slots: int, prefix_sharing: bool, max_prefill_tokens: int,
                 sampling: SamplingParams, stop_strings: StopStrings | None = None, admit_batch: int = 1,
                 recompute_budget: int = 0):
        self.waiting = deque(enumerate(requests))
        self.admit_batch = admit_batch
        self.recompute_budget = recompute_budget
        self.free = list(range(slots))  # a heap: the lowest slots first keeps decode rows packed
        # Fresh per call: K/V left by an earlier call may predate a publication.
        self.prefixes = PrefixIndex() if prefix_sharing else None
        self.max_prefill_tokens = max_prefill_tokens
        self.stop_ids = set(sampling.stop_token_ids)
        if bool(sampling.stop_strings) != (stop_strings is not None):
            raise ValueError("pass the StopStrings of sampling.stop_strings, and only those")
        self.stop_strings = stop_strings
        self.running: list[SequenceState] = []  # in the order of the rows of the next logits

    @property
    def done(self) -> bool:
        return not (self.waiting or self.running)

    def admit(self) -> list[SequenceState]:
        """Give free slots to waiting requests in request order; the admitted join `running` at its end.

        Nothing is admitted while fewer than `admit_batch` slots are free, unless every waiting request
        fits or nothing is running.
        """
        admitted = []
        if self.running and len(self.free) < min(self.admit_batch, len(self.waiting)):
            return admitted
        while self.waiting and self.free:
            index, request = self.waiting.popleft()
            admitted.append(SequenceState(index, request, heapq.heappop(self.free)))
        self.running += admitted
        return admitted

    # ------------------------------------------------------------ prefill
    def plan_prefill(self, seqs: list[SequenceState]) -> list[PrefillWave]:
        """The prefill of the admitted `seqs`, after which each slot holds its whole prompt.

        A prompt that shares a prefix with a resident or earlier-admitted prompt copies it. A
        copy from a prompt admitted in the same round must wait for that prompt's own prefill,
        so the prompts are processed in waves, wave w + 1 copying from wave w.
        """
        waves: list[list[tuple[SequenceState, SharedPrefix | None]]] = []
        wave_of: dict[int, int] = {}  # slot -> wave, for the slots admitted now
        holder = {s.slot: s for s in self.running}  # the admitted are running too
        for seq, shared in zip(seqs, self._shares(seqs)):
            seq.prompt_group = holder[shared.slot].prompt_group if shared is not None and shared.exact else seq.index
            wave = wave_of[shared.slot] + 1 if shared is not None and shared.slot in wave_of else 0
            wave_of[seq.slot] = wave
            while len(waves) <= wave:
                waves.append([])
            waves[wave].append((seq, shared))
        plan = []
        for members in waves:
            # A prompt computes from the end of its shared prefix; an exact share (the whole prompt)
            # copies the last prompt position's hidden state too and computes nothing.
            compute = [(seq, shared.length if shared is not None else 0) for seq, shared in members
                       if shared is None or not shared.exact]
            # Longest first, so that a forward's pieces are of similar width: each is padded to the widest.
            compute.sort(key=lambda item: len(item[0].prompt) - item[1], reverse=True)
            plan.append(PrefillWave(shares=[(seq, shared) for seq, shared in members if shared is not None],
                                    forwards=self._forwards(compute)))
        for seq in seqs:
            seq.length = len(seq.prompt)  # what each slot holds once the plan has run
        return plan

    def _shares(self, seqs: list[SequenceState]) -> list[SharedPrefix | None]:
        """What each admitted prompt copies; each is offered to the prompts after it.

        A chain of prompts admitted together, each extending the last (continuations from successive
        step boundaries of one response), would copy link by link: one wave of forwards per link, each
        launched layer by layer. When the positions it costs, summed over the round, stay within
        `recompute_budget`, each such prompt copies from a resident slot instead and computes the rest
        itself, so that the round's prompts compute in one wave. Exact shares (whole prompts) still copy.
        """
        if self.prefixes is None:
            return [None] * len(seqs)
        admitted: set[int] = set()
        linked, resident = [], []
        for seq in seqs:
            shared = self.prefixes.lookup(seq.prompt)
            own = shared
            if shared is not None and not shared.exact and shared.slot in admitted:
                own = self.prefixes.lookup(seq.prompt, skip=admitted)
            linked.append(shared)
            resident.append(own)
            admitted.add(seq.slot)
            self.prefixes.add(seq.slot, seq.prompt)
        recomputed = sum(link.length - (own.length if own else 0) for link, own in zip(linked, resident)
                         if own is not link)
        return resident if recomputed <= self.recompute_budget else linked

    def _forwards(self, pending: list[tuple[SequenceState, int]]) -> list[list[PromptPiece]]:
        """Each prompt from its start position on, in forwards of at most max_prefill_tokens padded positions."""
        budget = self.max_prefill_tokens
        forwards = []
        while pending:
            pieces, width = [], 0
            for seq, start in pending:
                n = min(len(seq.prompt) - start, budget)
                if pieces and (len(pieces) + 1) * max(width, n) > budget:
                    break
                pieces.append(PromptPiece(seq, start, n))
                width = max(width, n)
            forwards.append(pieces)
            reached = {piece.seq.slot: piece.start + piece.count for piece in pieces}
            pending = [(seq, reached.get(seq.slot, start)) for seq, start in pending]
            pending = [(seq, start) for seq, start in pending if start < len(seq.prompt)]
        return forwards

    # ------------------------------------------------------------ decode
    def decoding(self) -> list[tuple[int, int, int]]:
        """(row, slot, position) of each running sequence decoded ahead; their K/V grow by that position.

        A sequence at its last token is left out: whatever it samples, it finishes.
        """
        ahead = []
        for row, seq in enumerate(self.running):
            if len(seq.tokens) + 1 < seq.request.max_new_tokens:
                ahead.append((row, seq.slot, seq.length))
                seq.length += 1
        return ahead

    def postprocess(self, picked: list[tuple[int, float, float, list[tuple[int, float]] | None]]
                    ) -> list[SequenceState]:
        """Append each running sequence's sampled token; returns the finished ones, whose slots are freed."""
        running, finished = [], []
        for seq, (token, logprob, full, top) in zip(self.running, picked):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            seq.logprobs_full.append(full)
            seq.top.append(top)
            seq.finish_reason = self._finish_reason(seq)
            if seq.finish_reason:
                finished.append(seq)
                heapq.heappush(self.free, seq.slot)
                if self.prefixes is not None:
                    self.prefixes.remove(seq.slot)
            else:
                running.append(seq)
        self.running = running
        return finished

    def _finish_reason(self, seq: SequenceState) -> str:
        if seq.tokens[-1] in self.stop_ids:
            return "stop"
        if self.stop_strings is not None and self.stop_strings.ended(seq.tokens, stop_context(seq.request)):
            return "stop"
        return "length" if len(seq.tokens) >= seq.request.max_new_tokens else ""
