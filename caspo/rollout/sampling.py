"""Counter-based sampling: the noise of a token is a pure function of (sample seed, position, vocab id).

A completion therefore does not depend on which other requests share its batch, and two
backends that compute equal logits produce equal tokens. Sampling is Gumbel-max:
argmax(logits/T + G) with G = -log(-log(U)), U hashed from the counters. Top-k / top-p cut
the logits first; the top-p threshold is found by a sort-free exact search (nucleus_threshold).
"""

from __future__ import annotations

import hashlib

import torch

try:
    from caspo.rollout.gumbel_kernel import SearchSums, fused_gumbel_pick
    from caspo.rollout.mass_above import narrow, screened_narrow
    from caspo.rollout.nucleus_reads import chunk_maxima, collect, exp_and_mass, threshold_logit
    from caspo.rollout.nucleus_resolve import finish_search, start_search
except ImportError:  # CPU builds of torch come without triton; only CUDA needs the kernels
    fused_gumbel_pick = narrow = screened_narrow = chunk_maxima = collect = exp_and_mass = threshold_logit = None
    finish_search = start_search = SearchSums = None

MASK32 = 0xFFFFFFFF


def sample_seed(run_seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one sample from (run seed, outer step, global prompt index, sample index)."""
    key = f"{run_seed}/{step}/{prompt_index}/{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1  # fits int64


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def noise_row_hash(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash [B] (int64) of each row's (seed, position), which the vocabulary id then mixes into."""
    h = _fmix32((seeds & MASK32) ^ _fmix32(((seeds >> 32) & MASK32) ^ 0x9E3779B9))
    return _fmix32(h ^ ((positions * 0x27D4EB2F) & MASK32))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U in (0, 1) of shape [B, V] for int64 `seeds` [B] and `positions` [B]."""
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = _fmix32(noise_row_hash(seeds, positions)[:, None] ^ ((vocab[None, :] * 0x165667B1 + 0x61C88647) & MASK32))
    return ((h >> 8).to(torch.float64) + 0.5) / float(1 << 24)


# Pivots per pass of the nucleus search: 10 passes at top-p 0.9 over 151,936 tokens. A pass costs
# one read of the row and m compare-adds per token; on an H200 m = 7 beat 3 and 15
# (benchmarks/sampler_bench.py times other m).
NUCLEUS_PIVOTS = 7
# A row whose NUCLEUS_TOP likeliest tokens already hold top_p has its threshold among them: read off
# their masses, the row skips the passes (a trained model's nucleus at top-p 0.9 is that small;
# a random-init model's holds ~50,000 tokens and always searches). They are found among the NUCLEUS_TOP
# chunks of NUCLEUS_CHUNK tokens with the largest maxima (largest_values), not by a top-k over the row.
NUCLEUS_TOP = 64
NUCLEUS_CHUNK = 128
# On CUDA, after NUCLEUS_COLLECT_AFTER passes a row whose interval holds at most NUCLEUS_COLLECT_CAPACITY
# entries in each part of its row (`nucleus_reads.SPAN` entries) has them gathered, its threshold read off
# them, and skips the remaining passes: at top-p 0.9 a random-init model's rows hold a few hundred entries after
# 4 of 10 passes.
NUCLEUS_COLLECT_AFTER = 4
NUCLEUS_COLLECT_CAPACITY = 64
# On CUDA the first NUCLEUS_SCREENED_PASSES passes are decided on float32 sums where those surely decide
# (`mass_above.screened_narrow`): their levels lie far apart in mass, so at top-p 0.9 on random-init logits
# about 2% of the rows need the int64 sums in the fourth pass, and none before it (a search 10% faster, H100).
NUCLEUS_SCREENED_PASSES = 4
_ONE_BITS = 127 << 23  # the int32 bit pattern of float32 1.0


def _nucleus_plan(vocab: int, top_p: float, pivots: int) -> tuple[int, int, list[int]]:
    """The static part of the nucleus search: (mass shift S, first bit pattern, pivots of each pass).

    Plain Python on constants (the vocabulary is a static size, top_p a Python float), so that
    the passes are a fixed sequence of kernels, so the search can be captured in a CUDA graph.
    """
    log_vocab = 0
    while (1 << log_vocab) < vocab:
        log_vocab += 1
    shift = 62 - log_vocab  # a row of masses in units of 2^-S sums below 2^62
    exponent = shift  # start at 2^-S, below which a token weighs nothing, or higher: at 2^-E <= (1 - top_p) / 4V,
    if 1.0 - top_p >= 2.0 ** max(-40, 2 - shift):  # where far from 1 the margin beats the rounding of T
        bound = 0.25 * (1.0 - top_p) / vocab
        exponent = 0
        while exponent < shift and 2.0 ** -exponent > bound:
            exponent += 1
    first = (127 - exponent) << 23  # the bit pattern of float32 2^-E
    width, plan = _ONE_BITS - first + 1, []
    while width > 1:
        plan.append(min(pivots, width - 1))
        width = -(-width // (plan[-1] + 1))
    return shift, first, plan


def nucleus_threshold(logits: torch.Tensor, top_p: float, pivots: int = NUCLEUS_PIVOTS,
                      candidates: int | None = None, scale: float = 1.0) -> torch.Tensor:
    """The smallest logit [B, 1] of the top-p nucleus of logits · scale (float32 products, like a scaled copy's),
    found without sorting (for 0 < top_p < 1).

    The nucleus is the sorted definition's: the fewest most likely tokens whose mass reaches top_p,
    every token tied with the last one kept. It is found by narrowing an interval of float32 bit
    patterns, `pivots` levels per pass, with exact int64 masses (`narrow_by_torch`; two Triton kernels a pass
    on CUDA): static shapes and no host sync, so a CUDA graph can capture it, and the same result on
    the CPU and CUDA given equal logits. The proof, the cost and how it can differ from a float32
    sort: docs/engine/nucleus.md. `candidates` (default NUCLEUS_TOP, read at the call; 0: every row
    searches) is how many likeliest tokens are tried first.
    """
    candidates = NUCLEUS_TOP if candidates is None else candidates
    if logits.is_cuda:
        threshold, _ = _nucleus_threshold_by_kernels(logits.float().contiguous(), top_p, candidates, scale,
                                                     pivots=pivots)
        return threshold if scale != 1.0 else threshold.to(logits.dtype)  # exact: one of the logits
    shift, first, plan = _nucleus_plan(logits.shape[-1], top_p, pivots)
    x = logits.float() * scale if scale != 1.0 else logits.float()
    e = torch.exp(x - x.amax(-1, keepdim=True))
    weight = (e * 2.0 ** shift).to(torch.int64)
    total = _masses(e, e.new_zeros(e.shape[0], 1), shift, weight)
    target = (total.double() * top_p).ceil().to(torch.int64)  # T
    found, resolved = _threshold_among_top(e, target, shift, candidates)
    lo = torch.where(resolved, found, first)  # a resolved row starts (and stays) at width 1
    hi = torch.where(resolved, found, _ONE_BITS)
    for m in plan:  # invariant W(lo) >= T > W(hi + 1); each pass divides the width by m + 1
        lo, hi = narrow_by_torch(e, lo, hi, target, resolved, shift, m, weight)
    kept = e >= lo.to(torch.int32).view(torch.float32)
    return torch.where(kept, x if scale != 1.0 else logits, float("inf")).amin(-1, keepdim=True)


def _nucleus_threshold_by_kernels(x: torch.Tensor, top_p: float, candidates: int, scale: float = 1.0, *,
                                  pivots: int | None = None, collect_after: int | None = None,
                                  collect_capacity: int = NUCLEUS_COLLECT_CAPACITY,
                                  screened_passes: int | None = None) -> tuple[torch.Tensor, SearchSums]:
    """nucleus_threshold on CUDA, and the sums it read that the pick can reuse (`SearchSums`): the same search,
    its reads of the rows Triton kernels (`nucleus_reads`, `mass_above`), which scale the logits x as they read
    them, and its shortcuts one program per row (`nucleus_resolve`), in passes of `pivots` levels (default
    NUCLEUS_PIVOTS, read at the call). A row whose threshold its likeliest tokens resolve reads its threshold logit
    off them too, unless a token outside their chunks ties with the threshold; the others take one more read. After
    `collect_after` passes (default NUCLEUS_COLLECT_AFTER, read at the call; as many as the plan has or more:
    never) a row whose interval holds few entries is finished from them (`finish_search`). The first
    `screened_passes` passes (default NUCLEUS_SCREENED_PASSES) are screened on float32 sums, which leaves every
    interval as the int64 sums would."""
    if narrow is None:
        raise RuntimeError("the nucleus search on CUDA needs triton (it comes with CUDA builds of torch)")
    collect_after = NUCLEUS_COLLECT_AFTER if collect_after is None else collect_after
    screened_passes = NUCLEUS_SCREENED_PASSES if screened_passes is None else screened_passes
    shift, first, plan = _nucleus_plan(x.shape[-1], top_p, NUCLEUS_PIVOTS if pivots is None else pivots)
    maxima = chunk_maxima(x, NUCLEUS_CHUNK, scale)
    row_max = maxima.amax(-1)
    first_sums = None
    if screened_passes > 0 and plan:  # the first pass screened as the exponentials are written
        e, masses, first_sums = exp_and_mass(x, row_max, shift, scale, first_pass=(first, _ONE_BITS, plan[0]))
    else:
        e, masses = exp_and_mass(x, row_max, shift, scale)
    mass = masses.sum(1)
    target = (mass.double() * top_p).ceil().to(torch.int64)  # T [B]
    lo, hi, skip, known, cut = start_search(x, e, maxima, target, shift, first, _ONE_BITS, candidates, NUCLEUS_CHUNK,
                                            scale)
    for i, m in enumerate(plan):
        if i == collect_after:
            gathered = collect(e, lo, hi, skip, shift, collect_capacity)
            finish_search(x, gathered, target, lo, hi, skip, known, cut, shift, scale)
        if i == 0 and first_sums is not None:
            screened_narrow(e, lo, hi, target, skip, shift, m, sums=first_sums)
        else:
            (screened_narrow if i < screened_passes else narrow)(e, lo, hi, target, skip, shift, m)
    threshold = torch.where(known != 0, cut, threshold_logit(x, e, lo, known, scale))[:, None]
    return threshold, SearchSums(maxima, NUCLEUS_CHUNK, row_max, mass, shift)


def narrow_by_torch(e: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, target: torch.Tensor,
                    resolved: torch.Tensor, shift: int, m: int, weight: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of the search as torch operations: (lo, hi) [B, 1] narrowed to the piece of m + 1 that holds
    the threshold (what `mass_above.narrow` does in place on CUDA)."""
    width = hi - lo + 1
    cuts = lo + width * torch.arange(1, m + 1, device=e.device) // (m + 1)  # [B, m] int64 patterns
    reached = _masses(e, cuts.to(torch.int32).view(torch.float32), shift, weight) >= target
    count = torch.where(resolved, m, reached.sum(-1, keepdim=True))  # W(lo) >= T: a resolved row keeps lo
    return lo + width * count // (m + 1), lo + width * (count + 1) // (m + 1) - 1


def _threshold_among_top(e: torch.Tensor, target: torch.Tensor, shift: int,
                         candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(t's bit pattern [B, 1] int64, resolved [B, 1]) where the `candidates` largest e of a row reach the mass T
    (0 candidates: no row is resolved, every row searches).

    With q the row's largest e in descending order and n the first position whose prefix of integer masses
    reaches T, t = q_n: W(q_n) >= that prefix >= T, and every e above q_n sits before position n, so
    W(v) < T for v > q_n. That is the search's t (docs/engine/nucleus.md, section 2, in integer masses).
    """
    if candidates <= 0:
        return target.new_zeros(target.shape), torch.zeros_like(target, dtype=torch.bool)
    top = largest_values(e, candidates)
    n, found = _first_reaching(top, target, shift)
    found = found.view(torch.int32).to(torch.int64)
    return found, n < top.shape[-1]


def _first_reaching(ordered: torch.Tensor, target: torch.Tensor, shift: int, offset: torch.Tensor | int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, q_n) [B, 1] for descending values q [B, k]: n the first position where offset + w(q_1) + ... + w(q_n)
    reaches `target` [B, 1] (w = floor(q 2^shift), the masses the passes sum, in order); n = k where none does,
    q_n then the last value."""
    prefix = offset + (ordered * 2.0 ** shift).to(torch.int64).cumsum(-1)
    n = (prefix < target).sum(-1, keepdim=True)
    return n, ordered.gather(-1, n.clamp(max=ordered.shape[-1] - 1))


def largest_values(x: torch.Tensor, count: int, chunk: int = NUCLEUS_CHUNK) -> torch.Tensor:
    """The `count` largest values of each row of x [B, V], in descending order: torch.topk's values.

    Taken from the `count` chunks of `chunk` entries with the largest maxima, a fraction of a top-k over
    V on a GPU. Exact, ties included: those chunks' maxima are `count` entries >= M, the smallest of
    them, and every entry outside those chunks is <= M, so the chunks hold every entry above M and at
    least as many equal to it as the row's top `count` has (docs/engine/nucleus.md, 4b).
    """
    rows, vocab = x.shape
    if vocab <= count * chunk:
        return x.topk(min(count, vocab), dim=-1).values
    if vocab % chunk:  # pad with the row's minimum: it never outranks a real entry
        x = torch.cat([x, x.amin(-1, keepdim=True).expand(rows, chunk - vocab % chunk)], -1)
    blocks = x.view(rows, -1, chunk)
    best = blocks.amax(-1).topk(count, dim=-1).indices
    picked = blocks.gather(1, best[..., None].expand(-1, -1, chunk))
    return picked.flatten(1).topk(count, dim=-1).values


def _masses(e: torch.Tensor, levels: torch.Tensor, shift: int, weight: torch.Tensor | None = None) -> torch.Tensor:
    """W [B, m] int64: the sum of floor(e_i 2^shift) over {i : e_i >= levels[:, j]}, exact in any order.

    Torch reductions, one read of e per level: the search's definition and its CPU path (on CUDA one
    Triton kernel reads e once for all m levels, `mass_above`).
    """
    if weight is None:
        weight = (e * 2.0 ** shift).to(torch.int64)  # exact scaling by a power of two, then truncation
    return torch.cat([torch.where(e >= levels[:, j:j + 1], weight, 0).sum(-1, keepdim=True)
                      for j in range(levels.shape[1])], -1)


def cut_threshold(logits: torch.Tensor, top_k: int, top_p: float, scale: float = 1.0) -> torch.Tensor:
    """The smallest scaled logit [B, 1] of logits · scale kept by top-k then top-p (0 / 1.0 disable them;
    -inf keeps everything). Without a top-k cut the nucleus search scales as it reads (no scaled copy)."""
    if not 0 < top_k < logits.shape[-1]:
        if top_p < 1.0:
            return nucleus_threshold(logits, top_p, scale=scale)
        return logits.new_full((logits.shape[0], 1), float("-inf"))
    scaled = logits * scale if scale != 1.0 else logits
    threshold = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
    if top_p < 1.0:
        threshold = nucleus_threshold(scaled.masked_fill(scaled < threshold, float("-inf")), top_p)
    return threshold


def truncate_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus-p set to -inf (0 / 1.0 disable them); ties at a cut are kept."""
    return logits.masked_fill(logits < cut_threshold(logits, top_k, top_p), float("-inf"))


def gumbel_pick(scaled: torch.Tensor, threshold: torch.Tensor, seeds: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """argmax of scaled + Gumbel noise over the logits >= threshold: (tokens, log-probs, untruncated log-probs)."""
    kept = scaled.masked_fill(scaled < threshold, float("-inf"))
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, positions, scaled.shape[-1])))
    tokens = (kept.double() + gumbel).argmax(-1)
    picked = scaled.gather(-1, tokens[:, None])[:, 0]
    return tokens, picked - torch.logsumexp(kept, -1), picked - torch.logsumexp(scaled, -1)


def sample_next(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: float,
                top_k: int = 0, top_p: float = 1.0, fused: bool | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row: (tokens [B], log-probs [B], untruncated log-probs [B]).

    log-probs are under the distribution sampled from, softmax(truncate(logits / T));
    untruncated log-probs under softmax(logits / T) over the whole vocabulary. (logits / T is
    computed as logits · `inverse_temperature(T)`.)
    temperature == 0 is greedy, with the log-probs of the temperature-1 distribution.
    fused: scale, hash the noise and pick in one read of the logits, `fused_gumbel_pick` (default: on
    CUDA). Same tokens either way; log-probs agree to float32 rounding. On CUDA the nucleus
    passes are Triton kernels too, with no host sync, so the whole sampler can be captured in a
    CUDA graph.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        logprobs = logits.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(logits, -1)
        return tokens, logprobs, logprobs
    inverse = inverse_temperature(temperature)
    if not (logits.is_cuda if fused is None else fused):
        scaled = logits * inverse
        return gumbel_pick(scaled, cut_threshold(scaled, top_k, top_p), seeds, positions)
    if fused_gumbel_pick is None:
        raise RuntimeError("the fused sampler needs triton (it comes with CUDA builds of torch); pass fused=False")
    threshold = search = None
    if top_k == 0 and top_p < 1.0 and logits.is_cuda:  # the pick reuses the search's sums (SearchSums)
        threshold, search = _nucleus_threshold_by_kernels(logits.contiguous(), top_p, NUCLEUS_TOP, inverse)
    elif top_k > 0 or top_p < 1.0:
        threshold = cut_threshold(logits, top_k, top_p, scale=inverse)
    return fused_gumbel_pick(logits.contiguous(), inverse, threshold, seeds, positions, search=search)


def inverse_temperature(temperature: float) -> float:
    """1 / T rounded to float32: the sampler scales logits by multiplying with it.

    One product, rounded once, is the same number on every device and in the fused kernel.
    (torch's `logits / T` divides on the CPU but multiplies by a reciprocal on CUDA.)
    """
    return torch.tensor(temperature, dtype=torch.float32).reciprocal().item()
