"""caspo's commands run PyTorch's CUDA caching allocator with expandable segments, unless the user's
PYTORCH_CUDA_ALLOC_CONF says otherwise.

With them the trainer's activations of every size and the engine's cache share one pool that grows by
mapping pages instead of holding fixed segments; at the seed's shape on an 80 GB card they keep the
reserved peak 18.6 GiB lower, with no allocation retried (docs/real_runs.md). CUDA reads the setting
when it starts, so the command line imports this module before anything imports torch."""

import os

SETTING = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT = "expandable_segments:True"

os.environ.setdefault(SETTING, DEFAULT)
