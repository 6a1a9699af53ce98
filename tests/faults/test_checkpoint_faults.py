"""A checkpoint write killed at any moment, or failing on a full disk, leaves the previous one loadable."""

import errno
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file

from caspo.train import checkpoint as ckpt

pytestmark = pytest.mark.timeout(600)

# a child that saves checkpoint after checkpoint of a tiny HF model with a real trainer state
CHILD = textwrap.dedent("""
    import sys, torch
    from transformers import AutoModelForCausalLM
    from caspo.models.policy import tiny_qwen2_config
    from caspo.train import checkpoint as ckpt
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(100, hidden=64, layers=2, heads=4, kv_heads=2,
                                                               intermediate=128, eos_token_id=1, pad_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters())
    for step in range(1, 10_000):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        state = {"step": step, "optimizer": optimizer.state_dict(), "weights": model.state_dict()}
        ckpt.save_checkpoint(sys.argv[1], step, models={"policy": model}, tokenizer=None, trainer_state=state,
                             counters={"step": step})
        if step == 1:
            print("first checkpoint saved", flush=True)
""")


def kill_trials(tmp_path, trials: int, seed: int = 0) -> list[int]:
    """SIGKILL a saving child `trials` times, each some saves after its first checkpoint completed, and verify the
    checkpoint it left; returns the step of each verified checkpoint."""
    rng = random.Random(seed)
    verified = []
    for trial in range(trials):
        run_dir, errors = tmp_path / f"trial{trial}", tmp_path / f"trial{trial}.stderr"
        with errors.open("w") as stderr:
            child = subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir)], stdout=subprocess.PIPE,
                                     stderr=stderr, text=True)
        assert child.stdout.readline().strip() == "first checkpoint saved"
        time.sleep(rng.uniform(0.2, 1.5))  # a few saves in, then anywhere inside one
        assert child.poll() is None, f"the child stopped saving by itself (exit status {child.returncode})"
        child.kill()
        assert child.wait() == -signal.SIGKILL
        assert "Traceback" not in errors.read_text(), errors.read_text()[-2000:]  # still saving, not dying of an error
        latest = ckpt.resolve_checkpoint(run_dir)
        ckpt.verify_checkpoint(latest)  # every file of the manifest, byte for byte
        state = ckpt.load_trainer_state(latest)
        assert state["step"] == int(latest.name.split("_")[1])
        exported = load_file(latest / "policy" / "model.safetensors")  # one step's snapshot, both halves
        assert exported.keys() and all(torch.equal(exported[k], state["weights"][k]) for k in exported)
        assert not (run_dir / "checkpoints" / f"step_{state['step'] + 2:06d}").exists()
        verified.append(state["step"])
    return verified


def test_sigkill_during_saves_leaves_the_previous_checkpoint_loadable(tmp_path):
    """Every trial leaves a checkpoint (the first one completed before the kill) that loads and matches itself."""
    steps = kill_trials(tmp_path, trials=2)  # the slow test below makes 20
    assert len(steps) == 2


@pytest.mark.slow
def test_sigkill_during_saves_twenty_trials(tmp_path):
    steps = kill_trials(tmp_path, trials=20, seed=1)
    assert len(steps) == 20


def small_save() -> dict:
    """save_checkpoint's arguments for a 2 × 2 linear "policy" whose save_pretrained writes one torch file."""
    model = torch.nn.Linear(2, 2)
    model.save_pretrained = lambda path, **kw: (path.mkdir(), torch.save(model.state_dict(), path / "w.pt"))
    return dict(models={"policy": model}, tokenizer=None, counters={})


def test_a_full_disk_is_a_clear_error_and_the_previous_checkpoint_is_intact(tmp_path, monkeypatch):
    save = small_save()
    first = ckpt.save_checkpoint(tmp_path, 1, trainer_state={"step": 1}, **save)

    def full(obj, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(ckpt.CheckpointError, match="No space left on device.*previous checkpoint \\(step_000001\\) "
                                                   "is intact"):
        ckpt.save_checkpoint(tmp_path, 2, trainer_state={"step": 2}, **save)
    monkeypatch.undo()
    assert ckpt.resolve_checkpoint(tmp_path) == first
    ckpt.verify_checkpoint(first)
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())  # no partial folder


def test_a_writer_that_fails_with_its_own_error_is_the_same_clear_error(tmp_path, monkeypatch):
    # on a full disk torch.save raises RuntimeError and safetensors SafetensorError, not OSError
    save = small_save()
    first = ckpt.save_checkpoint(tmp_path, 1, trainer_state={"step": 1}, **save)

    def fails(obj, path, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", fails)
    with pytest.raises(ckpt.CheckpointError, match="unexpected pos.*previous checkpoint \\(step_000001\\) is intact"):
        ckpt.save_checkpoint(tmp_path, 2, trainer_state={"step": 2}, **save)
    monkeypatch.undo()
    assert ckpt.resolve_checkpoint(tmp_path) == first
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())


def test_files_and_renames_reach_the_disk_before_latest_names_them(tmp_path, monkeypatch):
    import os

    save = small_save()
    synced, replaced = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((len(synced), str(b))), real_replace(a, b)))
    final = ckpt.save_checkpoint(tmp_path, 1, trainer_state={"step": 1}, **save)
    root = str(tmp_path / "checkpoints")
    (to_folder, folder_name), (to_latest, latest_name) = replaced
    assert (folder_name, latest_name) == (str(final), f"{root}/latest")
    before_rename = synced[:to_folder]
    for name in ("policy/w.pt", "trainer_state.pt", "trainer_state.json", "manifest.json", "policy"):
        assert any(p.endswith(f".tmp_step_000001/{name}") for p in before_rename), name
    assert synced[to_folder] == root  # the folder's rename, before `latest` is written
    assert synced[to_latest - 1].endswith(".latest.tmp") and synced[-1] == root


def test_a_missing_or_garbled_manifest_or_trainer_state_is_a_checkpoint_error(tmp_path):
    save = small_save()
    folder = ckpt.save_checkpoint(tmp_path, 1, trainer_state={"step": 1}, **save)
    state = (folder / "trainer_state.pt").read_bytes()
    (folder / "trainer_state.pt").write_bytes(state[: len(state) // 2])
    with pytest.raises(ckpt.CheckpointError, match="trainer_state.pt cannot be loaded"):
        ckpt.load_trainer_state(folder)
    (folder / ckpt.MANIFEST).write_text("")
    with pytest.raises(ckpt.CheckpointError, match="no readable manifest.json \\(JSONDecodeError\\)"):
        ckpt.verify_checkpoint(folder)
    (folder / ckpt.MANIFEST).unlink()
    with pytest.raises(ckpt.CheckpointError, match="no readable manifest.json \\(FileNotFoundError\\)"):
        ckpt.verify_checkpoint(folder)
