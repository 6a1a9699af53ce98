"""The native engine on looped models (both layouts, depth 1, 2, 4) against `LoopedForCausalLM`.

CPU tests run by default; the CUDA tests at the end run with `pytest -m gpu`.
"""

from types import SimpleNamespace

import pytest
import torch
from native_checks import assert_equal_up_to_near_tie, engine, hf_logits, requests
from publication_checks import check_failed_publications_keep_old_weights, perturbed

from caspo.config import load_config
from caspo.models.looped import CACHE_FIELD, LoopedConfig, LoopedForCausalLM
from caspo.rollout.base import Request, SamplingParams, publish
from caspo.rollout.factory import build_engine
from caspo.rollout.hf import HFEngine
from caspo.rollout.native import LoopedSpec, NativeEngine, UnsupportedModelError, decoder_spec
from caspo.rollout.native.engine import default_admit_batch
from caspo.rollout.native.looped_runner import LoopedCausalLM
from caspo.rollout.sampling import sample_seed

VOCAB = 100
LAYOUTS = ["ouro", "nanbeige"]
DEPTHS = [1, 2, 4]


def looped(layout, depth, seed=0, **overrides):
    """Ouro: untied head, 4 heads of 12. Nanbeige: tied head, GQA, non-square q/o (4 heads × 16 ≠ 48 hidden).
    A wide initialization gives wide logits (few near-ties); norms move away from 1 so their placement matters."""
    nanbeige = layout == "nanbeige"
    config = LoopedConfig(**{**dict(
        layout=layout, depth=depth, vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2 if nanbeige else 4, head_dim=16 if nanbeige else None,
        rope_theta=500.0, initializer_range=0.2, tie_word_embeddings=nanbeige), **overrides})
    torch.manual_seed(seed)
    model = LoopedForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.fixture(params=[(layout, depth) for layout in LAYOUTS for depth in DEPTHS], ids=lambda p: f"{p[0]}-{p[1]}")
def model(request):
    return looped(*request.param)


# ---------------------------------------------------------------- numerics
SEQUENCES = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 70))]


def test_spec_and_runner_of_a_looped_config(model):
    native = engine(model)
    spec = native.spec
    assert isinstance(spec, LoopedSpec) and isinstance(native.runner, LoopedCausalLM)
    assert (spec.layout, spec.depth, spec.planes, spec.num_layers) == (model.config.layout, model.config.depth,
                                                                       model.config.depth, 2)
    assert (native.cache.planes, native.cache.layers) == (model.config.depth, 2)
    assert native.digest() == HFEngine(model, pad_token_id=0).digest()  # every weight by name, the exit gate too


def test_teacher_forced_logits_match_the_looped_model_fp32(model):
    for sequence, logits in zip(SEQUENCES, engine(model).teacher_forced_logits(SEQUENCES)):
        assert (logits - hf_logits(model, sequence)).abs().max() <= 1e-4


