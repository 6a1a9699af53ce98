"""Models loaded for CUDA run attention without cuDNN (caspo.models.policy.attention_without_cudnn): a padded
batch takes the memory-efficient kernel, forward and backward, never cuDNN's and never the math fallback; the
trainer's forward, its rows shifted to column 0 (`response_states`), takes the flash kernel, and so does the native
engine's prefill of whole prompts."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from caspo.models.policy import attention_without_cudnn, load_policy
from caspo.rollout.base import Request, SamplingParams


@pytest.fixture
def cudnn_flag():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_the_switch_turns_cudnn_attention_off(cudnn_flag):
    torch.backends.cuda.enable_cudnn_sdp(True)
    attention_without_cudnn()
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_a_cpu_load_leaves_the_backends_alone(cudnn_flag, tmp_path):
    torch.backends.cuda.enable_cudnn_sdp(True)
    tiny().save_pretrained(tmp_path)
    load_policy(str(tmp_path), "cpu")
    assert torch.backends.cuda.cudnn_sdp_enabled()


def tiny():
    config = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def attention_ops(tmp_path, loss_of) -> set[str]:
    """The attention operators of `loss_of(model)` and its backward, for the tiny model loaded for CUDA with
    cuDNN's attention allowed beforehand (loading turns it off), under bf16 autocast."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    tiny().save_pretrained(tmp_path)
    model = load_policy(str(tmp_path), "cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.autocast("cuda", torch.bfloat16):
            loss = loss_of(model)
        loss.backward()
    return {event.key for event in prof.key_averages() if "attention" in event.key}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_padded_batch_on_cuda_takes_the_memory_efficient_kernel(cudnn_flag, tmp_path):
    ids = torch.randint(0, 256, (4, 96), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :17] = 0  # left padding, as prompts are
    mask[2, 80:] = 0  # right padding, as responses are
    attention = attention_ops(tmp_path, lambda model: model(input_ids=ids, attention_mask=mask).logits.float()
                              .square().mean())
    assert "aten::_scaled_dot_product_efficient_attention" in attention, attention
    assert "aten::_efficient_attention_backward" in attention, attention
    assert not any("cudnn" in op or "math" in op for op in attention), attention


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_trainers_forward_on_cuda_takes_the_flash_kernel(cudnn_flag, tmp_path):
    from test_compile import tiny_batch

    from caspo.models.forward import response_hidden

    batch = tiny_batch().to("cuda")  # prompts of 5, 3 and 7 tokens: left padding in the batch's layout
    attention = attention_ops(tmp_path, lambda model: response_hidden(model, batch).float().square().mean())
    assert "aten::_scaled_dot_product_flash_attention" in attention, attention
    assert any("flash_attention_backward" in op for op in attention), attention
    assert not any("efficient" in op or "cudnn" in op or "math" in op for op in attention), attention


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_engines_prefill_of_whole_prompts_takes_the_flash_kernel(cudnn_flag, tmp_path):
    """Prompts from position 0 take flash; the second piece of a prompt longer than a prefill forward takes the
    memory-efficient kernel under its mask. Never cuDNN's, never the math fallback."""
    from caspo.rollout.native import NativeEngine

    torch.backends.cuda.enable_cudnn_sdp(True)
    tiny().save_pretrained(tmp_path)
    model = load_policy(str(tmp_path), "cuda").to(torch.bfloat16)
    engine = NativeEngine(model, max_seq_len=128, capacity_tokens=4 * 128, max_prefill_tokens=64)
    reqs = [Request(list(range(3, 3 + n)), seed=n, max_new_tokens=1) for n in (40, 90)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.generate(reqs, SamplingParams(temperature=1.0))
    attention = {event.key for event in prof.key_averages() if "attention" in event.key}
    assert "aten::_scaled_dot_product_flash_attention" in attention, attention
    assert "aten::_scaled_dot_product_efficient_attention" in attention, attention
    assert not any("cudnn" in op or "math" in op for op in attention), attention
