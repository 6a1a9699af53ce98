"""Typed run configuration: a YAML preset plus dotted command-line overrides.

    cfg = load_config("arith-tiny", ["method.name=grpo", "train.steps=50"])

Every section is a dataclass (`schema`); loading (`load`) walks the YAML against the field types,
so an unknown key or a value of the wrong type is an error naming its key path and the expected
type. `validate` then checks the shapes that must agree (whole minibatches, ...), and
`caspo.methods.resolve_method` the ones a method's row adds (G >= 2 for GRPO, ...). Presets live in
`caspo/presets/` and are addressed by name or by path.

This is the bottom layer: it imports nothing else from caspo.
"""

from caspo.config.load import (
    ABSENT,
    FLOAT_RE,
    PRESET_DIR,
    build,
    coerce,
    config_changes,
    describe_changes,
    leaves,
    load_config,
    parse_override,
    read_text_checked,
    resolve_preset,
    set_dotted,
    to_dict,
    to_yaml,
)
from caspo.config.schema import (
    ArithConfig,
    CaspoConfig,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    LossAgg,
    MethodConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    SftConfig,
)
from caspo.config.train_schema import HealthConfig, TrainConfig, WandbConfig
from caspo.config.validate import validate, validate_refresh

__all__ = [
    "ArithConfig", "CaspoConfig", "Config", "ConfigError", "DataConfig", "EvalConfig", "LossAgg", "MethodConfig",
    "ModelConfig", "OptimConfig", "RewardConfig", "RolloutConfig", "SftConfig", "TrainConfig", "HealthConfig",
    "WandbConfig",
    "ABSENT", "FLOAT_RE", "PRESET_DIR", "build", "coerce", "config_changes", "describe_changes", "leaves",
    "load_config", "parse_override", "read_text_checked", "resolve_preset",
    "set_dotted", "to_dict", "to_yaml", "validate", "validate_refresh",
]
