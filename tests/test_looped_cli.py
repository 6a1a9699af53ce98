"""`caspo looped`: the recurrent-policy recipe's flags as overrides of the looped-recipe preset, a run through
the command, and the recipe's interrupted run (2 updates, a fresh process resumes) against 3 uninterrupted ones."""

import json

import pytest
from typer.testing import CliRunner

from caspo.cli import app
from caspo.cli_looped import recipe_overrides
from caspo.config import ConfigError, load_config
from caspo.methods import resolve_method

ROWS = [{"prompt": f"Calculate {a}-{b}. Reply with only \\boxed{{answer}}.\n###Response\n", "label": str(a - b)}
        for a in range(5, 13) for b in range(1, 4)]
CPU = ["model.revision=null", "model.device=cpu", "model.threads=1", "data.heldout_fraction=0.25", "reward.workers=1"]


def overrides(algorithm, prompts=4, samples=4, **kw):
    return dict(x.split("=", 1) for x in recipe_overrides(algorithm, prompts, samples, kw.get("precision", "fp32"),
                                                          kw.get("recompute", False), kw.get("graphs", False), 0))


def test_each_algorithm_is_its_method_row_with_one_update_per_rollout_and_flow_dppo_two_on_halves():
    assert {a: overrides(a)["method.name"] for a in ("ppo", "grpo", "dppo", "flow-dppo")} == \
        {"ppo": "ppo_critic", "grpo": "grpo", "dppo": "dppo", "flow-dppo": "flow_dppo"}
    assert overrides("ppo", 4, 4)["train.minibatch_size"] == "16"
    # completions per prompt unless given: 4 for grpo, 1 for the others (the recipe's group size)
    assert {a: overrides(a, 4, None)["rollout.samples_per_prompt"] for a in ("ppo", "grpo", "dppo", "flow-dppo")} == \
        {"ppo": "1", "grpo": "4", "dppo": "1", "flow-dppo": "1"}
    assert overrides("flow-dppo", 4, None)["train.minibatch_size"] == "2"
    recipe = load_config("looped-recipe")
    assert (recipe.rollout.samples_per_prompt, recipe.train.minibatch_size, recipe.train.deterministic) == (1, 4, True)
    assert overrides("flow-dppo", 4, 4)["train.minibatch_size"] == "8"
    o = overrides("dppo", 3, 2, precision="fp16", recompute=True, graphs=True)
    assert (o["rollout.prompts_per_step"], o["rollout.samples_per_prompt"], o["train.precision"]) == ("3", "2", "fp16")
    assert (o["train.activation_checkpointing"], o["rollout.cuda_graphs"]) == ("true", "true")
    # π_old: the engine's scores for ppo and grpo (the recipe's rollout log-probs), recomputed for dppo's proximal
    # policy and unread by flow-dppo's gate
    assert {a: overrides(a).get("train.old_logprobs") for a in ("ppo", "grpo", "dppo", "flow-dppo")} == \
        {"ppo": "behaviour", "grpo": "behaviour", "dppo": None, "flow-dppo": None}
    for algorithm in ("ppo", "grpo", "dppo", "flow-dppo"):  # the method table's own checks accept what flags make
        for samples in (4, None):
            cfg = load_config("looped-recipe", [f"{k}={v}" for k, v in overrides(algorithm, 4, samples).items()])
            method = resolve_method(cfg)
            steps_per_rollout = 2 if algorithm == "flow-dppo" else 1
            assert method.name == {"ppo": "ppo_critic", "flow-dppo": "flow_dppo"}.get(algorithm, algorithm)
            assert (method.schedule == "halves") == (algorithm == "flow-dppo")
            assert cfg.train.epochs_per_rollout == 1
            assert cfg.train.minibatch_size * steps_per_rollout == cfg.responses_per_step


@pytest.mark.parametrize("args, message", [
    (("grpo", 4, 1), "n-samples-per-prompt must be at least 2"),
    (("flow-dppo", 3, 3), "make --rollout-batch-size × --n-samples-per-prompt even"),
    (("reinforce", 4, 4), "use one of ppo, grpo, dppo, flow-dppo"),
])
def test_flags_the_recipe_cannot_honour_are_errors(args, message):
    with pytest.raises(ConfigError, match=message):
        recipe_overrides(*args, "fp32", False, False, 0)


