"""Does a prefix value model rank a spurious line below the correct state? (arithmetic task)

For held-out problems whose last operation is + or − (those the embedded policy may
skip), three response prefixes are read, each up to the newline that would start the box
line (the newline splitter's step boundary, where phase-1 labels are read):

    correct:  the reference solution's computation lines;
    skipped:  the same without the last line (the base policy's usual mistake);
    spurious: the correct lines plus a doubling of the result, "r * 2 = 2r".

A spurious line makes every answer boxed after it wrong, so a sound value model puts it
below the correct state. A value model that learned only from the base policy, which
never writes one, may instead read it as progress; RL against it then learns to write
such lines. Reported: mean σ(V/β) of each prefix and the share of problems where
spurious > correct.
"""

from __future__ import annotations

import torch

from caspo.models.prefix_value import PrefixValueModel, pack_responses, prefix_values
from caspo.value.metrics import success_probability


def probe_responses(solution: str) -> dict[str, str] | None:
    """The three prefixes of one reference solution, or None if its last operation is a multiplication."""
    lines = solution.split("\n")[:-1]  # the computation lines; the last line is the box
    _, op, _, _, result = lines[-1].split()  # "a op b = result"
    if op == "*":
        return None
    r = int(result)
    return {"correct": "\n".join(lines), "skipped": "\n".join(lines[:-1]),
            "spurious": "\n".join(lines + [f"{r} * 2 = {2 * r}"])}


@torch.no_grad()
def spurious_line_check(model: PrefixValueModel, tokenizer, prompts: list[list[int]], solutions: list[str],
                        problems: int = 100) -> dict:
    """The module docstring's check on the first ``problems`` usable (prompt, solution) pairs."""
    names = ("correct", "skipped", "spurious")
    values = {name: [] for name in names}
    for prompt, solution in zip(prompts, solutions):
        texts = probe_responses(solution)
        if texts is None:
            continue
        responses = [tokenizer.encode(texts[name], add_special_tokens=False) for name in names]
        batch = pack_responses([prompt] * 3, responses, tokenizer.pad_token_id)
        v = prefix_values(model.cumulative(batch), torch.tensor([[len(r)] for r in responses]))
        for name, value in zip(names, v[:, 0].tolist()):
            values[name].append(value)
        if len(values["correct"]) == problems:
            break
    if not values["correct"]:
        raise ValueError("no problem ends in + or −: the check needs the arithmetic task's held-out split")
    prob = {name: success_probability(v, model.beta) for name, v in values.items()}
    return {"problems": len(values["correct"]),
            **{f"mean_prob_{name}": float(prob[name].mean()) for name in names},
            "share_spurious_above_correct": float((prob["spurious"] > prob["correct"]).mean())}
