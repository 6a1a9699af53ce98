"""Prompt templates: how a query is shown to the policy.

A template is a format string with a single `{query}` placeholder. Queries are math and often
contain braces (`\\frac{1}{2}`), so the placeholder is replaced literally, never via str.format.
`chat` renders the query as one user turn of the tokenizer's own chat template instead.
"""

from __future__ import annotations

from caspo.data.examples import DataError

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
CHAT = "chat"  # the tokenizer's chat template, with the query as the user's message


def render_prompt(template: str, query: str, tokenizer=None) -> str:
    """Render `query` with a template name from TEMPLATES, `chat` (needs the tokenizer), or a literal
    string containing {query}."""
    if template == CHAT:
        return chat_prompt(tokenizer, query)
    if template in TEMPLATES:
        template = TEMPLATES[template]
    elif PLACEHOLDER not in template:
        raise DataError(
            f"unknown prompt template {template!r}: use one of {sorted(TEMPLATES) + [CHAT]} "
            f"or a literal string containing {PLACEHOLDER}"
        )
    return template.replace(PLACEHOLDER, query)


def chat_prompt(tokenizer, query: str) -> str:
    """The query as a user message of the tokenizer's chat template, up to the assistant's turn."""
    if tokenizer is None:
        raise ValueError("data.template=chat renders with the policy's chat template; pass the tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"data.template=chat but the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no "
                        f"chat template; use one of {sorted(TEMPLATES)} or a literal template with {PLACEHOLDER}")
    return tokenizer.apply_chat_template([{"role": "user", "content": query}], add_generation_prompt=True,
                                         tokenize=False)


def tokenizer_adds_bos(tokenizer) -> bool:
    """Whether the tokenizer prefixes BOS to what it encodes (Llama's do; Qwen's have no BOS)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos


def prompt_bos(setting, tokenizer, texts: list[str]) -> bool:
    """Whether encoded prompts get BOS: as the tokenizer does ("auto") or as `data.add_bos` says, but never
    a second one, when every rendered prompt starts with it already (a chat template that writes BOS)."""
    add = tokenizer_adds_bos(tokenizer) if setting == "auto" else bool(setting)
    bos = getattr(tokenizer, "bos_token", None)
    return add and not (bos and texts and all(text.startswith(bos) for text in texts))
