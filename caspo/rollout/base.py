"""The engine protocol: requests in, completions out, weights published as transactions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol, Sequence

import torch


@dataclass
class Request:
    prompt_ids: list[int]
    seed: int  # the sample seed: all randomness of this completion derives from it
    max_new_tokens: int
    # the prompt's last tokens that stop strings read with the generated ones: a continuation's response prefix,
    # so that a stop string begun at its end (a newline merged into its last token) still ends the continuation
    stop_context: int = 0


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]  # behaviour log-probs of the sampled distribution
    finish_reason: Literal["stop", "length"]
    policy_version: int


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = full vocabulary
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)


OnFinish = Callable[[int, Completion], None]  # (request index, its final completion)


class EngineAsleepError(RuntimeError):
    """A call that needs the engine's memory, made between `sleep()` and `wake()`."""


def asleep_error(call: str = "generate()") -> EngineAsleepError:
    """The error every backend raises for `call` while asleep, in the same words."""
    return EngineAsleepError(f"the engine is asleep (KV cache released); call wake() before {call}")


class Engine(Protocol):
    version: int

    def generate(self, requests: Sequence[Request], sampling: SamplingParams, *,
                 on_finish: OnFinish | None = None) -> list[Completion]:
        """Completions in request order; raises `EngineAsleepError` while asleep. `on_finish(i, completion)` is
        called for request i as soon as its completion is final, in the calling thread, so that its consumer (a
        scorer) can start before the last request finishes."""

    @property
    def asleep(self) -> bool:
        """True between `sleep()` and `wake()`."""

    def sleep(self, weights: bool = False) -> None:
        """Free the KV cache and whatever points into it (e.g. CUDA graphs), so the trainer can use the memory;
        with `weights`, the engine's copy of the weights too (the next publication brings them back)."""

    def wake(self) -> None:
        """Re-allocate what `sleep()` freed; completions are then exactly those of before sleeping
        (after a publication, if the weights were freed)."""

    def begin(self, version: int) -> None: ...

    def load(self, named_tensors: dict[str, torch.Tensor]) -> None: ...

    def commit(self) -> str: ...


def publish(engine: Engine, model: torch.nn.Module, version: int) -> str:
    """Send every parameter of `model` to `engine` as one publication; returns the digest."""
    engine.begin(version)
    with torch.no_grad():
        engine.load(dict(model.named_parameters()))
    return engine.commit()
