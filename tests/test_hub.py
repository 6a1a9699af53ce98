"""A model spec taken for a folder or a hub id, and the error when neither loads."""

import pytest

from caspo.cli_args import checked_config
from caspo.models.hub import looks_like_folder, missing_model_error


def test_org_name_is_a_path_when_its_org_is_a_folder_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not looks_like_folder("runs/typo") and not looks_like_folder("Qwen/Qwen2.5-Math-1.5B")
    (tmp_path / "runs").mkdir()
    (tmp_path / "Qwen").write_text("")  # a file of that name makes no folder of it
    assert looks_like_folder("runs/typo") and not looks_like_folder("Qwen/Qwen2.5-Math-1.5B")
    error = missing_model_error("runs/typo", OSError("unused"))
    assert isinstance(error, FileNotFoundError)
    assert str(error) == ("model 'runs/typo': no such folder (runs/ is a folder here, so this is a path, not a hub "
                          "id); pass a folder with config.json and the weights, or a hub id (ORG/NAME)")


def test_a_mistyped_policy_path_is_refused_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert checked_config("tests", ["model.policy=runs/typo"]).model.policy == "runs/typo"  # a hub id: loading checks
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match=r"^model 'runs/typo': no such folder \(runs/ is a folder here"):
        checked_config("tests", ["model.policy=runs/typo"])
