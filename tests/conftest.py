import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on the CPU; triton reads this when a kernel is defined,
    # that is when caspo.rollout.native is first imported, so it must be set before any caspo import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from caspo.models.policy import attention_without_cudnn, tiny_qwen2_config  # noqa: E402

if torch.cuda.is_available():  # every GPU test runs attention as the trainer does, whatever loaded first
    attention_without_cudnn()


@pytest.fixture
def tiny_model():
    """A random tiny Qwen2 (vocab 100, pad 0, eos 1)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen2_config(100, hidden=64, layers=2, heads=4, kv_heads=2,
                                                              intermediate=128, eos_token_id=1, pad_token_id=0)).eval()


@pytest.fixture(scope="module")
def value_model_folder(tmp_path_factory):
    """A fresh prefix value model for the tests preset (φ = reference, so every V starts at 0)."""
    from caspo.config import load_config
    from caspo.models.policy import load_policy, resolve_model_path
    from caspo.models.prefix_value import PrefixValueModel
    from caspo.models.provenance import label_provenance, model_identity
    from caspo.models.tokenizer import load_tokenizer

    cfg = load_config("tests")
    base = load_policy(cfg.model.policy)
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.policy))
    provenance = label_provenance(cfg, tokenizer, base).with_reference(model_identity(base))
    model = PrefixValueModel.from_reference(base, provenance=provenance, reference_source=cfg.model.policy)
    return model.save(tmp_path_factory.mktemp("value") / "v0", tokenizer=tokenizer)


@pytest.fixture(scope="session")
def real_models(tmp_path_factory):
    """Tiny random Qwen2 and Llama folders with Qwen2.5's BPE tokenizer (tests/bpe_fixtures.py), built once."""
    from bpe_fixtures import save_real_models

    return save_real_models(tmp_path_factory.mktemp("real_models"))
