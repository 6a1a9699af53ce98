"""The looped recipe's four algorithms on the shipped tiny looped policy, end to end on the CPU."""

import json

import pytest

from caspo.config import load_config
from caspo.train import loop
from caspo.train.sft import run_sft
from caspo.train.verify_resume import verify_resume

pytestmark = pytest.mark.timeout(300)

LOOPED = ["optim.name=sgd", "optim.lr=1e-3", "train.recompute=true"]


@pytest.fixture(scope="module")
def looped_policy(tmp_path_factory):
    """A tiny Ouro-layout policy (2 physical layers × 2 loops) after a few SFT steps."""
    out = tmp_path_factory.mktemp("looped") / "policy"
    cfg = load_config("tests", ["sft.architecture=looped-ouro", "sft.layers=2", "sft.depth=2", "sft.hidden=64",
                                "sft.intermediate=128", "sft.steps=3"])
    run_sft(cfg, out)
    return out


@pytest.mark.parametrize("method", ["grpo", "ppo_critic", "dppo", "flow-dppo"])
def test_recipe_algorithms_run_on_the_shipped_looped_policy(tmp_path, method):
    cfg = load_config("tests", ["model.policy=embedded:tiny-looped", "rollout.backend=native", f"method.name={method}",
                                "train.steps=3", "train.precision=fp32",
                                f"train.output_dir={tmp_path}", "eval.before=false", "eval.after=false", *LOOPED])
    loop.train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "t_step" in r] == [1, 2, 3]
    saved = {p.name for p in (tmp_path / "checkpoints" / "step_000003").iterdir() if p.is_dir()}
    assert saved == ({"policy"} if method == "grpo" else {"policy", "critic"})  # GRPO saves only the actor


def test_verify_resume_on_a_looped_policy(tmp_path, looped_policy):
    assert verify_resume("tests", [f"model.policy={looped_policy}", "method.name=ppo_critic", *LOOPED], tmp_path)
