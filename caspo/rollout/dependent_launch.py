"""Programmatic dependent launch (PDL) for the engine's Triton kernels, on Hopper and later.

A kernel normally starts once the kernel ahead of it on the stream has finished: between the two the card
sits idle while the next grid is launched, about a microsecond in a CUDA graph. A decode step of a 1.5B
model is some 250 kernels of a few microseconds each, so these gaps add up. Launched with PDL
(`launch_pdl=True`), a kernel's programs may be scheduled while the kernel ahead still runs; each program
first waits (`griddepcontrol.wait`) until that kernel has completed and its writes are visible, and then
lets the kernel behind it launch in turn (`griddepcontrol.launch_dependents`).

Every kernel launched here waits before it reads or writes global memory, so it sees exactly what it would
have seen without PDL, and since it completes only after its wait, so has every kernel before it: what is
computed is unchanged, only the launch is hidden. torch.compile's kernels in the engine do the same
(inductor's `triton.enable_pdl`, `runner.compiled_on_cuda`).

`ENABLED` turns it off for the whole process (benchmarks compare both); it must be set before the first launch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

ENABLED = True


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """The first statement of a kernel launched with `launch_options`: with PDL, wait for the kernel ahead, then
    let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# Under TRITON_INTERPRET=1 kernels run in numpy, which has no grid dependencies.
INTERPRETED = not isinstance(wait_for_previous_kernel, JITFunction)


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9  # griddepcontrol is sm_90 PTX


def supported(device: torch.device) -> bool:
    """PDL on `device`: a CUDA card of compute capability 9.0 or later, unless turned off."""
    return ENABLED and not INTERPRETED and device.type == "cuda" and _hopper_or_later(device)


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a launch of a kernel that takes `PDL: tl.constexpr` and calls
    `wait_for_previous_kernel(PDL)` first."""
    pdl = supported(device)
    return {"PDL": pdl, "launch_pdl": pdl}
