import typing
from types import SimpleNamespace

import pytest
import torch

from caspo.config import PRESET_DIR, ConfigError, LossAgg, load_config, resolve_preset, to_yaml
from caspo.config.load import literal_from_yaml_bool
from caspo.methods import resolve_method
from caspo.models.policy import resolve_device


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
    ("method.loss_agg=mean", r"method.loss_agg: expected one of \['token-mean', 'token-sum'"),
    # the old spellings of renamed keys
    ("data.arith.heldout_size=10", "unknown key data.arith.heldout_size; valid keys here: .*heldout_pool_size"),
    ("eval.batch_size=10", "unknown key eval.batch_size; valid keys here: after, before, benchmarks, every, heldout_"),
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


def test_the_preset_resolves_to_its_file_and_prints_the_renamed_keys():
    """`tests` names presets/tests.yaml, and its printed config holds the keys under their current names
    (data.arith.heldout_pool_size, sft.eval_batch_size), with no eval.batch_size."""
    assert resolve_preset("tests") == PRESET_DIR / "tests.yaml"
    printed = to_yaml(load_config("tests"))
    assert "heldout_pool_size: 200" in printed and "eval_batch_size: 16" in printed
    assert "batch_size: 16" not in printed.split("eval:")[1].split("sft:")[0]


def test_arith_pool_and_evaluated_problems_are_separate_keys():
    from caspo.data.build import arith_task

    cfg = load_config("tests", ["data.arith.heldout_pool_size=50", "eval.heldout_size=7"])
    assert cfg.data.arith.heldout_pool_size == 50 and cfg.eval.heldout_size == 7
    assert arith_task(cfg).size("heldout") == 50
    assert load_config(None).data.arith.heldout_pool_size == 1000


def test_sft_eval_batch_size_reaches_the_engine(monkeypatch):
    from caspo.train import sft

    seen = {}

    class Engine:
        def __init__(self, model, pad_token_id, max_batch):
            seen["max_batch"] = max_batch

    class Result:
        def summary(self):
            return {}

    class Tokenizer:
        pad_token_id = eos_token_id = 0

        def encode(self, text, add_special_tokens):
            return [1]

    monkeypatch.setattr(sft, "HFEngine", Engine)
    monkeypatch.setattr(sft, "greedy_accuracy", lambda *a, **k: Result())
    cfg = load_config("tests", ["sft.eval_batch_size=3"])
    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace(eos_token_id=0)  # what the stop ids are read from
    sft.evaluate(model, Tokenizer(), sft.arith_task(cfg), cfg, None, "cpu")
    assert seen["max_batch"] == 3
    assert load_config(None).sft.eval_batch_size == 250


def test_loss_agg_choices_are_the_aggregation_modes():
    from caspo.algo.stats import AGG_MODES

    assert typing.get_args(LossAgg) == AGG_MODES


@pytest.mark.parametrize("override", ["method.terminal_scope=off", "method.terminal_scope=Off",
                                      "method.terminal_scope='off'", 'method.terminal_scope="off"'])
def test_yaml_boolean_spelling_a_literal_choice(override):
    # YAML 1.1 reads unquoted off as False; "off" is one of terminal_scope's choices
    assert load_config("tests", [override]).method.terminal_scope == "off"


def test_yaml_boolean_spelling_in_a_preset_file(tmp_path):
    path = tmp_path / "scope.yaml"
    path.write_text("method:\n  terminal_scope: off\n")
    assert load_config(path).method.terminal_scope == "off"


@pytest.mark.parametrize("override, message", [
    ("method.terminal_scope=on", r"method.terminal_scope: expected one of \['batch', 'group', 'off'\], got True"),
    ("method.adv_whiten=off",
     r"method.adv_whiten: expected one of \['auto', 'none', 'batch', 'minibatch'\], got False"),
    ("data.template=off", "data.template: expected str, got False"),  # only Literal choices read booleans
])
def test_yaml_booleans_matching_no_choice_are_still_rejected(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tests", [override])


def test_yaml_boolean_is_read_only_as_a_single_choice():
    assert literal_from_yaml_bool(False, ("batch", "off")) == "off"
    assert literal_from_yaml_bool(True, ("on", "off")) == "on"
    assert literal_from_yaml_bool(False, ("no", "off")) is False  # ambiguous: left to be rejected
    assert literal_from_yaml_bool(False, ("batch",)) is False
    assert load_config("tests", ["reward.shuffle_within_batch=off"]).reward.shuffle_within_batch is False


def test_config_is_the_bottom_layer():
    import subprocess
    import sys

    code = "import sys, caspo.config; print(sorted(m for m in sys.modules if m.startswith('caspo')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == str(["caspo", "caspo.config", "caspo.config.load", "caspo.config.schema",
                                  "caspo.config.train_schema", "caspo.config.validate"])


