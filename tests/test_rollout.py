
import hashlib

import pytest
import torch
from publication_checks import check_failed_publications_keep_old_weights, perturbed

from caspo.rollout.base import EngineAsleepError, Request, SamplingParams, publish
from caspo.rollout.hf import HFEngine
from caspo.rollout.native import NativeEngine
from caspo.rollout.publication import PublicationError
from caspo.rollout.sampling import _fmix32, sample_next, sample_seed, uniform_noise

SAMPLING = SamplingParams(temperature=1.0, stop_token_ids=[1])


def requests(n, max_new=12):
    return [Request([5 + i % 7, 9, 11 + i % 3][: 1 + i % 3], seed=sample_seed(0, 0, i, 0), max_new_tokens=max_new)
            for i in range(n)]


def test_sample_seed_is_a_function_of_its_counters():
    """The seed is blake2b-8 of "run/step/prompt/sample", little-endian, shifted into int64: a fixed function of
    its counters in every process and version (never the salted hash()), and distinct across counters."""
    for counters in [(1, 2, 3, 4), (0, 0, 0, 0), (42, 7, 10**6, 15), (2**40, 3, 5, 0)]:
        digest = hashlib.blake2b("/".join(map(str, counters)).encode(), digest_size=8).digest()
        assert sample_seed(*counters) == int.from_bytes(digest, "little") >> 1
        assert 0 <= sample_seed(*counters) < 2**63
    seeds = {sample_seed(1, s, p, j) for s in range(3) for p in range(3) for j in range(3)}
    assert len(seeds) == 27


MASK32 = 0xFFFFFFFF


def murmur3_x86_32(data: bytes, seed: int, fmix32) -> int:
    """MurmurHash3_x86_32 (Appleby's reference) with its finalizer `fmix32` given."""
    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & MASK32

    def mix(k):
        return rotl(k * 0xCC9E2D51 & MASK32, 15) * 0x1B873593 & MASK32

    h, blocks = seed, len(data) // 4
    for i in range(blocks):
        h = rotl(h ^ mix(int.from_bytes(data[4 * i:4 * i + 4], "little")), 13)
        h = (h * 5 + 0xE6546B64) & MASK32
    if len(data) % 4:
        h ^= mix(int.from_bytes(data[4 * blocks:], "little"))
    return fmix32(h ^ len(data))


def test_the_noise_finalizer_is_murmurhash3s():
    """_fmix32 is MurmurHash3's finalizer: as the finalizer of the whole hash it gives the reference test vectors
    (an empty input hashes to fmix32(seed) alone), also for 32-bit values whose int64 products overflow."""
    def fmix32(h):
        return int(_fmix32(torch.tensor([h], dtype=torch.int64))[0])

    vectors = [(b"", 0, 0), (b"", 1, 0x514E28B7), (b"", 0xFFFFFFFF, 0x81F16F39), (b"\0\0\0\0", 0, 0x2362F9DE),
               (b"aaaa", 0x9747B28C, 0x5A97808A), (b"abc", 0, 0xB3DD93FA), (b"Hello, world!", 1234, 0xFAF6CDB3),
               (b"The quick brown fox jumps over the lazy dog", 0x9747B28C, 0x2FA826CD)]
    for data, seed, want in vectors:
        assert murmur3_x86_32(data, seed, fmix32) == want, (data, seed)


