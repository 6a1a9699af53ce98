"""Programmatic dependent launch (caspo/rollout/dependent_launch.py): where it is used, that every kernel launched
with it waits for the kernel ahead before touching memory, and on a card that it changes no number."""

import ast
import inspect
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from caspo.rollout import dependent_launch, gumbel_kernel, mass_above, nucleus_reads, nucleus_resolve  # noqa: E402
from caspo.rollout.native import decode_attention, rope_attention, rope_store, shared_prefix_attention  # noqa: E402

ENGINE_KERNEL_MODULES = (gumbel_kernel, mass_above, nucleus_reads, nucleus_resolve, decode_attention, rope_attention,
                         rope_store, shared_prefix_attention)


def launched_kernels(module) -> dict:
    """The module's kernels (compiled, or interpreted under TRITON_INTERPRET=1) that a launch of its own runs
    (`name[grid](...)`)."""
    source = inspect.getsource(module)
    return {name: kernel for name, kernel in vars(module).items()
            if hasattr(kernel, "arg_names") and getattr(getattr(kernel, "fn", None), "__module__", None) ==
            module.__name__ and f"{name}[(" in source}


def test_every_launched_kernel_waits_for_the_kernel_ahead_first():
    """A kernel launched with PDL that touched memory before its wait could read what the kernel ahead has not yet
    written, or overwrite what it still reads: each one's first statement is the wait."""
    checked = []
    for module in ENGINE_KERNEL_MODULES:
        for name, kernel in launched_kernels(module).items():
            if name == "_gumbel_noise32_kernel":  # the tests' probe of the pick's noise, launched on its own
                continue
            assert "PDL" in kernel.arg_names, f"{module.__name__}.{name} takes no PDL"
            statements = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0].body
            first = next(s for s in statements if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)))
            assert ast.unparse(first) == "wait_for_previous_kernel(PDL)", f"{module.__name__}.{name} starts with " \
                                                                          f"{ast.unparse(first)!r}"
            checked.append(name)
    assert len(checked) >= 17  # the attention kernels, the pick's two and the nucleus search's


def test_launch_options_turn_pdl_on_only_on_hopper_cards_when_enabled(monkeypatch):
    monkeypatch.setattr(dependent_launch, "INTERPRETED", False)
    monkeypatch.setattr(dependent_launch, "_hopper_or_later", lambda device: device.index != 1)
    cuda, older_card = torch.device("cuda", 0), torch.device("cuda", 1)
    assert dependent_launch.launch_options(cuda) == {"PDL": True, "launch_pdl": True}
    assert dependent_launch.launch_options(older_card) == {"PDL": False, "launch_pdl": False}
    assert dependent_launch.launch_options(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(dependent_launch, "ENABLED", False)
    assert dependent_launch.launch_options(cuda) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(dependent_launch, "ENABLED", True)
    monkeypatch.setattr(dependent_launch, "INTERPRETED", True)  # numpy has no grid dependencies
    assert dependent_launch.launch_options(cuda) == {"PDL": False, "launch_pdl": False}


def hopper() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA card of compute capability 9.0 or later")


@pytest.mark.gpu
def test_a_dependent_kernel_reads_all_of_a_long_gemms_output():
    """In a CUDA graph the fused decode kernel, launched with PDL, follows a GEMM that writes its qkv for about
    a hundred microseconds; the kernel's programs are scheduled while the GEMM runs. Over NaN-filled buffers
    and ten replays, it must read the GEMM's whole output: the same numbers as launched without PDL."""
    hopper()
    from test_rope_store import rope_tables

    heads, kv_heads, head_dim, length, rows = 12, 2, 128, 640, 256
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 32768, generator=generator).bfloat16().cuda() / 64
    weight = torch.randn(32768, (heads + 2 * kv_heads) * head_dim, generator=generator).bfloat16().cuda() / 64
    cos, sin = (t.cuda() for t in rope_tables(length, head_dim, torch.bfloat16))
    slots = torch.arange(rows).cuda()
    positions = torch.randint(0, length, (rows,), generator=generator).cuda()
    initial = torch.randn(2, rows, kv_heads, length, head_dim, generator=generator).bfloat16().cuda()

    def step(cache, qkv):
        torch.mm(x, weight, out=qkv)
        return rope_attention.rope_decode_attention(qkv, cos, sin, positions, positions + 1, slots, length, cache[0],
                                                    cache[1], heads)

    outputs = {}
    for enabled in (False, True):
        dependent_launch.ENABLED = enabled
        try:
            cache, qkv = initial.clone(), torch.full((rows, weight.shape[1]), float("nan"), device="cuda",
                                                     dtype=torch.bfloat16)
            step(cache, qkv)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step(cache, qkv)
            results = []
            for _ in range(10):
                cache.copy_(initial)
                qkv.fill_(float("nan"))
                graph.replay()
                results.append((out.clone(), cache.clone()))
            outputs[enabled] = results
        finally:
            dependent_launch.ENABLED = True
    expected_out, expected_cache = outputs[False][0]
    assert not expected_out.isnan().any()
    for out, cache in outputs[True] + outputs[False]:
        assert torch.equal(out, expected_out) and torch.equal(cache, expected_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_an_engine_samples_the_same_with_and_without_dependent_launch(top_p):
    """The engine's own kernels (attention, the pick, the nucleus search) launched with and without PDL, in its
    decode graphs: the same tokens and log-probs, bit for bit. (torch.compile's kernels keep what they were
    compiled with on their first call.)"""
    hopper()
    from test_native_gpu import build, native, requests

    from caspo.rollout.base import SamplingParams

    model = build("qwen2")
    sp = SamplingParams(temperature=0.8, top_p=top_p)
    results = {}
    for enabled in (True, False):
        dependent_launch.ENABLED = enabled
        try:
            results[enabled] = native(model, cuda_graphs=True).generate(requests(16), sp)
        finally:
            dependent_launch.ENABLED = True
    assert [c.tokens for c in results[True]] == [c.tokens for c in results[False]]
    assert [c.logprobs for c in results[True]] == [c.logprobs for c in results[False]]
