"""The command line sets PyTorch's CUDA allocator to expandable segments before torch is imported, and leaves
a user's own PYTORCH_CUDA_ALLOC_CONF as it is."""

import os
import subprocess
import sys

from caspo.allocator import DEFAULT, SETTING

ORDER = """
import os, sys
order = []
class Record:
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "caspo.allocator"):
            order.append(name)
sys.meta_path.insert(0, Record())
import caspo.cli
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
