"""The seed's runs, shrunk to the CPU: its presets with the BPE fixtures (tests/bpe_fixtures.py) as the policy,
on dsr_sub rows, with the seed's template and with the chat template."""

import json

import pytest

from caspo.config import load_config
from caspo.methods import resolve_method
from caspo.train import loop
from caspo.value.refresh import train as train_run

pytestmark = pytest.mark.timeout(300)

SHRUNK = ["model.device=cpu", "model.threads=1", "rollout.backend=hf", "rollout.cuda_graphs=false",
          "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
          "train.minibatch_size=4", "train.micro_batch_size=2", "train.steps=2", "reward.workers=1",
          "eval.before=false", "eval.heldout_size=2", "eval.max_new_tokens=12", "optim.lr=1e-4"]


def value_model_for(policy: str, cfg, folder):
    """A fresh prefix value model of `policy` under `cfg`'s conditions (φ = reference, so V starts at 0)."""
    from caspo.models.policy import load_policy
    from caspo.models.prefix_value import PrefixValueModel
    from caspo.models.provenance import label_provenance, model_identity
    from caspo.models.tokenizer import load_tokenizer

    base, tokenizer = load_policy(policy), load_tokenizer(policy)
    provenance = label_provenance(cfg, tokenizer, base).with_reference(model_identity(base))
    model = PrefixValueModel.from_reference(base, provenance=provenance, reference_source=policy)
    return model.save(folder, tokenizer=tokenizer)


FAST = {("grpo", "seed"), ("caspo", "chat")}  # the other six run with -m slow (about 9 s each)


@pytest.mark.parametrize("method, template", [
    pytest.param(m, t, marks=() if (m, t) in FAST else pytest.mark.slow)
    for m in ("grpo", "ppo_critic", "vineppo", "caspo") for t in ("seed", "chat")])
def test_two_steps_of_each_method_on_dsr_sub_with_the_bpe_fixture(tmp_path, real_models, method, template):
    overrides = [f"model.policy={real_models.qwen}", f"train.output_dir={tmp_path / 'run'}", *SHRUNK,
                 f"method.name={method}", "eval.after=false", "eval.benchmarks=[]", "method.vineppo_k=2",
                 "method.max_steps=4"]
    if template == "chat":
        overrides.append("data.template=chat")
    if method == "caspo":
        cfg = load_config("qwen-math-dsr", [*overrides, "method.caspo.value_model=pending"])
        overrides.append(f"method.caspo.value_model={value_model_for(str(real_models.qwen), cfg, tmp_path / 'v')}")
    cfg = load_config("qwen-math-dsr", overrides)
    resolve_method(cfg)
    summary = loop.train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert {s["prompt_id"].split("-")[0] for s in samples} == {"dsr_sub"}
    assert all(s["length"] > 0 for s in samples)
    if method in ("vineppo", "caspo"):
        assert all(1 <= r["steps_mean"] <= 4 for r in rows if "steps_mean" in r)
    assert summary["run_dir"] == str(tmp_path / "run")


def test_the_seed_preset_runs_two_steps_and_evaluates_its_benchmarks(tmp_path, real_models):
    cfg = load_config("qwen-math-dsr", [f"model.policy={real_models.qwen}", f"train.output_dir={tmp_path}",
                                        *SHRUNK, "train.save_every=2", "eval.limit=2"])
    train_run(cfg)
    result = json.loads((tmp_path / "eval" / "step_000002.json").read_text())
    assert set(result["benchmarks"]) == {"math500", "gsm8k", "olympiadbench"}
    assert all(b["n"] == 2 for b in result["benchmarks"].values())
    assert (tmp_path / "eval" / "base.json").exists() is False  # eval.before=false in the shrunk run
