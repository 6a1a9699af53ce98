"""Turn rendered prompt strings into token ids for the policy."""

from __future__ import annotations

from caspo.data.examples import DataError

ON_OVERFLOW = ("error", "truncate_left")


def encode_prompts(tokenizer, texts: list[str], *, add_bos: bool, max_prompt_tokens: int,
                   on_overflow: str = "error", ids: list[str] | None = None) -> list[list[int]]:
    """Encode prompts without the tokenizer's own special tokens, optionally prefixed with BOS.

    Prompts longer than max_prompt_tokens (BOS included) raise, naming the prompt by its row id in `ids` (else
    its index), or with "truncate_left" keep their last tokens: the end of a prompt holds the instruction the
    completion follows.
    """
    if on_overflow not in ON_OVERFLOW:
        raise ValueError(f"on_overflow={on_overflow!r}: expected one of {ON_OVERFLOW}")
    if max_prompt_tokens < 1 + add_bos:
        raise DataError(f"data.max_prompt_tokens={max_prompt_tokens} leaves no room for the prompt")
    bos = []
    if add_bos:
        if tokenizer.bos_token_id is None:
            raise DataError("data.add_bos is set but the tokenizer has no BOS token; set data.add_bos=auto or false")
        bos = [tokenizer.bos_token_id]
    if not texts:
        return []

    encoded = []
    for i, tokens in enumerate(tokenizer(list(texts), add_special_tokens=False)["input_ids"]):
        tokens = bos + list(tokens)
        if len(tokens) > max_prompt_tokens:
            if on_overflow == "error":
                name = f"of row {ids[i]!r}" if ids is not None else str(i)
                raise DataError(
                    f"prompt {name} is {len(tokens)} tokens, over data.max_prompt_tokens={max_prompt_tokens}; "
                    "raise data.max_prompt_tokens, or set data.long_prompts=skip (leave such prompts out) or "
                    "data.long_prompts=truncate_left"
                )
            tokens = bos + tokens[len(tokens) - max_prompt_tokens + len(bos):]
        encoded.append(tokens)
    return encoded