def reference_noise(seed: int, position: int, token: int) -> float:
    """U of (seed, position, token) in Python's unbounded integers, from uniform_noise's documented mixing: the
    seed's two 32-bit halves, then the position, then the token id, each through MurmurHash3's finalizer; the top
    24 bits of the hash, centred in their interval."""
    def fmix32(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & MASK32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & MASK32
        return h ^ (h >> 16)

    row = fmix32((seed & MASK32) ^ fmix32(((seed >> 32) & MASK32) ^ 0x9E3779B9))
    row = fmix32(row ^ ((position * 0x27D4EB2F) & MASK32))
    h = fmix32(row ^ ((token * 0x165667B1 + 0x61C88647) & MASK32))
    return ((h >> 8) + 0.5) / 2**24


def test_noise_is_the_documented_hash_of_seed_position_and_token():
    """Every token's noise equals the hash computed without int64 tensors, for seeds across both 32-bit halves
    and positions whose products with the mixing constant pass 32 bits."""
    seeds = [0, 11, 2**32 - 1, 2**32, sample_seed(1, 2, 3, 4), 2**63 - 1]
    positions = [0, 3, 7, 1000, 39, 2**20]
    vocab = 50
    u = uniform_noise(torch.tensor(seeds), torch.tensor(positions), vocab)
    assert u.dtype == torch.float64
    want = torch.tensor([[reference_noise(s, p, v) for v in range(vocab)] for s, p in zip(seeds, positions)],
                        dtype=torch.float64)
    assert torch.equal(u, want)


def test_noise_depends_only_on_seed_and_position():
    seeds = torch.tensor([11, 12, 11])
    pos = torch.tensor([0, 0, 3])
    u = uniform_noise(seeds, pos, 50)
    assert ((u > 0) & (u < 1)).all()
    alone = uniform_noise(seeds[2:], pos[2:], 50)
    assert torch.equal(u[2], alone[0])
    assert not torch.equal(u[0], u[2])  # same seed, other position
    assert not torch.equal(u[0], u[1])  # other seed


def test_gumbel_max_samples_the_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).repeat(20000, 1)
    seeds = torch.arange(20000)
    tokens, *_ = sample_next(logits, seeds, torch.zeros(20000, dtype=torch.long), temperature=1.0)
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.015)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    seeds, pos = torch.arange(2000), torch.zeros(2000, dtype=torch.long)
    top2, logp, _ = sample_next(logits, seeds, pos, temperature=1.0, top_k=2)
    assert set(top2.tolist()) == {0, 1}
    # log-probs are of the truncated distribution
    assert torch.allclose(logp[top2 == 0], torch.log_softmax(torch.tensor([3.0, 2.0]), -1)[0])
    nucleus, *_ = sample_next(logits, seeds, pos, temperature=1.0, top_p=0.5)
    assert set(nucleus.tolist()) == {0}  # p(0) = 0.64 covers 0.5


def test_same_seed_same_tokens_whatever_the_batch(tiny_model):
    engine = HFEngine(tiny_model, pad_token_id=0)
    reqs = requests(12)
    full = engine.generate(reqs, SAMPLING)
    for subset in ([3], [7, 2, 11], list(range(12))[::-1]):
        part = engine.generate([reqs[i] for i in subset], SAMPLING)
        for i, completion in zip(subset, part):
            assert completion.tokens == full[i].tokens
            assert completion.logprobs == pytest.approx(full[i].logprobs, abs=1e-5)
    # in micro-batches of 5 too
    chunked = HFEngine(tiny_model, pad_token_id=0, max_batch=5).generate(reqs, SAMPLING)
    assert [c.tokens for c in chunked] == [c.tokens for c in full]


def test_behaviour_logprobs_match_a_full_forward(tiny_model):
    engine = HFEngine(tiny_model, pad_token_id=0)
    req = requests(3)[2]
    completion = engine.generate([req], SAMPLING)[0]
    ids = torch.tensor([req.prompt_ids + completion.tokens])
    with torch.no_grad():
        logits = tiny_model(ids).logits[0, len(req.prompt_ids) - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(req.prompt_ids):, None])[:, 0]
    assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-5)


