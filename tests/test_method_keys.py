"""Each method row declares the method.* settings it reads (caspo.methods: COMMON and `reads`): a training step
under a config that records its reads reads exactly those; an override of a setting the method does not read is
a one-line error; one the config file sets for another method is a start-up note."""

import dataclasses
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import caspo
from caspo.cli import app
from caspo.cli_args import checked_config
from caspo.cli_looped import ALGORITHMS, PRESET, recipe_overrides
from caspo.config import CaspoConfig, ConfigError, MethodConfig, load_config
from caspo.methods import COMMON, METHODS, check_unread_overrides, method_keys, resolve_method, unread_note
from caspo.train import loop
from caspo.value.refresh import conditions, due

PACKAGE = Path(caspo.__file__).parent
# reads that refuse or check a setting rather than use it: the config's checks, and resolve_method's
CHECKS = (str(PACKAGE / "config"), str(PACKAGE / "methods.py"))
# reads of a setting whatever the method, where it does nothing for the others: (setting, file, function)
GUARDS = {
    ("caspo.refresh_every", "train/loop.py", "train"),  # refuses a refresh without its pipeline
}
QUICK = ["train.steps=1", "eval.before=false", "eval.after=false", "train.save_every=0", "model.threads=1",
         "method.vineppo_k=2"]
# settings some code reads only when others ask for it: the online value step, the KL terms (kl_coef > 0)
EXTRA = {"caspo": ["method.caspo.online=true", "method.caspo.use_adb=true", "method.caspo.use_dlw=true"]}


def recording(cls, seen: set, prefix: str = ""):
    """A subclass of the settings dataclass `cls` that adds to `seen` each field caspo's code reads (through
    dataclasses' asdict, replace or the checks, a read is no use of the setting)."""
    # `caspo` is a section (its own recorder has its reads); `name` chooses the row, which every method reads
    fields = {f.name for f in dataclasses.fields(cls)} - {"caspo", "name"}

    def __getattribute__(self, name):
        if name in fields:
            code = sys._getframe(1).f_code
            where = code.co_filename
            if where.startswith(str(PACKAGE)) and not where.startswith(CHECKS):
                where = Path(where).relative_to(PACKAGE).as_posix()
                if (prefix + name, where, code.co_name) not in GUARDS:
                    seen.add(prefix + name)
        return object.__getattribute__(self, name)

    return type(f"Recording{cls.__name__}", (cls,), {"__getattribute__": __getattribute__})


def record_reads(cfg) -> set:
    seen: set = set()
    m = cfg.method
    caspo_settings = recording(CaspoConfig, seen, "caspo.")(**dataclasses.asdict(m.caspo))
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(MethodConfig)}
    cfg.method = recording(MethodConfig, seen)(**{**fields, "caspo": caspo_settings})
    return seen


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_training_step_reads_the_settings_its_row_declares(tmp_path, method, request):
    extra = list(EXTRA.get(method, []))
    if method == "caspo":
        extra.append(f"method.caspo.value_model={request.getfixturevalue('value_model_folder')}")
    cfg = load_config("tests", [f"method.name={method}", f"train.output_dir={tmp_path}", *QUICK, *extra])
    resolve_method(cfg)
    assert cfg.method.kl_coef > 0  # the tests preset's: the KL term reads its settings
    seen = record_reads(cfg)
    loop.train(cfg)
    if method == "caspo":  # a refresh's settings, as it reads them (a refresh itself is slow)
        conditions(cfg, 1.0, 0, {})
        due(cfg, 1)
    declared = method_keys(METHODS[method])
    assert seen - declared == set(), f"{method} reads settings its row does not declare"
    assert declared - seen == set(), f"{method}'s row declares settings it does not read"


def test_declared_settings_are_settings():
    names = {f.name for f in dataclasses.fields(MethodConfig)} - {"caspo", "name"}
    names |= {f"caspo.{f.name}" for f in dataclasses.fields(CaspoConfig)}
    assert COMMON <= names
    for row in METHODS.values():
        assert row.reads <= names, row.name
        assert not row.reads & COMMON, row.name  # once, in COMMON


