"""From character steps to token steps.

The policy produced token ids, so step membership is read off those ids: the
response text is their decode, and each token's character offset comes from
decoding them cumulatively (``decode(ids[:i+1])`` prefixes), never from
re-tokenizing the text, which may not reproduce the generated ids.

A token whose cumulative decode does not extend the visible text (an empty
special token, or the first bytes of a multi-byte UTF-8 character, which
decode to U+FFFD until the character is complete) gets the offset where the
next visible text starts. Each token belongs to the step holding its first
character; tokens at or past the end of the text (a trailing EOS) belong to
the last step.

``segment_response`` also folds a step that no token starts in (one token
spans its whole text) into the previous step, so step ids are contiguous and
every step owns at least one token.

``segment_responses`` does a batch of responses with one batch decode. Where the
decode is a concatenation of the tokens' own texts (byte-level BPE, a vocabulary
of characters), the cumulative decode of a prefix of complete tokens (no U+FFFD)
is the concatenation of their texts, so their offsets are running lengths; only a
run of tokens that splits a character is decoded token by token.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Sequence

import torch

from caspo.segment.latex import latex_step_starts
from caspo.segment.newline import newline_step_starts

Decode = Callable[[list[int]], str]
DecodeMany = Callable[[list[list[int]]], list[str]]  # [decode(ids) for ids in batch], exactly
SPLITTERS = {"latex": latex_step_starts, "newline": newline_step_starts}
MAX_PENDING = 32  # tokens without visible text before the fast decode gives up


@dataclass
class TokenSteps:
    step_starts_chars: list[int]  # offsets in ``text`` where steps start
    token_step_ids: list[int]  # step index of every response token
    num_steps: int
    text: str  # decode of the response token ids


def char_offsets_from_tokens(decode: Decode, token_ids: Sequence[int], text: str | None = None) -> list[int]:
    """Offset in ``decode(token_ids)`` where each token's text begins.

    Decodes incrementally over a small window (the tokens since the last clean
    boundary plus the chunk before it as context), which is O(n·k). Each
    window's new text is checked against the full decode; on any disagreement
    (tokenizers that rewrite earlier text, such as clean-up of spaces before
    punctuation) it falls back to the exact O(n²) cumulative decode.
    """
    ids = list(token_ids)
    if not ids:
        return []
    text = decode(ids) if text is None else text
    ends = _incremental_ends(decode, ids, text)
    if ends is None:
        ends = _cumulative_ends(decode, ids, text)
    return [0] + ends[:-1]


def _incremental_ends(decode: Decode, ids: list[int], text: str) -> list[int] | None:
    """End of the visible text after each token, or None if windows do not rebuild ``text``.

    ``anchor`` is the last token boundary where the decode was clean (no
    dangling U+FFFD); tokens after it are decoded with the chunk before it as
    context, so leading-space rules match the full decode. Visible text after
    token i is the anchor's text plus the part of the new text that agrees with
    ``text``, which is what the cumulative decode would show.
    """
    ends, best = [], 0
    context, anchor, anchor_len, context_text = 0, 0, 0, ""
    for i in range(len(ids)):
        window = decode(ids[context : i + 1])
        if not window.startswith(context_text):
            return None
        new, rest = window[len(context_text) :], text[anchor_len:]
        if not rest.startswith(new.rstrip("\ufffd")):
            return None
        best = max(best, anchor_len + _common_prefix_len(new, rest, len(new.rstrip("\ufffd"))))
        ends.append(best)
        if new and not new.endswith("\ufffd"):
            context, anchor, anchor_len = anchor, i + 1, anchor_len + len(new)
            context_text = decode(ids[context:anchor])
        elif i + 1 - anchor > MAX_PENDING:
            return None
    return ends if best == len(text) else None


def _cumulative_ends(decode: Decode, ids: list[int], text: str) -> list[int]:
    """Exact version: the longest prefix of ``text`` that ``decode(ids[:i+1])`` agrees with.

    A dangling partial character (U+FFFD) or text the tokenizer later rewrites
    is not part of that prefix, so it does not count as visible yet.
    """
    ends, best = [], 0
    for i in range(len(ids)):
        best = max(best, _common_prefix_len(decode(ids[: i + 1]), text, best))  # non-decreasing
        ends.append(best)
    return ends


def _common_prefix_len(a: str, b: str, hint: int) -> int:
    """Length of the common prefix of ``a`` and ``b``; cheap when it is about ``hint``."""
    if a[:hint] == b[:hint]:
        n, limit = min(hint, len(a), len(b)), min(len(a), len(b))
        while n < limit and a[n] == b[n]:
            n += 1
        return n
    lo, hi = 0, hint  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


def token_step_ids(token_char_offsets: Sequence[int], step_starts: Sequence[int], num_tokens: int) -> list[int]:
    """Step index of each token: the step holding the token's first character.

    Tokens past ``len(token_char_offsets)`` (an EOS that was not decoded) get
    the last step.
    """
    if num_tokens and not step_starts:
        raise ValueError("tokens but no steps: segment a non-empty text first")
    last = len(step_starts) - 1
    ids = [max(bisect_right(step_starts, off) - 1, 0) for off in token_char_offsets[:num_tokens]]
    return ids + [last] * (num_tokens - len(ids))


def final_box_end(text: str) -> int | None:
    """Offset just after the closing brace of the last ``\\boxed{...}``, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None  # unbalanced: the box never closes


