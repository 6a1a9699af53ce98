"""Prompt templates: how a query is shown to the policy.

A template is a format string with a single `{query}` placeholder. Queries are math and often
contain braces (`\\frac{1}{2}`), so the placeholder is replaced literally, never via str.format.
"""

from __future__ import annotations

TEMPLATES: dict[str, str] = {
    # the procedural arithmetic task; the SFT target starts right after "Solution:\n"
    "arith": "{query}\nSolution:\n",
    # the instruction suffix common in RL recipes for Qwen2.5-Math base models
    "qwen-boxed": "{query}\nLet's think step by step and output the final answer within \\boxed{}.",
    # the [MATH_TASK] prompt format of the rho-math models
    "rho-math": "[MATH_TASK] Problem:\n{query}\n\nSolution:",
    "plain": "{query}",
}

PLACEHOLDER = "{query}"


def render_prompt(template: str, query: str) -> str:
    """Render `query` with a template name from TEMPLATES or a literal string containing {query}."""
    if template in TEMPLATES:
        template = TEMPLATES[template]
    elif PLACEHOLDER not in template:
        raise ValueError(
            f"unknown prompt template {template!r}: use one of {sorted(TEMPLATES)} "
            f"or a literal string containing {PLACEHOLDER}"
        )
    return template.replace(PLACEHOLDER, query)