def test_finish_reasons_and_stop_strings(tiny_model):
    engine = HFEngine(tiny_model, pad_token_id=0, decode=lambda ids: "".join(chr(65 + i % 26) for i in ids))
    out = engine.generate(requests(6, max_new=8), SamplingParams(temperature=1.0, stop_token_ids=[]))
    assert all(c.finish_reason == "length" and len(c.tokens) == 8 for c in out)
    first = out[0]
    stop = chr(65 + first.tokens[2] % 26)  # a string that appears at the third token at the latest
    cut = engine.generate(requests(6, max_new=8)[:1], SamplingParams(temperature=1.0, stop_strings=[stop]))[0]
    assert cut.finish_reason == "stop" and len(cut.tokens) <= 3
    assert cut.tokens == first.tokens[:len(cut.tokens)]


def test_publication_changes_outputs_exactly_as_a_fresh_load(tiny_model):
    engine = HFEngine(tiny_model, pad_token_id=0)
    before = engine.generate(requests(8), SAMPLING)
    updated = perturbed(tiny_model)
    digest = publish(engine, updated, version=1)
    after = engine.generate(requests(8), SAMPLING)
    fresh = HFEngine(updated, pad_token_id=0).generate(requests(8), SAMPLING)
    assert [c.tokens for c in after] == [c.tokens for c in fresh]
    assert [c.tokens for c in after] != [c.tokens for c in before]
    assert all(c.policy_version == 1 for c in after)
    assert digest == HFEngine(updated, pad_token_id=0).digest()


def test_incomplete_or_mismatched_publication_keeps_old_weights(tiny_model):
    check_failed_publications_keep_old_weights(HFEngine(tiny_model, pad_token_id=0), tiny_model, requests(8), SAMPLING)


def engine_of(backend, model):
    return HFEngine(model, pad_token_id=0) if backend == "hf" else NativeEngine(model, max_seq_len=32,
                                                                                capacity_tokens=32 * 8)


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_sleep_and_wake_through_the_protocol(tiny_model, backend):
    """Code written against the protocol sees the same on both backends: asleep refuses, awake resumes exactly."""
    engine = engine_of(backend, tiny_model)
    before = engine.generate(requests(8), SAMPLING)
    assert not engine.asleep
    engine.sleep()
    assert engine.asleep
    with pytest.raises(EngineAsleepError, match=r"asleep.*wake\(\)"):
        engine.generate(requests(2), SAMPLING)
    engine.wake()
    assert not engine.asleep
    assert engine.generate(requests(8), SAMPLING) == before  # tokens, log-probs, finish reasons, versions


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_sleep_can_free_the_weights_until_the_next_publication(tiny_model, backend):
    engine = engine_of(backend, tiny_model)
    before = engine.generate(requests(8), SAMPLING)
    engine.sleep(weights=True)
    assert all(p.numel() == 0 for p in engine._params().values())  # the storage is gone
    engine.wake()
    assert all(p.numel() > 0 for p in engine._params().values())
    with pytest.raises(PublicationError, match="publish the policy before generating"):
        engine.generate(requests(2), SAMPLING)  # the storage is back, but not yet the weights
    publish(engine, tiny_model, 0)
    assert engine.generate(requests(8), SAMPLING) == before
    # new weights after a sleep serve exactly as in a fresh engine (the native q/k/v and gate/up are fused
    # buffers: a publication must land in the buffers the forward reads, not in orphaned parameters)
    updated = perturbed(tiny_model)
    engine.sleep(weights=True)
    if backend == "native":
        assert all(m.gate_up_weight is None for m in fused_mlps(engine))  # freed, not only the views
    engine.wake()
    publish(engine, updated, 1)
    fresh = engine_of(backend, updated).generate(requests(8), SAMPLING)
    after = engine.generate(requests(8), SAMPLING)
    assert [c.tokens for c in after] == [c.tokens for c in fresh]
    assert [c.logprobs for c in after] == [c.logprobs for c in fresh]
    assert [c.logprobs for c in after] != [c.logprobs for c in before]


def fused_mlps(engine):
    from caspo.rollout.native.runner import MLP

    return [m for m in engine.runner.modules() if isinstance(m, MLP)]