def merge_after_final_box(text: str, step_starts: list[int]) -> list[int]:
    """Drop step starts at or after the end of the final box: that text joins the box's step."""
    end = final_box_end(text)
    return step_starts if end is None else [s for s in step_starts if s < end]


def segment_response(
    decode: Decode,
    token_ids: Sequence[int],
    splitter: str = "latex",
    max_steps: int | None = None,
    after_final_box: str = "keep",
    text: str | None = None,
    offsets: list[int] | None = None,
) -> TokenSteps:
    """Split one response into steps and map every token to its step.

    ``after_final_box="merge"`` folds steps that start after the final
    ``\\boxed{...}`` into the step containing it. ``max_steps`` keeps the first
    ``max_steps - 1`` boundaries and merges all the rest into the last allowed
    step, so the early steps keep their own values and only the tail is coarse.
    Order: split, merge after the box, fold token-less steps, cap. A
    non-empty token list whose text is empty is one step. ``text`` (the
    decode) and ``offsets`` (``char_offsets_from_tokens``) may be given when known.
    """
    if splitter not in SPLITTERS:
        raise ValueError(f"unknown splitter {splitter!r}; choose from {sorted(SPLITTERS)}")
    if after_final_box not in ("keep", "merge"):
        raise ValueError(f"after_final_box must be 'keep' or 'merge', got {after_final_box!r}")
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    ids = list(token_ids)
    if not ids:
        return TokenSteps([], [], 0, "")
    text = decode(ids) if text is None else text
    starts = SPLITTERS[splitter](text) or [0]
    if after_final_box == "merge":
        starts = merge_after_final_box(text, starts)
    offsets = char_offsets_from_tokens(decode, ids, text) if offsets is None else offsets
    owned = sorted(set(token_step_ids(offsets, starts, len(ids))))
    starts = [starts[k] for k in owned][:max_steps]
    return TokenSteps(starts, token_step_ids(offsets, starts, len(ids)), len(starts), text)


def segment_responses(decode: Decode, decode_many: DecodeMany, responses: Sequence[Sequence[int]],
                      concatenative: bool = False, **options) -> list[TokenSteps]:
    """``segment_response`` of every response, the texts decoded in one batch call.

    ``concatenative``: decode(ids) is the concatenation of the tokens' own decodes wherever each of those is
    complete text (true of byte-level BPE and of character vocabularies). Then the offsets of complete tokens
    are running lengths, and only the runs of tokens that split a character decode token by token
    (``_offsets_from_pieces``); without it, every response decodes token by token.
    """
    rows = [list(r) for r in responses]
    texts = decode_many(rows)
    pieces: list[list[str] | None] = [None] * len(rows)
    if concatenative:  # each distinct token decoded once
        vocab = sorted({t for ids in rows for t in ids})
        own_text = dict(zip(vocab, decode_many([[t] for t in vocab])))
        pieces = [[own_text[t] for t in ids] for ids in rows]
    out = []
    for ids, text, own in zip(rows, texts, pieces):
        offsets = None if own is None else _offsets_from_pieces(decode, ids, own, text)
        out.append(segment_response(decode, ids, text=text, offsets=offsets, **options))
    return out


def _offsets_from_pieces(decode: Decode, ids: list[int], pieces: list[str], text: str) -> list[int] | None:
    """char_offsets_from_tokens for a concatenative decode, from the tokens' own texts `pieces`.

    A complete token's offset is the running length. A run of incomplete ones (a character split across
    tokens; U+FFFD alone) is decoded as its own text, token by token: no character crosses its ends, since
    the tokens around it are complete UTF-8. None if the parts do not rebuild `text`.
    """
    if not any("\ufffd" in piece for piece in pieces):  # the common case, at C speed
        return list(accumulate(map(len, pieces[:-1]), initial=0)) if "".join(pieces) == text else None
    offsets, parts, length, i = [], [], 0, 0
    while i < len(ids):
        if "\ufffd" not in pieces[i]:
            offsets.append(length)
            parts.append(pieces[i])
            length += len(pieces[i])
            i += 1
            continue
        end = i
        while end < len(ids) and "\ufffd" in pieces[end]:
            end += 1
        span = decode(ids[i:end])
        offsets += [length + o for o in char_offsets_from_tokens(decode, ids[i:end], span)]
        parts.append(span)
        length += len(span)
        i = end
    return offsets if "".join(parts) == text else None


def pad_step_ids(step_ids: Sequence[Sequence[int]], seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``[B, T]`` LongTensor of token step ids (-1 on padding) and ``[B]`` step counts.

    ``step_ids`` holds one ``TokenSteps.token_step_ids`` list per response;
    ``T`` is ``seq_len`` or the longest response.
    """
    lengths = [len(row) for row in step_ids]
    width = max(lengths, default=0) if seq_len is None else seq_len
    if max(lengths, default=0) > width:
        raise ValueError(f"a response has {max(lengths)} tokens, more than seq_len={width}")
    out = torch.full((len(step_ids), width), -1, dtype=torch.long)
    for b, row in enumerate(step_ids):
        out[b, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
    counts = torch.tensor([max(row, default=-1) + 1 for row in step_ids], dtype=torch.long)
    return out, counts