def looped(tmp_path, out, *args):
    data = tmp_path / "math.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return CliRunner().invoke(app, ["looped", "--model", "embedded:tiny-looped", "--data", str(data), "--output-dir",
                                    str(out), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", *CPU,
                                    *args])


def test_a_run_through_the_command_is_the_preset_with_the_flags(tmp_path):
    result = looped(tmp_path, tmp_path / "run", "--algorithm", "grpo", "train.steps=1")
    assert result.exit_code == 0, result.output
    cfg = load_config(str(tmp_path / "run" / "config.yaml"))
    assert (cfg.method.name, cfg.rollout.prompts_per_step, cfg.train.minibatch_size) == ("grpo", 2, 4)
    assert (cfg.optim.name, cfg.train.seed, cfg.rollout.max_new_tokens) == ("sgd", 42, 48)  # the preset's
    assert "| policy update (and a critic trained with it) |" in (tmp_path / "run" / "timing.md").read_text()
    assert looped(tmp_path, tmp_path / "bad", "--algorithm", "grpo", "--n-samples-per-prompt", "1").exit_code == 2


@pytest.mark.slow
def test_stop_after_two_then_resume_matches_three_uninterrupted_updates(tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    common = ["--algorithm", "ppo", "train.steps=3", "train.deterministic=true", "train.save_every=1"]
    for out, extra in ((whole, []), (cut, ["--stop-after", "2"]), (cut, ["--resume", "latest"])):
        result = looped(tmp_path, out, *common, *extra)
        assert result.exit_code == 0, result.output
    def rows(run, name):
        return [json.loads(x) for x in (run / name).read_text().splitlines()]
    assert rows(whole, "samples.jsonl") == rows(cut, "samples.jsonl")
    measured = ("t_", "mem_")
    strip = [{k: v for k, v in r.items() if not k.startswith(measured)} for r in rows(whole, "metrics.jsonl")]
    assert strip == [{k: v for k, v in r.items() if not k.startswith(measured)} for r in rows(cut, "metrics.jsonl")]
    from safetensors.torch import load_file
    for part in ("policy", "critic"):
        a = load_file(whole / "checkpoints" / "step_000003" / part / "model.safetensors")
        b = load_file(cut / "checkpoints" / "step_000003" / part / "model.safetensors")
        assert all((a[k] == b[k]).all() for k in a)
    timing = json.loads((cut / "timing.json").read_text())
    assert [s["step"] for s in timing["starts"]] == [0, 2] and timing["steps"] == 3


@pytest.mark.parametrize("override, flag", [
    ("method.name=ppo", "--algorithm"), ("rollout.prompts_per_step=2", "--rollout-batch-size"),
    (" train.precision=bf16", "--precision"), ("model.policy=embedded:tiny-arith", "--model"),
    ("train.output_dir=elsewhere", "--output-dir"),
])
def test_a_pass_through_override_of_a_flag_s_setting_is_refused(tmp_path, monkeypatch, override, flag):
    monkeypatch.setattr("caspo.value.refresh.train", lambda cfg, **kw: pytest.fail("the run started"))
    result = looped(tmp_path, tmp_path / "run", override)
    key = override.split("=")[0].strip()
    assert result.exit_code == 2, result.output
    expected = f"looped error: {override.strip()}: caspo looped sets {key} from {flag}; use {flag}, not {key}"
    assert expected in result.output


def test_a_pass_through_override_of_what_no_flag_set_is_taken(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr("caspo.value.refresh.train", lambda cfg, **kw: seen.update(policy=cfg.model.policy,
                                                                                   lr=cfg.optim.lr) or {})
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    # without --model, model.policy is the pass-through's; dppo sets no train.old_logprobs
    result = CliRunner().invoke(app, ["looped", "--algorithm", "dppo", "--data", str(data), "--output-dir",
                                      str(tmp_path / "run"), "model.policy=embedded:tiny-looped", "optim.lr=2e-6",
                                      *CPU])
    assert result.exit_code == 0, result.output
    assert seen == {"policy": "embedded:tiny-looped", "lr": 2e-6}