def test_nucleus_keeps_ties_at_the_cut():
    from caspo.rollout.sampling import truncate_logits
    # probs ≈ [0.475, 0.175, 0.175, 0.064, ...]: the second token crosses 0.5; the third ties with it
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, 0.0]])
    kept = truncate_logits(logits, top_k=0, top_p=0.5) > float("-inf")
    assert kept.tolist() == [[True, True, True, False, False]]
    kept = truncate_logits(logits, top_k=0, top_p=0.4) > float("-inf")
    assert kept.tolist() == [[True, False, False, False, False]]
    kept = truncate_logits(logits, top_k=1, top_p=1.0) > float("-inf")
    assert kept.tolist() == [[True, False, False, False, False]]


def test_the_hf_engine_in_bf16_keeps_rope_in_float32(tiny_model):
    # model.to(bf16) would round inv_freq too and sample from another policy than the one trained
    inv_freq = dict(tiny_model.named_buffers())["model.rotary_emb.inv_freq"]
    assert inv_freq.dtype == torch.float32 and not torch.equal(inv_freq, inv_freq.bfloat16().float())
    engine = HFEngine(tiny_model, pad_token_id=0, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    kept = dict(engine.model.named_buffers())["model.rotary_emb.inv_freq"]
    assert kept.dtype == torch.float32 and torch.equal(kept, inv_freq)


def test_a_stop_string_begun_in_the_prompts_context_ends_the_completion(tiny_model):
    """A continuation's response prefix (Request.stop_context) is text the stop strings read: a stop string
    whose start the prefix's last token carries ends the continuation at the token that completes it."""
    decode = lambda ids: "".join(chr(65 + i % 26) for i in ids)  # noqa: E731
    engine = HFEngine(tiny_model, pad_token_id=0, decode=decode)
    free = SamplingParams(temperature=1.0, stop_token_ids=[])
    request = requests(1, max_new=8)[0]
    first = engine.generate([request], free)[0]
    stop = decode(request.prompt_ids[-1:]) + decode(first.tokens[:1])  # the prompt's last text, then the first
    sampling = SamplingParams(temperature=1.0, stop_token_ids=[], stop_strings=[stop])
    request.stop_context = 1
    cut = engine.generate([request], sampling)[0]
    assert (cut.finish_reason, cut.tokens) == ("stop", first.tokens[:1])
    request.stop_context = 0  # generated text alone: the stop string is not there (unless it comes again later)
    alone = engine.generate([request], sampling)[0]
    assert alone.tokens[:2] == first.tokens[:2] and len(alone.tokens) > 1


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_an_engine_built_from_a_skeleton_serves_only_after_a_publication(tiny_model, backend):
    """A rank of a sharded run other than 0 reads no weights: its engine is built from the policy's skeleton (on the
    meta device), refuses to sample until the first publication, then samples as one built from the weights,
    through a sleep that frees the weights and a wake (the trainer's order)."""
    with torch.device("meta"):
        skeleton = type(tiny_model)(tiny_model.config)
    engine = HFEngine(skeleton, pad_token_id=0, device="cpu") if backend == "hf" else \
        NativeEngine(skeleton, max_seq_len=32, capacity_tokens=32 * 8, device="cpu")
    with pytest.raises(PublicationError, match="built from a model's skeleton"):
        engine.generate(requests(2), SAMPLING)
    engine.sleep(weights=True)
    assert all(p.numel() == 0 for p in engine._params().values())
    engine.wake()
    publish(engine, tiny_model, 0)
    want = engine_of(backend, tiny_model).generate(requests(8), SAMPLING)
    got = engine.generate(requests(8), SAMPLING)
    assert [(c.tokens, c.logprobs) for c in got] == [(c.tokens, c.logprobs) for c in want]
    with pytest.raises(ValueError, match="needs device="):
        HFEngine(skeleton, pad_token_id=0) if backend == "hf" else \
            NativeEngine(skeleton, max_seq_len=32, capacity_tokens=32 * 8)
