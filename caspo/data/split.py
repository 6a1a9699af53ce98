"""A held-out split of one source, by prompt, fixed by a seed (`data.heldout_fraction`, `data.split_seed`)."""

from __future__ import annotations

import hashlib

from caspo.data.examples import DataError, Example


def prompt_key(seed: int, query: str) -> str:
    return hashlib.sha256(f"{seed}\0{query.strip()}".encode()).hexdigest()


def heldout_split(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held-out): the distinct prompts ranked by sha256(seed, prompt), the first
    round(fraction × distinct prompts) of them held out. Rows sharing a prompt land on the same side,
    each side keeps the source's order, and the split depends only on the prompts and the seed."""
    if not 0 < fraction < 1:
        raise DataError(f"data.heldout_fraction must be in (0, 1), got {fraction}")
    prompts = sorted({e.query.strip() for e in examples}, key=lambda q: prompt_key(seed, q))
    n = round(fraction * len(prompts))
    if n < 1 or n == len(prompts):
        raise DataError(f"data.heldout_fraction={fraction} of {len(prompts)} distinct prompts leaves one side empty; "
                        "choose a fraction that keeps prompts on both sides")
    held = set(prompts[:n])
    train = [e for e in examples if e.query.strip() not in held]
    return train, [e for e in examples if e.query.strip() in held]