def test_plane_of_loop_t_layer_l_holds_the_looped_caches_plane(model):
    """cache.layer(t, l) of the engine holds what LoopedCache plane t·L + l holds."""
    native = engine(model)
    sequence = SEQUENCES[0]
    native.teacher_forced_logits([sequence])  # into slot 0
    with torch.no_grad():
        reference = getattr(model(torch.tensor([sequence]), use_cache=True), CACHE_FIELD)
    n = len(sequence)
    for t in range(model.config.depth):
        for layer in range(2):
            keys, values = native.cache.layer(t, layer)
            plane = reference.layers[reference.plane(t, layer)]
            torch.testing.assert_close(keys[0, :, :n], plane.keys[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(values[0, :, :n], plane.values[0], atol=1e-5, rtol=0)


def test_decode_as_cuda_graphs_run_it_changes_no_row(model):
    """Graphs decode every row of their batch size over all max_seq_len positions: same hidden states."""
    native = engine(model)
    sequences = [[3, 4, 5], [6, 7, 8, 9, 10], [11]]
    native.teacher_forced_logits(sequences)
    tokens, positions = torch.tensor([12, 13, 14]), torch.tensor([len(s) for s in sequences])
    slots = torch.arange(3)
    tight = native.runner.decode(tokens, positions, slots, native.cache, key_len=int(positions.max()) + 1)
    idle = torch.zeros(5, dtype=torch.long)  # padding rows: token 0 at position 0 of a slot no one reads
    padded = native.runner.decode(torch.cat([tokens, idle]), torch.cat([positions, idle]),
                                  torch.cat([slots, idle + 3]), native.cache, key_len=native.max_seq_len)
    assert torch.allclose(padded[:3], tight, atol=1e-5)
    for sequence, token, hidden in zip(sequences, tokens.tolist(), tight):
        assert torch.allclose(native.runner.logits(hidden), hf_logits(model, sequence + [token])[-1], atol=1e-4)


# ---------------------------------------------------------------- generation
def test_greedy_tokens_match_hf_engine(model):
    sp = SamplingParams(temperature=0.0)
    reqs = requests(8, max_new=16)
    assert_equal_up_to_near_tie(model, reqs, engine(model).generate(reqs, sp),
                                HFEngine(model, pad_token_id=0).generate(reqs, sp), sp)


def test_behaviour_logprobs_of_the_decode_path_match_a_full_forward(model):
    for request, completion in zip(requests(4), engine(model).generate(requests(4), SamplingParams())):
        logits = hf_logits(model, request.prompt_ids + completion.tokens)[len(request.prompt_ids) - 1:-1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion.tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefix_sharing_changes_no_token(layout):
    """The G samples of a prompt and continuations from step prefixes (block and whole-prompt shares)."""
    model = looped(layout, depth=2)
    sp = SamplingParams(temperature=1.0, stop_token_ids=[1])
    response = list(range(10, 90))
    reqs = [Request(response[:length], seed=sample_seed(0, 1, length, j), max_new_tokens=5)
            for length in (20, 40, 60, 80) for j in range(3)]
    for max_running in (2, 12):
        shared = engine(model, max_seq_len=96, capacity_tokens=96 * 12, max_running=max_running)
        alone = engine(model, max_seq_len=96, capacity_tokens=96 * 12, max_running=max_running, prefix_sharing=False)
        assert [c.tokens for c in shared.generate(reqs, sp)] == [c.tokens for c in alone.generate(reqs, sp)]
        assert shared.stats.shared_tokens > 0
        assert shared.stats.prefill_tokens + shared.stats.shared_tokens == alone.stats.prefill_tokens


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_prefill_and_schedules_give_the_same_tokens(layout):
    model = looped(layout, depth=2)
    sp = SamplingParams(temperature=1.0)
    reqs = [Request(list(range(3, 3 + n)), seed=n, max_new_tokens=6) for n in (5, 23, 41)]
    whole = [c.tokens for c in engine(model).generate(reqs, sp)]
    assert [c.tokens for c in engine(model, max_prefill_tokens=8).generate(reqs, sp)] == whole
    assert [c.tokens for c in engine(model, max_running=1).generate(reqs, sp)] == whole


# ---------------------------------------------------------------- publication and loading
@pytest.mark.parametrize("layout", LAYOUTS)
def test_publication_changes_outputs_exactly_as_a_fresh_load(layout):
    model = looped(layout, depth=2)
    sp = SamplingParams(temperature=1.0, stop_token_ids=[1])
    native = engine(model)
    before = native.generate(requests(8), sp)
    updated = perturbed(model)  # the exit gate moves too: the trainer publishes frozen parameters as well
    digest = publish(native, updated, version=1)
    after = native.generate(requests(8), sp)
    fresh = engine(updated).generate(requests(8), sp)
    assert [(c.tokens, c.logprobs) for c in after] == [(c.tokens, c.logprobs) for c in fresh]
    assert [c.tokens for c in after] != [c.tokens for c in before]
    assert all(c.policy_version == 1 for c in after)
    assert digest == native.digest() == HFEngine(updated, pad_token_id=0).digest()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_incomplete_or_mismatched_publication_keeps_old_weights(layout):
    model = looped(layout, depth=2)
    check_failed_publications_keep_old_weights(engine(model), model, requests(8),
                                                SamplingParams(temperature=1.0, stop_token_ids=[1]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint_folder_loads_like_the_live_module(layout, tmp_path):
    model = looped(layout, depth=2)
    model.save_pretrained(tmp_path)
    sp = SamplingParams(temperature=1.0, stop_token_ids=[1])
    from_folder, from_module = engine(str(tmp_path)), engine(model)
    assert isinstance(from_folder.runner, LoopedCausalLM)
    assert from_folder.digest() == from_module.digest()
    assert [c.tokens for c in from_folder.generate(requests(6), sp)] == [
        c.tokens for c in from_module.generate(requests(6), sp)]


def test_build_engine_serves_a_looped_policy_natively():
    cfg = load_config("tests", ["rollout.backend=native"])
    policy = looped("ouro", depth=2)
    tokenizer = SimpleNamespace(decode=lambda ids: "", pad_token_id=0, eos_token_id=1)
    native = build_engine(cfg, policy, tokenizer, max_seq_len=64)
    assert isinstance(native.runner, LoopedCausalLM) and native.cache.planes == 2
    assert native.admit_batch == default_admit_batch(native.max_running)  # rollout.admit_batch=0: the engine's default
    admitting = build_engine(load_config("tests", ["rollout.backend=native", "rollout.admit_batch=3"]), policy,
                             tokenizer, max_seq_len=64)
    assert admitting.admit_batch == 3
    sp = SamplingParams(temperature=1.0)
    assert [c.tokens for c in native.generate(requests(6), sp)] == [
        c.tokens for c in engine(policy).generate(requests(6), sp)]


@pytest.mark.parametrize("key, value", [("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu")])
def test_unsupported_config_features_raise_naming_the_key(key, value, tmp_path):
    model = looped("nanbeige", depth=2, **{key: value})
    with pytest.raises(UnsupportedModelError, match=key):
        decoder_spec(model.config)
    model.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=key):
        NativeEngine(str(tmp_path), max_seq_len=64, capacity_tokens=640)


def test_an_unknown_layout_raises_naming_the_key():
    config = looped("ouro", depth=2).config
    config.layout = "universal"  # LoopedConfig checks it at construction; the spec checks it again at load
    with pytest.raises(UnsupportedModelError, match="layout='universal'"):
        decoder_spec(config)


# ---------------------------------------------------------------- capacity
def test_capacity_report_counts_every_plane():
    native = engine(looped("nanbeige", depth=4), max_seq_len=48, capacity_tokens=1000)
    per_token = 4 * 2 * 2 * 2 * 16 * 4  # planes × layers × (k, v) × kv heads × head_dim × float32 bytes = 2048
    report = native.capacity_report()
    assert report.bytes_per_token == per_token == 2048
    assert (report.planes, report.blocks, report.block_tokens, report.tokens) == (4, 20, 48, 960)
    assert report.token_planes == 3840  # 960 positions × 4 loops, per layer
    assert report.bytes == 960 * 2048 == 1966080 == native.cache.kv.numel() * 4
    assert native.max_running == 20


def test_a_cache_that_holds_no_sequence_is_refused_with_the_numbers():
    model = looped("nanbeige", depth=4)
    with pytest.raises(ValueError) as error:
        NativeEngine(model, max_seq_len=64, capacity_tokens=63)
    message = str(error.value)
    for part in ("capacity_tokens=63", "max_seq_len=64", "64 tokens × 2048 bytes per token = 131072 bytes",
                 "4 KV planes per layer", "raise capacity_tokens"):
        assert part in message
    with pytest.raises(ValueError, match="max_running=3, but the KV cache holds 2 sequences"):
        NativeEngine(model, max_seq_len=64, capacity_tokens=128, max_running=3)


# ---------------------------------------------------------------- CUDA (pytest -m gpu)
CUDA = torch.device("cuda")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BF16_TIE = 5e-2  # bf16 logits carry rounding of about 1e-2


def bf16_pair(layout, depth):
    """A bf16 model on CUDA and its fp32 twin with the same (bf16-rounded) weights: the eager reference.

    Narrower than the CPU models: with logits of std 1.5 bf16 rounding alone (in transformers as
    here) moves them by up to 0.5 after four loops, beyond any near-tie tolerance."""
    model = looped(layout, depth, initializer_range=0.1).to(CUDA, torch.bfloat16)
    return model, looped(layout, depth, initializer_range=0.1).to(CUDA, torch.bfloat16).float()


def gpu_requests(n, max_new=16):
    return [Request([5 + i % 7, 9, 11 + i % 3, 20 + i][: 1 + i % 4], seed=sample_seed(0, 0, i, 0),
                    max_new_tokens=max_new - i % 4) for i in range(n)]


def cuda_engine(model, **kw):
    return NativeEngine(model, max_seq_len=96, capacity_tokens=96 * 16, **kw)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("depth", DEPTHS)
def test_teacher_forced_logits_bf16_as_close_to_fp32_as_the_looped_model_bf16(layout, depth):
    model, reference = bf16_pair(layout, depth)
    sequences = [[3, 4, 5, 6, 7, 8, 9], list(range(20, 90))]
    for sequence, logits in zip(sequences, cuda_engine(model).teacher_forced_logits(sequences)):
        exact = hf_logits(reference, sequence)
        oracle_error = (hf_logits(model, sequence) - exact).abs().mean()
        assert (logits - exact).abs().mean() <= 1.1 * oracle_error + 1e-3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("depth", DEPTHS)
def test_greedy_with_and_without_cuda_graphs_bf16(layout, depth):
    """Graphs and eager decode give the same greedy tokens; both match the fp32 reference up to near-ties."""
    model, reference = bf16_pair(layout, depth)
    sp = SamplingParams(temperature=0.0)
    reqs = gpu_requests(24, max_new=10)  # short and many: a near-tie comes every few tokens at this width
    eager = cuda_engine(model).generate(reqs, sp)
    graphed = cuda_engine(model, cuda_graphs=True).generate(reqs, sp)
    assert [c.tokens for c in graphed] == [c.tokens for c in eager]
    fp32 = cuda_engine(reference).generate(reqs, sp)
    assert_equal_up_to_near_tie(reference, reqs, eager, fp32, sp, tol=BF16_TIE, share=0.3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_publication_and_sleep_keep_looped_graphs_valid(layout):
    model = looped(layout, depth=2).to(CUDA, torch.bfloat16)
    sp = SamplingParams(temperature=1.0)
    native = cuda_engine(model, cuda_graphs=True)
    updated = perturbed(model)
    publish(native, updated, version=1)
    after = native.generate(gpu_requests(8), sp)
    assert [c.tokens for c in after] == [c.tokens for c in cuda_engine(updated, cuda_graphs=True).generate(
        gpu_requests(8), sp)]
    native.sleep()
    native.wake()
    assert [c.tokens for c in native.generate(gpu_requests(8), sp)] == [c.tokens for c in after]


@pytest.mark.gpu
@needs_cuda
def test_cache_sized_from_the_gpu_memory_fraction_counts_planes():
    native = NativeEngine(looped("nanbeige", depth=4).to(CUDA, torch.bfloat16), max_seq_len=1024,
                          gpu_memory_fraction=0.01)
    report = native.capacity_report()
    assert report.bytes_per_token == 4 * 2 * 2 * 2 * 16 * 2  # planes × layers × (k, v) × kv heads × head_dim × bf16
    budget = int(torch.cuda.get_device_properties(CUDA).total_memory * 0.01)
    assert budget - report.block_tokens * report.bytes_per_token < report.bytes <= budget
