"""The looped recipe's four algorithms on the shipped tiny looped policy, end to end on the CPU."""

import json

import pytest
import torch

from caspo.config import load_config
from caspo.train import loop
from caspo.train.sft import run_sft
from caspo.train.verify_resume import verify_resume

pytestmark = pytest.mark.timeout(300)

LOOPED = ["optim.name=sgd", "optim.lr=1e-3", "train.activation_checkpointing=true"]


@pytest.fixture(scope="module")
def looped_policy(tmp_path_factory):
    """A tiny Ouro-layout policy (2 physical layers × 2 loops) after a few SFT steps."""
    out = tmp_path_factory.mktemp("looped") / "policy"
    cfg = load_config("tests", ["sft.architecture=looped-ouro", "sft.layers=2", "sft.depth=2", "sft.hidden=64",
                                "sft.intermediate=128", "sft.steps=3"])
    run_sft(cfg, out)
    return out


# two of the recipe's four algorithms in the default run; all four with -m slow
@pytest.mark.parametrize("method", ["grpo", pytest.param("ppo_critic", marks=pytest.mark.slow),
                                    pytest.param("dppo", marks=pytest.mark.slow), "flow-dppo"])
def test_recipe_algorithms_run_on_the_shipped_looped_policy(tmp_path, method):
    cfg = load_config("tests", ["model.policy=embedded:tiny-looped", "rollout.backend=native", f"method.name={method}",
                                "train.steps=3", "train.precision=fp32",
                                f"train.output_dir={tmp_path}", "eval.before=false", "eval.after=false", *LOOPED])
    loop.train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "t_step" in r] == [1, 2, 3]
    saved = {p.name for p in (tmp_path / "checkpoints" / "step_000003").iterdir() if p.is_dir()}
    assert saved == ({"policy"} if method == "grpo" else {"policy", "critic"})  # GRPO saves only the actor


@pytest.mark.slow  # about 40 s; the default run checks verify-resume on the tests preset (test_resume.py)
def test_verify_resume_on_a_looped_policy(tmp_path, looped_policy):
    assert verify_resume("tests", [f"model.policy={looped_policy}", "method.name=ppo_critic", *LOOPED], tmp_path)


def test_recipe_preset_sizes_the_cache_for_two_sequences():
    from transformers import AutoConfig

    from caspo.models.policy import resolve_model_path
    from caspo.rollout.factory import max_seq_len
    from caspo.rollout.native.kv_cache import KVCache
    from caspo.rollout.native.spec import decoder_spec

    cfg = load_config("looped-recipe")
    assert (cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p) == (0.8, 0, 1.0)
    assert (cfg.optim.name, cfg.optim.lr, cfg.train.seed, cfg.train.precision) == ("sgd", 1e-5, 42, "fp32")
    assert max_seq_len(cfg) == 128 + 48
    spec = decoder_spec(AutoConfig.from_pretrained(resolve_model_path("embedded:tiny-looped")))
    per_token = KVCache.bytes_per_token(layers=spec.num_layers, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                                        dtype=torch.float32, planes=spec.planes)
    assert per_token == 4 * 2 * 2 * 4 * 32 * 4  # depth planes × layers × (k, v) × kv heads × head_dim × fp32 bytes
    slots = KVCache.slots_for(max_seq_len=max_seq_len(cfg), bytes_per_token=per_token, device=torch.device("cpu"),
                              capacity_tokens=cfg.rollout.capacity_tokens, gpu_memory_fraction=None)
    assert slots == 2
