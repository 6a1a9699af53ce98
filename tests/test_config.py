import pytest

from caspo.config import ConfigError, load_config
from caspo.methods import resolve_method


def checked_config(preset, overrides=()):
    """load_config, then the checks of the method's row (as the CLI and the trainer run them)."""
    cfg = load_config(preset, overrides)
    resolve_method(cfg)
    return cfg


def test_preset_and_overrides():
    cfg = load_config("tests", ["train.steps=7", "optim.lr=1e-4", 'rollout.stop=["\\n\\n"]'])
    assert cfg.train.steps == 7
    assert cfg.optim.lr == pytest.approx(1e-4)
    assert cfg.rollout.stop == ["\n\n"]
    assert cfg.method.name == "grpo"


@pytest.mark.parametrize("override, message", [
    ("train.stepz=3", "unknown key train.stepz"),
    ("trian.steps=3", "unknown key trian"),
    ("train.steps=three", "train.steps: expected int"),
    ("train.steps=2.5", "train.steps: expected int"),
    ("reward.shuffle_within_batch=1", "reward.shuffle_within_batch: expected bool"),
    ("optim.schedule=step", "optim.schedule: expected one of"),
    ("rollout.stop=5", "rollout.stop: expected a list"),
    ("method.name=reinforce", "method.name: unknown method"),
    ("train.steps", "key.path=value"),
    ("eval.samples=-1", "eval.samples must be >= 0"),
    ("sft.slip_prob=1.5", "sft.slip_prob must be in"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        checked_config("tests", [override])


def test_minibatches_must_be_whole():
    # tests preset: 4 prompts × 2 samples = 8 responses
    with pytest.raises(ConfigError, match="does not divide the 8 responses"):
        checked_config("tests", ["train.minibatch_size=3"])
    with pytest.raises(ConfigError, match="micro_batch_size=3 does not divide"):
        checked_config("tests", ["train.minibatch_size=4", "train.micro_batch_size=3"])


def test_grpo_needs_groups_of_two():
    with pytest.raises(ConfigError, match="samples_per_prompt must be >= 2"):
        checked_config("tests", ["rollout.samples_per_prompt=1", "train.minibatch_size=4"])


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="arith-tiny"):
        checked_config("no-such-preset")


def test_yaml_file_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: 3\n  bogus: 1\n")
    with pytest.raises(ConfigError, match="unknown key train.bogus"):
        checked_config(path)
