"""Data settings a config can get wrong, checked right after it loads and before anything is built:
what the config layer cannot know (template names, which sources exist, the arithmetic task's rules).
The CLI runs these on every config (`caspo.cli_args.checked_config`), so `caspo config` rejects them too."""

from __future__ import annotations

from caspo.config import Config, ConfigError
from caspo.data.examples import DataError
from caspo.data.rows import parse_source
from caspo.data.task import arith_task
from caspo.data.templates import CHAT, PLACEHOLDER, TEMPLATES


def check_template(template: str) -> None:
    """A template name, `chat`, or a literal text containing {query}."""
    if template != CHAT and template not in TEMPLATES and PLACEHOLDER not in template:
        raise ConfigError(f"data.template={template!r} is no template name and has no {PLACEHOLDER}: use one of "
                          f"{', '.join(sorted(TEMPLATES) + [CHAT])}, or a literal text containing {PLACEHOLDER}")


def check_sources(sources: dict[str, str | None]) -> None:
    """Each source (by its config key) a shipped name, arith, hf:NAME, or a data file or folder that exists."""
    for key, source in sources.items():
        if source:
            try:
                parse_source(source)
            except DataError as err:
                raise ConfigError(f"{err} (in {key})") from None


def check_arith(cfg: Config) -> None:
    """The arithmetic task's own rules on its settings (sft.skip_last_when's grammar, ...)."""
    try:
        arith_task(cfg)  # builds nothing yet: ArithSpec checks its knobs
    except ValueError as err:
        raise ConfigError(f"{err} (set by data.arith.* and sft.skip_last_when / skip_last_prob / slip_prob)") from None
