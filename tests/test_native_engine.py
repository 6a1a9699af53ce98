"""The native engine against the transformers oracle, on tiny random Qwen2 and Llama models (CPU)."""

import os
import time
import weakref

import pytest
import torch
from native_checks import assert_equal_up_to_near_tie, engine, hf_logits, requests, with_and_without
from publication_checks import check_failed_publications_keep_old_weights, perturbed
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from caspo.models.policy import cast_parameters
from caspo.rollout.base import EngineAsleepError, Request, SamplingParams, publish
from caspo.rollout.hf import HFEngine
from caspo.rollout.native import NativeCompletion, NativeEngine, UnsupportedModelError, decoder_spec
from caspo.rollout.native.engine import default_admit_batch
from caspo.rollout.native.kv_cache import KVCache
from caspo.rollout.native.scheduler import Scheduler
from caspo.rollout.sampling import sample_seed

VOCAB = 100
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)  # wide logits: few near-ties


def qwen2_untied(**overrides):
    return Qwen2Config(**{**SHAPE, "tie_word_embeddings": False, **overrides})


def llama_tied(**overrides):
    return LlamaConfig(**{**SHAPE, "tie_word_embeddings": True, **overrides})


def build(config, seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(params=["qwen2_untied", "llama_tied"])
def model(request):
    return build({"qwen2_untied": qwen2_untied, "llama_tied": llama_tied}[request.param]())


# ---------------------------------------------------------------- numerics
SEQUENCES = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 70))]


def test_teacher_forced_logprobs_match_transformers_fp32(model):
    for sequence, logits in zip(SEQUENCES, engine(model).teacher_forced_logits(SEQUENCES)):
        diff = torch.log_softmax(logits, -1) - torch.log_softmax(hf_logits(model, sequence), -1)
        assert diff.abs().max() <= 1e-4


def test_teacher_forced_logprobs_match_transformers_bf16(model):
    model = cast_parameters(model, torch.bfloat16)
    native = engine(model)
    assert native.dtype == torch.bfloat16
    for sequence, logits in zip(SEQUENCES, native.teacher_forced_logits(SEQUENCES)):
        diff = torch.log_softmax(logits, -1) - torch.log_softmax(hf_logits(model, sequence), -1)
        assert diff.abs().mean() <= 1e-2