# ---------------------------------------------------------------- overrides: refused


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def error_line(result, command: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == "(caspo --debug ... shows the traceback)"
    assert lines[-2].startswith(f"{command} error: ")
    return lines[-2].removeprefix(f"{command} error: ")


@pytest.mark.parametrize("override, message", [
    ("method.critic_lr=1e-5", "method.critic_lr is read by ppo_critic, dppo, flow_dppo; method.name=grpo does not "
                              "read it: drop it or choose one of those methods"),
    ("method.gate_threshold=0.1", "method.gate_threshold is read by flow_dppo; method.name=grpo does not read it: "
                                  "drop it or choose that method"),
    ("method.caspo={online: true}", "method.caspo.online is read by caspo; method.name=grpo does not read it: drop "
                                    "it or choose that method"),
])
def test_an_override_the_method_does_not_read_is_one_line_naming_its_readers(tmp_path, monkeypatch, override,
                                                                            message):
    monkeypatch.setattr("caspo.value.refresh.train", lambda cfg, **kw: pytest.fail("the run started"))
    assert error_line(invoke("config", "tests", override), "config") == message
    assert error_line(invoke("train", "tests", f"train.output_dir={tmp_path}", override), "train") == message
    assert error_line(invoke("verify-resume", "tests", override, "--workdir", tmp_path), "verify-resume") == message


def test_an_override_the_method_reads_is_taken():
    for method, override in [("ppo_critic", "method.critic_lr=1e-5"), ("flow_dppo", "method.gate_threshold=0.1"),
                             ("grpo", "method.kl_estimator=k1"), ("vineppo", "method.vineppo_k=3")]:
        result = invoke("config", "tests", f"method.name={method}", override, "train.minibatch_size=4")
        assert result.exit_code == 0, result.output


def test_the_check_is_the_training_commands_and_follows_the_final_method():
    with pytest.raises(ConfigError, match="method.name=ppo does not read it"):
        checked_config("tests", ["method.name=ppo_critic", "method.lam=0.9", "method.name=ppo"],
                       method_overrides=True)
    # the value commands read some settings outside any method: not refused there
    assert checked_config("tests", ["method.lam=0.9"]).method.lam == 0.9


def test_a_suite_refuses_a_shared_override_one_of_its_methods_does_not_read(tmp_path):
    out = tmp_path / "suite"
    result = invoke("suite", "tests", "--methods", "grpo,ppo_critic", "--out", out, "method.critic_lr=1e-5")
    assert error_line(result, "suite").startswith("suite run grpo seed 0: method.critic_lr is read by ppo_critic")
    assert not out.exists()  # refused before the suite is recorded


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_the_looped_recipes_own_overrides_are_read_by_its_methods(algorithm):
    flags = recipe_overrides(algorithm, 4, None, "fp32", False, False, 0, model="embedded:tiny-looped")
    cfg = load_config(PRESET, flags)
    resolve_method(cfg)
    check_unread_overrides(cfg, flags)


def test_the_looped_command_refuses_a_pass_through_override_its_algorithm_does_not_read(tmp_path):
    result = invoke("looped", "--algorithm", "grpo", "--model", "embedded:tiny-looped", "--output-dir", tmp_path,
                    "method.value_clip=0.5")
    assert error_line(result, "looped") == ("method.value_clip is read by ppo_critic, dppo, flow_dppo; "
                                            "method.name=grpo does not read it: drop it or choose one of those "
                                            "methods")


# ---------------------------------------------------------------- the config file's: a note


def config_file(tmp_path, *method_lines: str) -> Path:
    text = Path(caspo.__file__).parent.joinpath("presets", "tests.yaml").read_text()
    text = text.replace("method:\n  name: grpo\n", "method:\n  name: grpo\n" + "".join(
        f"  {line}\n" for line in method_lines))
    path = tmp_path / "run.yaml"
    path.write_text(text.replace("output_dir: runs/tests", f"output_dir: {tmp_path / 'run'}"))
    return path


def test_the_config_files_settings_for_other_methods_are_one_note_at_start(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr("caspo.value.refresh.train", lambda cfg, **kw: started.append(cfg) or {})
    path = config_file(tmp_path, "critic_lr: 1.0e-5", "vineppo_k: 4", "lam: 1.0", "clip_low: 0.3",
                       "caspo:", "  online_value_lr: 1.0e-5")
    result = invoke("train", path)
    assert result.exit_code == 0, result.output
    note = ("note: grpo does not read method.critic_lr, method.vineppo_k, method.caspo.online_value_lr (set in the "
            "config for other methods)")  # lam is its default; grpo reads clip_low
    assert [line for line in result.stderr.splitlines() if line.startswith("note:")] == [note]
    assert started and unread_note(started[0]) == note
    # a setting the file sets that the method reads, or one at its default, is no note
    assert unread_note(load_config(config_file(tmp_path, "clip_low: 0.3", "lam: 1.0"))) is None


@pytest.mark.parametrize("preset", sorted(p.stem for p in (PACKAGE / "presets").glob("*.yaml")))
def test_every_preset_starts_with_each_method_it_is_checked_with(preset):
    """A preset carries every method's settings: switching methods never refuses them (only a note)."""
    started = 0
    for method in METHODS:
        try:
            cfg = load_config(preset, [f"method.name={method}"])
            resolve_method(cfg)
        except ConfigError:  # the preset's shapes do not fit this method (halves, a value model, G >= 2)
            continue
        check_unread_overrides(cfg, [f"method.name={method}"])
        note = unread_note(cfg)
        assert note is None or "\n" not in note
        started += 1
    assert started >= 1
