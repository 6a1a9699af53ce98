"""`caspo sft`: the supervised run that builds the embedded tiny policies, at a few steps on the CPU."""

import json
import math

import torch

from caspo.config import load_config
from caspo.models.policy import load_policy
from caspo.models.tokenizer import build_char_tokenizer, load_tokenizer
from caspo.train.sft import run_sft, sft_batch


def test_a_batch_learns_the_target_and_eos_only():
    tokenizer = build_char_tokenizer()
    ids, mask, labels = sft_batch(tokenizer, [("1+1=", "2"), ("12+3=", "15")], torch.device("cpu"))
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert len(enc("12+3=")) == 5 and len(enc("15")) == 2  # one token a character
    assert ids.tolist() == [enc("1+1=") + enc("2") + [eos] + [pad] * 2, enc("12+3=") + enc("15") + [eos]]
    assert mask.tolist() == [[1] * 6 + [0] * 2, [1] * 8]
    assert labels.tolist() == [[-100] * 4 + enc("2") + [eos] + [-100] * 2, [-100] * 5 + enc("15") + [eos]]


def test_sft_learns_the_format_decays_the_rate_to_zero_and_saves_a_policy_that_loads(tmp_path):
    steps, warmup = 100, 5
    cfg = load_config("tests", ["sft.layers=1", "sft.hidden=32", "sft.heads=2", "sft.intermediate=64",
                                f"sft.steps={steps}", f"sft.warmup_steps={warmup}", "sft.batch_size=16",
                                "sft.lr=1e-2", f"sft.eval_every={steps}", "eval.heldout_size=8"])
    final = run_sft(cfg, tmp_path / "policy")

    log = [json.loads(line) for line in (tmp_path / "policy" / "sft_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, steps + 1))
    losses = [r["loss"] for r in log]
    # from about ln(vocab) a token at random init to about 1 (4.64 to 0.99 here)
    assert losses[0] > 4.0 and sum(losses[-5:]) / 5 < 0.3 * losses[0]
    lrs = [r["lr"] for r in log]  # the rate each step used: linear warm-up, then a cosine towards zero
    assert math.isclose(lrs[0], 1e-2 / warmup) and math.isclose(lrs[warmup - 1], 1e-2)
    last = 0.5 * (1 + math.cos(math.pi * (steps - 1 - warmup) / (steps - warmup)))  # one step short of zero
    assert math.isclose(lrs[-1], 1e-2 * last) and 0 < lrs[-1] < 1e-5
    assert all(a >= b for a, b in zip(lrs[warmup - 1:], lrs[warmup:]))
    # the held-out evaluation at the last step: the format is learnt (every answer boxed here) before the arithmetic
    assert final == log[-1] and final["eval_n"] == 8 and final["eval_boxed_rate"] > 0.5

    policy = load_policy(str(tmp_path / "policy"))
    tokenizer = load_tokenizer(tmp_path / "policy")
    assert policy.config.num_hidden_layers == 1 and policy.config.hidden_size == 32
    assert len(tokenizer) == policy.config.vocab_size and tokenizer.eos_token_id == policy.config.eos_token_id


def test_sft_continues_from_an_embedded_policy(tmp_path):
    """--init embedded:NAME loads the shipped policy and its tokenizer (the tokenizer by the resolved folder)."""
    cfg = load_config("tests", ["sft.steps=1", "sft.batch_size=2", "sft.eval_every=1", "eval.heldout_size=2"])
    run_sft(cfg, tmp_path / "more", init="embedded:tiny-arith")
    assert load_tokenizer(tmp_path / "more").get_vocab() == build_char_tokenizer().get_vocab()


def test_a_second_run_into_the_same_folder_needs_overwrite(tmp_path):
    """Its log would hold both runs' steps; --overwrite replaces the run, log included."""
    import pytest

    from caspo.config import ConfigError

    cfg = load_config("tests", ["sft.steps=2", "sft.batch_size=2", "sft.eval_every=0"])
    run_sft(cfg, tmp_path / "p")
    with pytest.raises(ConfigError, match="holds an SFT run already .*--overwrite"):
        run_sft(cfg, tmp_path / "p")
    run_sft(cfg, tmp_path / "p", overwrite=True)
    log = [json.loads(line) for line in (tmp_path / "p" / "sft_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2]


def test_sft_refuses_a_folder_that_holds_another_model_without_overwrite(tmp_path):
    """A run's checkpoint policy or any model folder (config.json, *.safetensors, manifest.json) that SFT did not
    write is refused, not overwritten; --overwrite replaces it."""
    import shutil

    import pytest

    from caspo.config import ConfigError
    from caspo.models.policy import ASSETS

    target = tmp_path / "checkpoints" / "step_000002" / "policy"
    shutil.copytree(ASSETS / "tiny-arith", target, ignore=shutil.ignore_patterns("sft*_log.jsonl"))  # a policy
    before = {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}
    cfg = load_config("tests", ["sft.steps=1", "sft.batch_size=2", "sft.eval_every=0"])
    with pytest.raises(ConfigError, match=r"--output .*policy holds a model already \(config\.json, "
                                          r"model\.safetensors\); pass --overwrite to replace it"):
        run_sft(cfg, target)
    assert {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()} == before
    run_sft(cfg, target, overwrite=True)
    assert (target / "sft_log.jsonl").is_file()
    assert (target / "model.safetensors").read_bytes() != before["model.safetensors"]


def test_sft_writes_into_an_empty_or_model_free_folder(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "README").write_text("notes")
    run_sft(load_config("tests", ["sft.steps=1", "sft.batch_size=2", "sft.eval_every=0"]), tmp_path / "p")
    assert (tmp_path / "p" / "model.safetensors").is_file()


def test_sft_divergence_is_a_one_line_user_error(tmp_path):
    """A NaN loss ends `caspo sft` with its message and exit status 2, no traceback."""
    from typer.testing import CliRunner

    from caspo.cli import app, user_errors

    result = CliRunner().invoke(app, ["sft", "tests", "--output", str(tmp_path / "o"), "sft.lr=1e30",
                                      "sft.warmup_steps=0", "sft.steps=5", "sft.batch_size=2", "sft.eval_every=0"])
    assert result.exit_code == 2, result.output
    assert "sft error: SFT loss is nan at step " in result.output and "; lower sft.lr (now 1e+30)" in result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, FloatingPointError)
    from caspo.train.sft import TrainingDiverged

    assert issubclass(TrainingDiverged, user_errors())