@pytest.mark.parametrize("make, rope", [
    (qwen2_untied, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}),
    (llama_tied, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    (llama_tied, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
])
def test_scaled_rope_variants_match_transformers(make, rope):
    model = build(make(rope_parameters=rope))
    assert decoder_spec(model.config).rope_type == rope["rope_type"]
    for sequence, logits in zip(SEQUENCES, engine(model).teacher_forced_logits(SEQUENCES)):
        diff = torch.log_softmax(logits, -1) - torch.log_softmax(hf_logits(model, sequence), -1)
        assert diff.abs().max() <= 1e-4


def test_behaviour_logprobs_of_the_decode_path_match_a_full_forward(model):
    sp = SamplingParams(temperature=1.0)
    for request, completion in zip(requests(4), engine(model).generate(requests(4), sp)):
        logits = hf_logits(model, request.prompt_ids + completion.tokens)[len(request.prompt_ids) - 1:-1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion.tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)
        assert completion.logprobs_full == completion.logprobs  # nothing truncated


def test_decode_as_cuda_graphs_run_it_changes_no_row(model):
    """Graphs decode every row of their batch size over all max_seq_len positions: same hidden states."""
    native = engine(model)
    sequences = [[3, 4, 5], [6, 7, 8, 9, 10], [11]]
    native.teacher_forced_logits(sequences)  # their K/V into slots 0, 1, 2
    tokens, positions = torch.tensor([12, 13, 14]), torch.tensor([len(s) for s in sequences])
    slots = torch.arange(3)
    tight = native.runner.decode(tokens, positions, slots, native.cache, key_len=int(positions.max()) + 1)
    idle = torch.zeros(5, dtype=torch.long)  # padding rows: token 0 at position 0 of a slot no one reads
    padded = native.runner.decode(torch.cat([tokens, idle]), torch.cat([positions, idle]),
                                  torch.cat([slots, idle + 3]), native.cache, key_len=native.max_seq_len)
    assert torch.allclose(padded[:3], tight, atol=1e-5)
    for sequence, token, hidden in zip(sequences, tokens.tolist(), tight):
        expected = hf_logits(model, sequence + [token])[-1]
        assert torch.allclose(native.runner.logits(hidden), expected, atol=1e-4)


def test_decode_kernel_gives_the_tokens_and_logprobs_of_masked_sdpa(model):
    """The split-K Triton decode attention (run by triton's interpreter on the CPU) in the engine's decode path."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton kernels need a GPU or TRITON_INTERPRET=1")
    sp = SamplingParams(temperature=1.0, stop_token_ids=[1])
    reqs = requests(6, max_new=10)
    got, expected = with_and_without(model, "decode_kernel", reqs, sp)
    assert [c.tokens for c in got] == [c.tokens for c in expected]
    for a, b in zip(got, expected):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


# ---------------------------------------------------------------- against HFEngine
def test_greedy_tokens_match_hf_engine(model):
    sp = SamplingParams(temperature=0.0)
    reqs = requests(8, max_new=16)
    assert_equal_up_to_near_tie(model, reqs, engine(model).generate(reqs, sp),
                                HFEngine(model, pad_token_id=0).generate(reqs, sp), sp)


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.8, stop_token_ids=[1]),
                                SamplingParams(temperature=1.0, top_k=20, top_p=0.9)])
def test_sampled_tokens_match_hf_engine_for_the_same_seeds(model, sp):
    reqs = requests(8, max_new=16)
    native = engine(model).generate(reqs, sp)
    assert_equal_up_to_near_tie(model, reqs, native, HFEngine(model, pad_token_id=0).generate(reqs, sp), sp)


def test_same_seed_same_tokens_whatever_the_batch_or_schedule(model):
    sp = SamplingParams(temperature=1.0, stop_token_ids=[1])
    reqs = requests(12)
    full = engine(model).generate(reqs, sp)
    assert len({len(c.tokens) for c in full}) > 1  # sequences leave at different steps
    for subset in ([3], [7, 2, 11], list(range(12))[::-1]):
        part = engine(model).generate([reqs[i] for i in subset], sp)
        for i, completion in zip(subset, part):
            assert completion.tokens == full[i].tokens
            assert completion.logprobs == pytest.approx(full[i].logprobs, abs=1e-5)
    for max_running in (1, 3, 16):
        scheduled = engine(model, max_running=max_running).generate(reqs, sp)
        assert [c.tokens for c in scheduled] == [c.tokens for c in full]


def test_on_finish_reports_each_request_once_when_it_leaves(model):
    sp = SamplingParams(temperature=1.0, stop_token_ids=[1])
    reqs = requests(12)
    reported = []
    native = engine(model, max_running=4)
    steps_at_report = []

    def on_finish(i, completion):
        reported.append((i, completion))
        steps_at_report.append(native.stats.decode_steps)

    out = native.generate(reqs, sp, on_finish=on_finish)
    assert sorted(i for i, _ in reported) == list(range(12))
    assert all(completion is out[i] for i, completion in reported)  # the final completion, not a copy in progress
    assert steps_at_report[0] < steps_at_report[-1]  # reported as they leave, not all at the end
    hf = []
    HFEngine(model, pad_token_id=0, max_batch=5).generate(reqs, sp, on_finish=lambda i, c: hf.append(i))
    assert hf == list(range(12))


def test_generate_time_is_split_into_admission_waiting_and_the_hosts_own_work(model):
    native = engine(model, max_running=3)
    before = native.stats.generate_s
    native.generate(requests(6), SamplingParams(temperature=1.0), on_finish=lambda i, c: time.sleep(0.02))
    s = native.stats
    host = s.generate_s - s.prefill_s - s.wait_s
    assert s.generate_s > before and s.prefill_s > 0 and s.wait_s >= 0
    assert host >= 6 * 0.02  # the callbacks run in the engine's own time, neither admission nor waiting


def test_a_decode_step_computes_only_the_sequences_it_decodes(model):
    sp = SamplingParams(temperature=1.0)
    prompt = requests(1)[0].prompt_ids
    for budgets in ((2, 8), (8, 2)):  # the short one in slot 0 (its slot then lies below a running one), or in 1
        native = engine(model, max_running=2)
        native.generate([Request(prompt, seed, budget) for seed, budget in enumerate(budgets)], sp)
        # 8 tokens: one sampled after the prefill, 7 decoded; 2 tokens: 1 decoded. A free slot is never a row.
        assert (native.stats.decode_steps, native.stats.decode_rows) == (7, 7 + 1)


@pytest.mark.parametrize("kernels", [False, True])  # masked SDPA; decode_attention and rope_store (interpreted)
def test_decode_rows_in_any_slot_order_give_the_same_hidden_states(model, kernels):
    native = engine(model, decode_kernel=kernels, rope_kernel=kernels)
    sequences = [[3, 4, 5], [6, 7, 8, 9, 10], [11]]
    native.teacher_forced_logits(sequences)  # slots 0, 1, 2 hold their K/V
    tokens, positions = torch.tensor([12, 13, 14]), torch.tensor([len(s) for s in sequences])
    in_order = native.runner.decode(tokens, positions, torch.arange(3), native.cache, key_len=6)
    native.teacher_forced_logits(sequences)  # the step wrote each token's K/V: write the prompts again
    order = torch.tensor([2, 0, 1])
    shuffled = native.runner.decode(tokens[order], positions[order], order, native.cache, key_len=6)
    assert torch.allclose(shuffled, in_order[order], atol=1e-6)


def test_shared_prefix_attention_gives_the_same_completions(monkeypatch):
    """K continuations of each of two prefixes and G samples of a prompt, with each group's prompt K/V read once
    (the kernels interpreted on the CPU) in the steps where that saves enough reads: the tokens of every row
    reading its own copy. The first step saves 2 × 12 + 2 × 40 + 3 × 3 = 113 keys a layer, the last (the
    samples' fifth token alone) 9: a threshold of 0 keys groups every step, one of 50 some, and the default
    (64 MiB a layer) none of this tiny model's."""
    from caspo.rollout.native import prefix_groups
    from caspo.rollout.native import runner as runner_module

    model = build(qwen2_untied())
    sp = SamplingParams(temperature=1.0, stop_token_ids=[1])
    response = list(range(10, 50))
    reqs = [Request(response[:n], seed=sample_seed(0, 1, n, j), max_new_tokens=4) for n in (12, 40)
            for j in range(3)] + [Request([7, 8, 9], seed=sample_seed(0, 2, 0, j), max_new_tokens=5) for j in range(4)]
    grouped_rows = []

    def spy(q, k, v, lengths, key_len, slots, groups):
        grouped_rows.append(int((groups.members >= 0).sum()))
        return shared(q, k, v, lengths, key_len, slots, groups)

    shared = runner_module.shared_prefix_decode_attention
    monkeypatch.setattr(runner_module, "shared_prefix_decode_attention", spy)
    # Eager RoPE: interpreted, its kernel would take most of a minute here (test_native_gpu runs both kernels).
    kernels = dict(decode_kernel=True, rope_kernel=False, max_seq_len=56, capacity_tokens=56 * 16)
    off = engine(model, **kernels).generate(reqs, sp)
    default = prefix_groups.MIN_BYTES_SAVED
    for min_keys_saved, grouped in ((0, "every step"), (50, "some steps"), (None, "no step")):
        grouping = engine(model, shared_prefix_attention=True, **kernels)
        threshold = default if min_keys_saved is None else min_keys_saved * grouping.model_runner.bytes_per_key
        monkeypatch.setattr(prefix_groups, "MIN_BYTES_SAVED", threshold)
        grouped_rows.clear()
        on = grouping.generate(reqs, sp)
        steps, grouped_steps = grouping.stats.decode_steps, grouping.stats.grouped_steps
        assert len(grouped_rows) == grouped_steps * model.config.num_hidden_layers  # the spy sees each layer
        if grouped == "every step":  # every row of the first step is in a group: 2 × 3 continuations, 4 samples
            assert max(grouped_rows) == 10 and grouped_steps == steps == 4
        elif grouped == "some steps":
            assert max(grouped_rows) == 10 and 0 < grouped_steps < steps
        else:
            assert grouped_steps == 0
        for a, b in zip(on, off):
            assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    with pytest.raises(ValueError, match="needs decode_kernel and prefix_sharing"):
        engine(model, shared_prefix_attention=True, decode_kernel=False)


def test_graph_padding_writes_into_a_slot_no_row_reads():
    from caspo.rollout.native.model_runner import unread_slot

    assert unread_slot([0, 1, 3], slots=5) == 2
    assert unread_slot([4, 2, 0, 1], slots=5) == 3
    with pytest.raises(ValueError, match="every one of the 3 slots"):
        unread_slot([1, 0, 2], slots=3)


# ---------------------------------------------------------------- stopping
def test_stop_tokens_stop_strings_and_per_request_budgets(model):
    decoded = []

    def decode(ids):
        decoded.append(list(ids))
        return "".join(chr(65 + i % 26) for i in ids)

    native = engine(model, decode=decode)
    reqs = requests(6, max_new=8)
    free = native.generate(reqs, SamplingParams(temperature=1.0))
    assert all(c.finish_reason == "length" and len(c.tokens) == r.max_new_tokens for c, r in zip(free, reqs))
    stop_id = free[0].tokens[2]
    by_id = native.generate(reqs[:1], SamplingParams(temperature=1.0, stop_token_ids=[stop_id]))[0]
    cut = free[0].tokens.index(stop_id) + 1
    assert (by_id.tokens, by_id.finish_reason) == (free[0].tokens[:cut], "stop")
    stop = chr(65 + free[0].tokens[2] % 26)  # appears at the third token at the latest
    before = len(decoded)
    by_string = native.generate(reqs[:1], SamplingParams(temperature=1.0, stop_strings=[stop]))[0]
    assert by_string.finish_reason == "stop" and len(by_string.tokens) <= 3
    assert by_string.tokens == free[0].tokens[:len(by_string.tokens)]
    # the second call with these stop strings decodes no token's own text again, only the windows
    first_call = len(decoded) - before
    assert native.generate(reqs[:1], SamplingParams(temperature=1.0, stop_strings=[stop]))[0] == by_string
    assert len(decoded) - before - first_call == first_call - len(set(by_string.tokens))
    with pytest.raises(ValueError, match="decode function"):
        engine(model).generate(reqs, SamplingParams(stop_strings=["x"]))


def test_full_and_top_logprobs_under_truncation(model):
    sp = SamplingParams(temperature=0.7, top_k=5)
    request = requests(3)[2]
    completion = engine(model).generate([request], sp, top_logprobs=4)[0]
    assert isinstance(completion, NativeCompletion)
    logits = hf_logits(model, request.prompt_ids + completion.tokens)[len(request.prompt_ids) - 1:-1]
    full = torch.log_softmax(logits / 0.7, -1)
    tokens = torch.tensor(completion.tokens)
    assert torch.allclose(torch.tensor(completion.logprobs_full), full.gather(-1, tokens[:, None])[:, 0], atol=1e-4)
    assert all(t > f for t, f in zip(completion.logprobs, completion.logprobs_full))  # renormalized over 5 tokens
    for position, top in enumerate(completion.top_logprobs):
        assert [t for t, _ in top] == full[position].topk(4).indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(full[position].topk(4).values.tolist(), abs=1e-4)
    assert engine(model).generate([request], sp)[0].top_logprobs is None


# ---------------------------------------------------------------- prefix sharing
def test_prefix_sharing_cuts_prefill_and_changes_no_token(model):
    sp = SamplingParams(temperature=1.0)
    prompts = [list(range(10, 40)), list(range(50, 62))]
    k = 4
    reqs = [Request(p, seed=sample_seed(0, 0, i, j), max_new_tokens=6) for i, p in enumerate(prompts) for j in range(k)]
    shared, alone = engine(model), engine(model, prefix_sharing=False)
    copies = []
    copy_prefix = shared.cache.copy_prefix
    shared.cache.copy_prefix = lambda src, dst, length: copies.append(len(dst)) or copy_prefix(src, dst, length)
    with_sharing, without = shared.generate(reqs, sp), alone.generate(reqs, sp)
    assert copies == [k - 1, k - 1]  # one copy per prompt into all of its other samples' slots
    assert [c.tokens for c in with_sharing] == [c.tokens for c in without]
    prompt_tokens = sum(len(p) for p in prompts)
    assert alone.stats.prefill_tokens == k * prompt_tokens
    assert shared.stats.prefill_tokens == prompt_tokens  # a drop of (K - 1) / K
    assert shared.stats.shared_tokens == (k - 1) * prompt_tokens


@pytest.mark.parametrize("recompute_budget", [0, 4096])
def test_prefix_sharing_of_step_prefixes_under_continuous_batching(model, recompute_budget):
    """Continuations from successive prefixes of one response: each copies the longest resident prefix."""
    sp = SamplingParams(temperature=1.0, stop_token_ids=[1])
    response = list(range(10, 90))
    reqs = [Request(response[:length], seed=sample_seed(0, 1, length, j), max_new_tokens=5)
            for length in (20, 40, 60, 80) for j in range(3)]
    for max_running in (2, 12):
        shared = engine(model, max_seq_len=96, capacity_tokens=96 * 12, max_running=max_running,
                        recompute_budget=recompute_budget)
        alone = engine(model, max_seq_len=96, capacity_tokens=96 * 12, max_running=max_running,
                       prefix_sharing=False)
        assert [c.tokens for c in shared.generate(reqs, sp)] == [c.tokens for c in alone.generate(reqs, sp)]
        assert alone.stats.prefill_tokens == 3 * (20 + 40 + 60 + 80)
        assert shared.stats.prefill_tokens + shared.stats.shared_tokens == alone.stats.prefill_tokens
        assert shared.stats.prefill_tokens < alone.stats.prefill_tokens  # donors must be resident: fewer with 2
    # All admitted at once. Copying link by link, each prompt computes what extends the last, one forward per
    # link; within the budget the links are computed again (20 + 40 + 60 positions), in one forward.
    chained = recompute_budget < 20 + 40 + 60
    assert shared.stats.prefill_tokens == (80 if chained else 200)
    assert shared.stats.prefill_forwards == (4 if chained else 1)


def test_a_chain_over_the_recompute_budget_copies_link_by_link():
    """The round's recomputed positions decide: a budget one below them keeps every link a copy."""
    sp = SamplingParams(temperature=1.0)
    prompt = list(range(10, 58))  # 48 tokens: three 16-token blocks
    resident, *chain = (Request(prompt[:n], seed=n, max_new_tokens=4) for n in (16, 32, 48, 48))
    for budget, copies_from in ((16, {1: 0, 2: 0, 3: 2}), (15, {1: 0, 2: 1, 3: 2})):
        scheduler = Scheduler([resident], slots=4, prefix_sharing=True, max_prefill_tokens=64,
                              sampling=sp, admit_batch=1, recompute_budget=budget)
        scheduler.plan_prefill(scheduler.admit())  # the 16-token prompt is resident before the others arrive
        scheduler.waiting.extend(enumerate(chain, start=1))
        plan = scheduler.plan_prefill(scheduler.admit())
        shares = {seq.index: shared.slot for wave in plan for seq, shared in wave.shares}
        assert shares == copies_from  # index 3 repeats index 2's prompt: an exact share either way
        assert sum(1 for wave in plan if wave.forwards) == (1 if budget == 16 else 2)


def test_batched_admission_waits_for_free_slots_and_changes_no_token(model):
    """With admit_batch=4 a waiting request enters only once 4 slots are free (or the rest fit): fewer
    prefill rounds than admitting whenever one slot frees, and the same tokens."""
    sp = SamplingParams(temperature=1.0)
    reqs = [Request([5 + i % 7, 9], seed=sample_seed(0, 0, i, 0), max_new_tokens=2 + i % 7) for i in range(20)]
    eager, batched = engine(model, max_running=8, admit_batch=1), engine(model, max_running=8, admit_batch=4)
    assert [c.tokens for c in batched.generate(reqs, sp)] == [c.tokens for c in eager.generate(reqs, sp)]
    assert batched.stats.prefill_rounds < eager.stats.prefill_rounds
    for stats in (batched.stats, eager.stats):  # every prompt position computed or copied once
        assert stats.prefill_tokens + stats.shared_tokens == 2 * 20

    scheduler = Scheduler(reqs[:7], slots=4, prefix_sharing=False, max_prefill_tokens=64, sampling=sp,
                          admit_batch=2)
    assert [s.index for s in scheduler.admit()] == [0, 1, 2, 3]  # nothing runs: every free slot is taken
    scheduler.free.append(scheduler.running.pop(0).slot)
    assert scheduler.admit() == []  # one slot free, three waiting: wait for a second
    scheduler.free.append(scheduler.running.pop(0).slot)
    assert [s.index for s in scheduler.admit()] == [4, 5]
    scheduler.free.append(scheduler.running.pop(0).slot)
    assert [s.index for s in scheduler.admit()] == [6]  # the last waiting request fits: no reason to wait
    with pytest.raises(ValueError, match="admit_batch=9 must be in"):
        engine(model, max_running=8, admit_batch=9)


def test_the_default_admission_batch_is_an_eighth_of_the_slots_from_1_to_64(model):
    assert [default_admit_batch(n) for n in (1, 8, 15, 16, 420, 512, 1024, 4096)] == [1, 1, 1, 2, 52, 64, 64, 64]
    assert engine(model, capacity_tokens=64 * 24).admit_batch == 3  # 24 slots


def test_prefill_forwards_group_pieces_of_similar_width():
    """Pieces are packed longest first: two 100-token prompts share a forward and the 5-token ones another,
    where packing in request order would pad a 5-token prompt to 100 in every forward."""
    sp = SamplingParams(temperature=1.0)
    reqs = [Request(list(range(3, 3 + n)), seed=i, max_new_tokens=2) for i, n in enumerate((100, 5, 100, 5))]
    scheduler = Scheduler(reqs, slots=4, prefix_sharing=False, max_prefill_tokens=200, sampling=sp)
    (wave,) = scheduler.plan_prefill(scheduler.admit())
    assert [[(p.seq.index, p.count) for p in pieces] for pieces in wave.forwards] == [[(0, 100), (2, 100)],
                                                                                      [(1, 5), (3, 5)]]


def test_chunked_prefill_gives_the_same_tokens(model):
    sp = SamplingParams(temperature=1.0)
    reqs = [Request(list(range(3, 3 + n)), seed=n, max_new_tokens=6) for n in (5, 23, 41)]
    whole = engine(model).generate(reqs, sp)
    chunked = engine(model, max_prefill_tokens=8, prefix_sharing=False)
    assert [c.tokens for c in chunked.generate(reqs, sp)] == [c.tokens for c in whole]
    assert chunked.stats.prefill_tokens == 5 + 23 + 41


# ---------------------------------------------------------------- publication
def test_publication_changes_outputs_exactly_as_a_fresh_load(model):
    sp = SamplingParams(temperature=1.0, stop_token_ids=[1])
    native = engine(model)
    before = native.generate(requests(8), sp)
    updated = perturbed(model)
    digest = publish(native, updated, version=1)
    after = native.generate(requests(8), sp)
    fresh = engine(updated).generate(requests(8), sp)
    assert [c.tokens for c in after] == [c.tokens for c in fresh]
    assert [c.logprobs for c in after] == [c.logprobs for c in fresh]
    assert [c.tokens for c in after] != [c.tokens for c in before]
    assert all(c.policy_version == 1 for c in after)
    assert digest == native.digest() == HFEngine(updated, pad_token_id=0).digest()  # same names, same values


def test_incomplete_or_mismatched_publication_keeps_old_weights(model):
    check_failed_publications_keep_old_weights(engine(model), model, requests(8),
                                               SamplingParams(temperature=1.0, stop_token_ids=[1]))


# ---------------------------------------------------------------- cache and memory
def test_capacity_report_matches_the_arithmetic():
    native = engine(build(qwen2_untied()), max_seq_len=48, capacity_tokens=1000)
    per_token = 2 * 2 * 2 * 16 * 4  # layers × (k, v) × kv heads × head_dim × float32 bytes
    report = native.capacity_report()
    assert report.bytes_per_token == per_token
    assert (report.blocks, report.block_tokens, report.tokens) == (1000 // 48, 48, 1000 // 48 * 48)
    assert report.bytes == report.tokens * per_token == native.cache.kv.numel() * 4
    assert native.max_running == 20


def test_copy_prefix_fills_every_sharer_and_nothing_else():
    cache = KVCache(slots=5, max_seq_len=6, layers=2, kv_heads=1, head_dim=3, dtype=torch.float32, device="cpu",
                    planes=2)
    cache.kv.copy_(torch.randn(cache.shape))
    before = cache.kv.clone()
    cache.copy_prefix(1, torch.tensor([0, 3]), length=4)
    for slot in (0, 3):
        assert torch.equal(cache.kv[:, :, :, slot, :, :4], before[:, :, :, 1, :, :4])
        assert torch.equal(cache.kv[:, :, :, slot, :, 4:], before[:, :, :, slot, :, 4:])
    untouched = [1, 2, 4]
    assert torch.equal(cache.kv[:, :, :, untouched], before[:, :, :, untouched])


def test_cache_sizing_errors():
    model = build(qwen2_untied())
    with pytest.raises(ValueError, match="exactly one"):
        NativeEngine(model, max_seq_len=64)
    with pytest.raises(ValueError, match="capacity_tokens"):
        NativeEngine(model, max_seq_len=64, gpu_memory_fraction=0.5)
    with pytest.raises(ValueError, match="max_running"):
        NativeEngine(model, max_seq_len=64, capacity_tokens=128, max_running=3)
    with pytest.raises(ValueError, match="cuda_graphs"):
        NativeEngine(model, max_seq_len=64, capacity_tokens=128, cuda_graphs=True)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine(model).generate([Request(list(range(60)), seed=0, max_new_tokens=5)], SamplingParams())


def test_sleep_and_wake_round_trip(model):
    sp = SamplingParams(temperature=1.0, stop_token_ids=[1])
    native = engine(model)
    before = native.generate(requests(8), sp, top_logprobs=3)
    kv = weakref.ref(native.cache.kv)
    native.sleep()
    assert native.asleep and native.cache.kv is None and not native.cache.allocated
    assert kv() is None  # nothing (a view, a graph, the model runner) still holds the cache's memory
    with pytest.raises(EngineAsleepError, match="asleep"):
        native.generate(requests(2), sp)
    with pytest.raises(EngineAsleepError, match="asleep"):
        native.teacher_forced_logits(SEQUENCES)
    native.wake()
    assert not native.asleep and native.cache.kv.numel() * 4 == native.capacity_report().bytes
    assert native.generate(requests(8), sp, top_logprobs=3) == before  # every token, log-prob and top list


# ---------------------------------------------------------------- loading
def test_checkpoint_folder_loads_like_the_live_module(model, tmp_path):
    model.save_pretrained(tmp_path)
    sp = SamplingParams(temperature=1.0, stop_token_ids=[1])
    from_folder, from_module = engine(str(tmp_path)), engine(model)
    assert from_folder.digest() == from_module.digest()
    assert from_folder.dtype == torch.float32 and from_folder.device == torch.device("cpu")
    assert [c.tokens for c in from_folder.generate(requests(6), sp)] == [
        c.tokens for c in from_module.generate(requests(6), sp)]


@pytest.mark.parametrize("config, key", [
    (qwen2_untied(use_sliding_window=True, sliding_window=16, max_window_layers=0), "use_sliding_window"),
    (llama_tied(attention_bias=True), "attention_bias"),
    (llama_tied(mlp_bias=True), "mlp_bias"),
    (llama_tied(hidden_act="gelu"), "hidden_act"),
    (llama_tied(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "rope_type"),
])
def test_unsupported_config_features_raise_naming_the_key(config, key, tmp_path):
    with pytest.raises(UnsupportedModelError, match=key):
        decoder_spec(config)
    build(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=key):
        NativeEngine(str(tmp_path), max_seq_len=64, capacity_tokens=640)


def test_an_unsupported_family_raises():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'"):
        decoder_spec(GPT2Config())


def test_a_cache_that_does_not_fit_names_its_size_and_the_setting_to_lower(monkeypatch):
    import caspo.rollout.native.kv_cache as kv_cache
    from caspo.cli import user_errors

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 28.00 GiB")

    monkeypatch.setattr(kv_cache.torch, "zeros", out_of_memory)
    # 28 layers × (k, v) × 2 kv heads × 128 dims × 2 bytes = 28,672 bytes a position; × 256 × 4,096 = 28 GiB.
    with pytest.raises(kv_cache.CacheDoesNotFit) as caught:
        KVCache(slots=256, max_seq_len=4096, layers=28, kv_heads=2, head_dim=128, dtype=torch.bfloat16, device="cpu")
    message = str(caught.value)
    assert "28.0 GiB: 256 slots of 4096 positions" in message
    assert "rollout.gpu_memory_fraction" in message and "rollout.capacity_tokens" in message
    assert isinstance(caught.value, torch.OutOfMemoryError)  # whoever handles an OOM still sees one
    assert isinstance(caught.value, user_errors())  # the CLI prints the line, not a traceback
