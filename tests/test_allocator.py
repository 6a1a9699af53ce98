"""The command line sets PyTorch's CUDA allocator to expandable segments before torch is imported, and leaves
a user's own PYTORCH_CUDA_ALLOC_CONF as it is."""

import os
import subprocess
import sys

from caspo.allocator import DEFAULT, SETTING

# records the imports of caspo.allocator and torch, and stops at torch's (the rest of the import is not needed)
ORDER = """
import os, sys
order = []
class Record:
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "caspo.allocator"):
            order.append(name)
        if name == "torch":
            raise ImportError("stopped at torch")
sys.meta_path.insert(0, Record())
try:
    import caspo.cli
except ImportError:
    pass
print(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), *order)
"""


def fresh(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != SETTING}
    done = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_the_command_line_sets_expandable_segments_before_torch_is_imported():
    assert fresh(ORDER) == [DEFAULT, "caspo.allocator", "torch"]


def test_a_users_setting_is_kept():
    code = "import os, caspo.allocator; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"
    assert fresh(code, PYTORCH_CUDA_ALLOC_CONF="backend:native") == ["backend:native"]
    assert fresh("import os, caspo.allocator; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])") == [DEFAULT]


def test_a_run_on_cuda_records_the_setting(monkeypatch):
    from caspo.runlog import run_start

    monkeypatch.setenv(SETTING, "expandable_segments:False")
    args = dict(step=0, device_name="card", precision="bf16", engine_dtype="bf16", load={})
    assert run_start(device="cuda:0", **args)["cuda_alloc_conf"] == "expandable_segments:False"
    assert "cuda_alloc_conf" not in run_start(device="cpu", **args)