@pytest.mark.parametrize("override, message", [
    ("optim.lr=-1", r"optim.lr must be > 0, got -1.0"),
    ("rollout.temperature=.nan", "rollout.temperature must be a finite number, got nan"),
    ("optim.eps=.inf", "optim.eps must be a finite number, got inf"),
    ("reward.workers=-3", r"reward.workers must be >= 0 \(0 = score in the trainer's process\), got -3"),
    ("reward.timeout_s=0", "reward.timeout_s must be > 0, got 0.0"),
    ("model.device=tpu", "model.device='tpu': use cpu, cuda, cuda:N"),
    ("rollout.top_p=0", r"rollout.top_p must be in \(0, 1\], got 0.0"),
    ("rollout.gpu_memory_fraction=1", r"rollout.gpu_memory_fraction must be in \(0, 1\), got 1.0"),
    ("method.gamma=1.5", r"method.gamma must be in \[0, 1\], got 1.5"),
    ("method.iw_low=0", r"method.iw_low must be in \(0, 1\], got 0.0"),
    ("method.dual_clip=1", r"method.dual_clip must be > 1 \(or null\), got 1.0"),
    ("optim.betas=[0.9, 1.0]", r"optim.betas\[1\] must be in \[0, 1\), got 1.0"),
    ("optim.betas=[0.9]", r"optim.betas must be two numbers"),
    ("train.seed=-1", r"train.seed must be in \[0, 4294967295\]"),
    ("data.arith.mul_factors=[2, 1]", r"data.arith.mul_factors\[1\] must be >= 2"),
    ("data.arith.max_ops=1", "data.arith.max_ops=1 must be >= data.arith.min_ops=2"),
    ("sft.heads=3", "sft.hidden=128 must be a multiple of sft.heads=3"),
    ("eval.top_p=1.5", r"eval.top_p must be in \(0, 1\], got 1.5"),
    ("data.heldout_fraction=-0.1", r"data.heldout_fraction must be in \(0, 1\), or 0 \(off\), got -0.1"),
    ("rollout.admit_batch=-1", r"rollout.admit_batch must be >= 0 \(0 = an eighth of the running slots, at most 64\)"),
    ("method.vineppo_context_tokens=-1", r"method.vineppo_context_tokens must be >= 0"),
])
def test_out_of_range_values_name_the_key_and_the_range(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tests", [override])


def sampled_eval_temperature(cfg):
    """The temperature of the held-out avg@k samples, under a run that samples at rollout.temperature."""
    from caspo.eval.suite import eval_samplers
    from caspo.rollout.base import SamplingParams

    return eval_samplers(cfg, SamplingParams(temperature=cfg.rollout.temperature))[1].temperature


def multiplies(cfg):
    """Whether any held-out problem of the run's arithmetic task multiplies."""
    from caspo.data.build import arith_task

    return any(step.op == "*" for problem in arith_task(cfg).heldout for step in problem.steps)


def keeps_the_whole_vocabulary(cfg):
    from caspo.rollout.sampling import truncate_logits

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    return bool(torch.isfinite(truncate_logits(logits, cfg.rollout.top_k, cfg.rollout.top_p)).all())


def refresh_state_temperature(cfg):
    from caspo.value.refresh import collect_spec

    return collect_spec(cfg).state_temperature


def edge(*overrides, means):
    return pytest.param(list(overrides), means, id=" ".join(overrides))


@pytest.mark.parametrize("overrides, meaning", [
    edge("model.device=cuda:1", means=lambda cfg: torch.device(cfg.model.device) == torch.device("cuda", 1)),
    edge("model.device=auto", means=lambda cfg: resolve_device(cfg.model.device).type
         == ("cuda" if torch.cuda.is_available() else "cpu")),
    edge("method.dual_clip=3", "method.dual_clip=null", means=lambda cfg: cfg.method.dual_clip is None),  # no dual clip
    edge("eval.temperature=0.6",
         means=lambda cfg: cfg.rollout.temperature == 1.0 and sampled_eval_temperature(cfg) == 0.6),
    edge("eval.temperature=0.6", "eval.temperature=null",
         means=lambda cfg: sampled_eval_temperature(cfg) == cfg.rollout.temperature),  # null: the run's
    edge("data.arith.mul_factors=[]", means=lambda cfg: cfg.data.arith.mul_factors == [] and not multiplies(cfg)),
    edge("rollout.top_k=5", "rollout.top_k=0", means=keeps_the_whole_vocabulary),  # 0: top-k off
    edge("method.caspo.refresh_state_temperature=0",
         means=lambda cfg: refresh_state_temperature(cfg) is None),  # None: the run's temperature
])
def test_edge_values_that_mean_something_are_accepted(overrides, meaning):
    """Values at the edge of a range that stand for a setting (auto, off, the run's) load, and mean it."""
    assert meaning(load_config("tests", overrides))


def test_the_meanings_of_edge_values_are_not_what_other_values_mean():
    """The checks of the test above read otherwise on the tests preset as it is or with an ordinary value, so
    an edge value that loaded but meant nothing would fail them."""
    assert multiplies(load_config("tests"))
    assert not keeps_the_whole_vocabulary(load_config("tests", ["rollout.top_k=5"]))
    assert refresh_state_temperature(load_config("tests", ["method.caspo.refresh_state_temperature=2"])) == 2.0
    assert load_config("tests", ["method.dual_clip=3"]).method.dual_clip == 3.0


def test_vineppo_context_holds_a_rollout_and_sizes_the_engine_for_its_continuations():
    from caspo.rollout.factory import max_seq_len

    cfg = load_config("tests")
    rollout = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    with pytest.raises(ConfigError, match=f"vineppo_context_tokens={rollout - 1} is shorter than a rollout"):
        load_config("tests", [f"method.vineppo_context_tokens={rollout - 1}"])
    assert max_seq_len(cfg) == rollout  # (eval's budget is not longer in this preset)
    # a continuation from a whole response's prefix may add a response more, up to the context
    wide = load_config("tests", ["method.name=vineppo", f"method.vineppo_context_tokens={rollout + 5}"])
    assert max_seq_len(wide) == rollout + 5
    huge = load_config("tests", ["method.name=vineppo", f"method.vineppo_context_tokens={10 * rollout}"])
    assert max_seq_len(huge) == rollout + cfg.rollout.max_new_tokens
    # another method leaves the setting to vineppo: its engine holds a rollout
    assert max_seq_len(load_config("tests", [f"method.vineppo_context_tokens={10 * rollout}"])) == rollout


def schema_numbers(cls, prefix: str = "") -> set[str]:
    """The dotted keys of every int or float field of the schema (Optional and list items too)."""
    import dataclasses

    keys = set()
    for name, tp in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = args[0] if typing.get_origin(tp) in (list, typing.Union) or type(tp).__name__ == "UnionType" \
            else tp
        if dataclasses.is_dataclass(inner):
            keys |= schema_numbers(inner, f"{prefix}{name}.")
        elif inner in (int, float):
            keys.add(prefix + name)
    return keys


def test_every_numeric_field_has_a_range_rule():
    from caspo.config import Config
    from caspo.config.validate import RANGES, REFRESH_RANGES

    numbers = schema_numbers(Config)
    assert "optim.betas" in numbers and "method.dual_clip" in numbers and "data.arith.seed" in numbers
    ruled = set(RANGES) | set(REFRESH_RANGES)
    assert sorted(numbers - ruled) == []  # a new number needs its range in caspo/config/validate.py
    assert sorted(ruled - numbers) == []  # a rule for a key that is not in the schema


def test_refresh_sizes_are_ranged_only_when_refreshing():
    with pytest.raises(ConfigError, match=r"refresh_k must be >= 2 \(only prompts with mixed outcomes"):
        load_config("tests", ["method.caspo.refresh_every=2", "method.caspo.refresh_k=1"])
    assert load_config("tests", ["method.caspo.refresh_k=1"]).method.caspo.refresh_k == 1


def test_invalid_yaml_is_a_config_error_naming_where(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  steps: [1\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: not valid YAML \(expected .* at line 3, column 1\)"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"override 'train.steps=\[1': not valid YAML .*; quote a value"):
        load_config("tests", ["train.steps=[1"])


def test_admit_batch_is_the_native_engines_and_fits_its_slots():
    with pytest.raises(ConfigError, match="rollout.admit_batch=8 sets the native engine's admissions; it needs "
                                          "rollout.backend=native"):
        load_config("tests", ["rollout.backend=hf", "rollout.admit_batch=8"])
    with pytest.raises(ConfigError, match="rollout.admit_batch=8 exceeds rollout.max_batch=4"):
        load_config("tests", ["rollout.backend=native", "rollout.max_batch=4", "rollout.admit_batch=8"])
    assert load_config("tests", ["rollout.backend=native", "rollout.admit_batch=8"]).rollout.admit_batch == 8


def test_capacity_tokens_is_the_native_engines():
    with pytest.raises(ConfigError, match="rollout.capacity_tokens=4096 sizes the native engine's KV cache"):
        load_config("tests", ["rollout.backend=hf", "rollout.capacity_tokens=4096"])
    assert load_config("tests", ["rollout.backend=native", "rollout.capacity_tokens=4096"]).rollout.capacity_tokens \
        == 4096


def test_an_empty_stop_string_is_refused_by_its_index():
    assert load_config("tests", ["rollout.stop=['x', ' ']"]).rollout.stop == ["x", " "]
    with pytest.raises(ConfigError, match=r"^rollout.stop\[1\] is empty \(it would end every completion at once\); "
                                          "remove it$"):
        load_config("tests", ["rollout.stop=['x', '']"])


def test_a_preset_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"train:\n  steps: 2 # caf\xe9\n")
    with pytest.raises(ConfigError, match=f"^{path} is not UTF-8 text .*; re-save it as UTF-8$"):
        load_config(path)
    path.write_bytes("train:\n  steps: 2 # café\n".encode())  # the same text as UTF-8 loads
    assert load_config(path).train.steps == 2


def test_a_key_given_twice_is_refused_with_its_line(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  steps: 2\n  steps: 3\n")
    with pytest.raises(ConfigError, match=f"^{path} line 3: train.steps given twice \\(also at line 2\\); keep one$"):
        load_config(path)
    path.write_text("train:\n  steps: 2\nrollout:\n  temperature: 1.0\ntrain:\n  seed: 1\n")
    with pytest.raises(ConfigError, match="line 5: train given twice"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"override 'eval.benchmarks=\[\{a: 1, a: 2\}\]' line 1: \[0\].a given twice"):
        load_config("tests", ["eval.benchmarks=[{a: 1, a: 2}]"])
    path.write_text("train:\n  steps: 2\nrollout:\n  steps: 3\n")  # the same name in two sections is two keys
    with pytest.raises(ConfigError, match="unknown key rollout.steps"):
        load_config(path)


def test_a_section_with_nothing_under_it_says_so(tmp_path):
    path = tmp_path / "null.yaml"
    path.write_text("model:\ntrain:\n  steps: 2\n")
    with pytest.raises(ConfigError, match=r"^model: the section is empty \(`model:` with nothing under it\); indent "
                                          "its settings under it, or remove that line$"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^data.arith: the section is empty \(`arith:`"):
        load_config("tests", ["data.arith=null"])


def test_a_leading_tilde_in_a_path_setting_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config("tests", ["model.policy=~/pol", "data.source=~/d.jsonl", "data.eval_source=~/e.jsonl",
                                "train.output_dir=~/runs/x", "method.caspo.value_model=~/v", "eval.benchmarks=[]"])
    assert (cfg.model.policy, cfg.data.source, cfg.data.eval_source, cfg.train.output_dir,
            cfg.method.caspo.value_model) == tuple(f"{tmp_path}/{p}"
                                                   for p in ("pol", "d.jsonl", "e.jsonl", "runs/x", "v"))
    assert f"output_dir: {tmp_path}/runs/x" in to_yaml(cfg)  # what the run's config.yaml records
    # a ~ that does not lead, and other settings, are left alone; a preset path may start with ~ too
    (tmp_path / "p.yaml").write_text("data:\n  template: '~/{query}'\n")
    cfg = load_config("~/p.yaml", ["train.output_dir=runs/~x"])
    assert (cfg.data.template, cfg.train.output_dir) == ("~/{query}", "runs/~x")
