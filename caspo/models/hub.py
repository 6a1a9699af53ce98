"""A model spec that is a folder or a Hugging Face hub id, the error when neither loads, and pinned revisions.

`model.revision` pins the hub commit a policy's files must come from:

- a hub id resolves to that commit's snapshot folder (`hub_snapshot`: the local cache, else a download), so
  the tokenizer, the policy and its critic all read the same files;
- a folder is checked against the commit it records (`recorded_revision`): the hub cache's snapshot folder
  name, the metadata `hf download --local-dir` writes under `.cache/huggingface/download/`, or the source
  record of `caspo convert`. A folder that records none, or another commit, is refused.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

from caspo.config import ConfigError

COMMIT = re.compile(r"[0-9a-f]{40}")
SOURCE_RECORD = "caspo_source.json"  # written by `caspo convert` beside the converted model


def looks_like_folder(spec: str) -> bool:
    """A path rather than a hub id ("ORG/NAME" or "NAME"): it exists, is absolute or relative, nests, or its
    ORG is a folder here (`runs/typo` is a mistyped path, not a hub id to retry for a minute)."""
    return (Path(spec).exists() or spec.startswith(("/", ".", "~")) or "\\" in spec or spec.count("/") > 1
            or local_parent(spec) is not None)


def local_parent(spec: str) -> str | None:
    """The ORG of an ORG/NAME spec when a folder of that name exists here, else None."""
    org, slash, _ = spec.partition("/")
    return org if slash and org and Path(org).is_dir() else None


def download_command(spec: str, revision: str | None = None) -> str:
    pin = f" --revision {revision}" if revision else ""
    return f"`hf download {spec}{pin} --local-dir DIR`"


def missing_model_error(spec: str, cause: BaseException, revision: str | None = None) -> OSError:
    if looks_like_folder(spec):
        org = local_parent(spec) if not Path(spec).exists() else None
        taken = f" ({org}/ is a folder here, so this is a path, not a hub id)" if org else ""
        return FileNotFoundError(f"model {spec!r}: no such folder{taken}; pass a folder with config.json and the "
                                 "weights, or a hub id (ORG/NAME)")
    reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    at = f" at revision {revision}" if revision else ""
    return OSError(f"model {spec!r}{at} is not a folder here and did not load from the Hugging Face hub ({reason}); "
                   f"download it with {download_command(spec, revision)} (huggingface-cli download with "
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


def hub_snapshot(repo_id: str, revision: str) -> str:
    """The local snapshot folder of `repo_id` at `revision`: from the hub cache, else downloaded."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:  # not cached (huggingface_hub raises several types): try the hub
        pass
    try:
        return snapshot_download(repo_id, revision=revision)
    except Exception as err:
        raise missing_model_error(repo_id, err, revision) from err


def recorded_revision(folder: str | Path) -> str | None:
    """The hub commit `folder`'s files were downloaded at, or None where the folder records none.

    Read from, in turn: `caspo convert`'s source record; the folder's name when it is a hub-cache
    snapshot (`.../snapshots/<commit>`); the per-file metadata of `hf download --local-dir`, which must
    exist for config.json and every weight file and name one commit.
    """
    folder = Path(folder)
    record = folder / SOURCE_RECORD
    if record.is_file():
        return json.loads(record.read_text()).get("revision")
    resolved = folder.resolve()
    if resolved.parent.name == "snapshots" and COMMIT.fullmatch(resolved.name):
        return resolved.name
    meta = folder / ".cache" / "huggingface" / "download"
    files = ["config.json", *sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))]
    commits = {}
    for name in files:
        path = meta / f"{name}.metadata"
        if not path.is_file():
            return None
        commits[name] = (path.read_text().splitlines() or [""])[0].strip()
    if len(set(commits.values())) > 1:
        raise ConfigError(f"{folder} mixes files of several hub commits ({commits}); download it again with "
                          f"one `hf download --revision`")
    return next(iter(commits.values()))


def same_revision(found: str, revision: str) -> bool:
    """A full commit hash, or an abbreviation of at least 7 hex digits."""
    return found == revision or (len(revision) >= 7 and re.fullmatch(r"[0-9a-f]+", revision) is not None
                                 and found.startswith(revision))


def check_revision(folder: str, revision: str) -> None:
    """Raise unless `folder` records the hub commit `revision` (see `recorded_revision`)."""
    found = recorded_revision(folder)
    if found is None:
        raise ConfigError(f"model.revision={revision} but {folder} records no hub revision to check; fetch the "
                          f"pinned files with `hf download ORG/NAME --revision {revision} --local-dir {folder}`, "
                          "or set model.revision=null to use the folder as it is")
    if not same_revision(found, revision):
        raise ConfigError(f"{folder} holds hub revision {found}, but model.revision={revision}; download the "
                          f"pinned one (`hf download ORG/NAME --revision {revision} --local-dir DIR`) or change "
                          "model.revision")
