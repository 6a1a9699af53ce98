"""A model spec that is a folder or a Hugging Face hub id, and the error when neither loads."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


def looks_like_folder(spec: str) -> bool:
    """A path rather than a hub id ("ORG/NAME" or "NAME"): it exists, is absolute or relative, or nests."""
    return Path(spec).exists() or spec.startswith(("/", ".", "~")) or "\\" in spec or spec.count("/") > 1


def missing_model_error(spec: str, cause: BaseException) -> OSError:
    if looks_like_folder(spec):
        return FileNotFoundError(f"model {spec!r}: no such folder; pass a folder with config.json and the "
                                 "weights, or a hub id (ORG/NAME)")
    reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    return OSError(f"model {spec!r} is not a folder here and did not load from the Hugging Face hub ({reason}); "
                   f"download it with `hf download {spec} --local-dir DIR` (huggingface-cli download with "
                   "huggingface_hub < 1.0) and pass that DIR as the model, or pass any other folder")


@contextmanager
def hub_errors(spec: str):
    """Turn a failed `from_pretrained` of a missing folder or an unreachable hub id into one clear error."""
    try:
        yield
    except OSError as err:
        if Path(spec).is_dir():
            raise  # a folder that is there but incomplete: transformers names the missing file
        raise missing_model_error(spec, err) from err
