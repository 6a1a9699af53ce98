import subprocess
import sys
import textwrap

import pytest
import torch

from caspo.config import load_config
from caspo.models.policy import load_policy
from caspo.rollout.publication import weights_digest
from caspo.train import checkpoint as ckpt
from caspo.train import loop
from caspo.train.verify_resume import verify_resume

pytestmark = pytest.mark.timeout(300)


def test_a_kill_during_checkpoint_leaves_the_previous_one_loadable(tmp_path):
    script = textwrap.dedent(f"""
        import os, torch
        from caspo.train import checkpoint as ckpt
        model = torch.nn.Linear(2, 2)
        model.save_pretrained = lambda path, **kw: (os.makedirs(path), torch.save(model.state_dict(), f"{{path}}/w.pt"))
        ckpt.save_checkpoint({str(tmp_path)!r}, 1, models={{"policy": model}}, tokenizer=None,
                             trainer_state={{"step": 1}}, counters={{"step": 1}})
        real_save = torch.save
        def dying_save(obj, path, *a, **k):
            if str(path).endswith("trainer_state.pt"):
                os._exit(9)  # killed mid-checkpoint
            real_save(obj, path, *a, **k)
        torch.save = dying_save
        ckpt.save_checkpoint({str(tmp_path)!r}, 2, models={{"policy": model}}, tokenizer=None,
                             trainer_state={{"step": 2}}, counters={{"step": 2}})
    """)
    result = subprocess.run([sys.executable, "-c", script])
    assert result.returncode == 9
    latest = ckpt.resolve_checkpoint(tmp_path)
    assert latest.name == "step_000001"
    assert ckpt.load_trainer_state(latest)["step"] == 1
    assert (tmp_path / "checkpoints" / ".tmp_step_000002").exists()  # the half-written one, never renamed
    assert not (tmp_path / "checkpoints" / "step_000002").exists()


def test_resume_restores_state_publishes_it_and_keeps_the_base_reference(tmp_path):
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "eval.before=false"])
    tr = loop.build_trainer(cfg)
    with tr.pool:
        loop.outer_step(tr)
    folder = loop.save(tr)
    trained = weights_digest(dict(tr.policy.named_parameters()))

    fresh = loop.build_trainer(cfg)
    base = weights_digest(dict(fresh.policy.named_parameters()))
    assert base != trained
    loop.restore(fresh, folder)
    assert (fresh.step, fresh.version) == (1, 1)
    assert weights_digest(dict(fresh.policy.named_parameters())) == trained
    assert fresh.engine.digest() == trained and fresh.engine.version == 1  # published before any generation
    assert weights_digest(dict(fresh.ref.named_parameters())) == base  # KL anchor stays the original base
    assert fresh.cursor.state_dict() == tr.cursor.state_dict()
    assert torch.equal(fresh.update_rng.get_state(), tr.update_rng.get_state())


def test_bf16_checkpoint_exports_bf16_and_keeps_fp32_masters(tmp_path):
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "eval.before=false", "train.precision=bf16"])
    tr = loop.build_trainer(cfg)
    with tr.pool:
        loop.outer_step(tr)
    folder = loop.save(tr)
    exported = load_policy(str(folder / "policy"), dtype="auto")
    assert next(exported.parameters()).dtype == torch.bfloat16
    masters = ckpt.load_trainer_state(folder)["master_weights"]["policy"]
    assert all(v.dtype == torch.float32 for v in masters.values())
    assert next(tr.engine.model.parameters()).dtype == torch.bfloat16  # the engine serves its compute dtype


def test_verify_resume_is_identical_on_the_tests_preset(tmp_path):
    assert verify_resume("tests", [], tmp_path)
