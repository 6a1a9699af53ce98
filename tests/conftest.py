import pytest
import torch
from transformers import AutoModelForCausalLM

from caspo.models.policy import tiny_qwen2_config


@pytest.fixture
def tiny_model():
    """A random tiny Qwen2 (vocab 100, pad 0, eos 1)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen2_config(100, hidden=64, layers=2, heads=4, kv_heads=2,
                                                              intermediate=128, eos_token_id=1, pad_token_id=0)).eval()
