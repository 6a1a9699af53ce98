"""The rollout's decode kernels (attention, RoPE, the Gumbel pick, the nucleus search's reads, passes and per-row
kernels) compile for an H100/H200 (sm_90) without spilling registers, on any machine.

Triton's interpreter (the CPU tests) runs a kernel's Python, not its compilation: a kernel it accepts may
still fail to compile for the card, or spill registers to local memory. Triton compiles for an sm_90
target without a GPU, and `cuobjdump -res-usage` reads the registers, stack and local memory of the
result. The compilation runs in a fresh interpreter, outside the interpreter mode conftest.py sets.
It builds with the triton installed here; another version allocates registers differently (the nucleus
search's finish kernel: 56 registers built by triton 3.9, 128 by 3.6), so these tests check for spills, not for
counts.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

BUILD = r'''
import json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from caspo.rollout import gumbel_kernel as gk, mass_above as ma, nucleus_reads as nrd, nucleus_resolve as nr
from caspo.rollout.native import decode_attention as da, rope_attention as ra, rope_store as rs, \
    shared_prefix_attention as spa

TYPES = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Members": "*i64", "Slots": "*i64", "Lengths": "*i64",
         "Starts": "*i64", "Count": "*i64", "MidO": "*fp32", "MidLse": "*fp32", "Out": "*bf16", "qk_scale": "fp32",
         "QKV": "*bf16", "Cos": "*bf16", "Sin": "*bf16", "CacheK": "*bf16", "CacheV": "*bf16", "Positions": "*i64",
         "Logits": "*fp32", "Seeds": "*i64", "Threshold": "*fp32", "inverse_temperature": "fp32", "margin": "fp32",
         "BestKey": "*fp64", "BestIndex": "*i32", "KeptTotal": "*fp32", "FullTop": "*fp32", "FullTotal": "*fp32",
         "ChunkMaxima": "*fp32", "X": "*fp32", "E": "*fp32", "Maxima": "*fp32", "Target": "*i64", "Lo": "*i64",
         "Hi": "*i64", "Skip": "*i8", "Known": "*i8", "Cut": "*fp32", "Chosen": "*i32", "Values": "*fp32",
         "Index": "*i32", "Counts": "*i32", "Above": "*i64", "x_scale": "fp32", "shift_scale": "fp32",
         "RowMax": "*fp32", "ScreenSums": "*fp64", "Bits": "*i64", "scale": "fp32"}
SHAPE = dict(GROUP=6, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64)  # Qwen2.5-1.5B: 12 heads, 2 KV heads, D = 128
ATTENTION = {"num_warps": da.NUM_WARPS, "num_stages": da.NUM_STAGES}
PICK = dict(SPAN=gk.SPAN, BLOCK=gk.BLOCK, FAST_MATH=True)
KERNELS = {
    "split": (da._split_kernel, dict(SHAPE, BLOCK_G=16, PRECISION="tf32", HAS_STARTS=False), ATTENTION),
    "split_from_starts": (da._split_kernel, dict(SHAPE, BLOCK_G=16, PRECISION="tf32", HAS_STARTS=True), ATTENTION),
    "combine": (da._combine_kernel, dict(GROUP=6, HEAD_DIM=128, BLOCK_G=8, BLOCK_S=4, BLOCK_D=128),
                {"num_warps": 4, "num_stages": da.NUM_STAGES}),
    "prefix": (spa._prefix_kernel, dict(SHAPE, MEMBERS=10, BLOCK_Q=64, BLOCK_N=spa.PREFIX_BLOCK_N, PRECISION="tf32"),
               {"num_warps": spa.PREFIX_WARPS, "num_stages": da.NUM_STAGES}),
    "rope_store": (rs._rope_store_kernel, dict(HEADS=12, KV_HEADS=2, HALF=64, BLOCK_H=16, BLOCK=64),
                   {"num_warps": rs.WARPS, "enable_fp_fusion": False}),
    # Qwen2.5-7B's 28 + 4 + 4 heads: a [64, 64] tile
    "rope_store_7b": (rs._rope_store_kernel, dict(HEADS=28, KV_HEADS=4, HALF=64, BLOCK_H=64, BLOCK=64),
                      {"num_warps": rs.WARPS, "enable_fp_fusion": False}),
    "rope_attend": (ra._rope_attend_kernel, dict(HEADS=12, KV_HEADS=2, GROUP=6, HEAD_DIM=128, BLOCK_G=16,
                                                 BLOCK_D=128, BLOCK_N=ra.BLOCK_N, PRECISION="tf32"), ATTENTION),
    "pick": (gk._gumbel_pick_kernel, dict(PICK, CUT=False, CHUNK=0), {"num_warps": gk.WARPS}),
    "pick_under_cut": (gk._gumbel_pick_kernel, dict(PICK, CUT=True, CHUNK=0), {"num_warps": gk.WARPS}),
    "pick_after_search": (gk._gumbel_pick_kernel, dict(PICK, CUT=True, CHUNK=128), {"num_warps": gk.WARPS}),
    # the nucleus search's per-row kernels at the sampler's defaults: 64 chunks of 128 of 1,187; 19 parts of 64
    "start_search": (nr._start_kernel, dict(COUNT=64, CHUNK=128, CHUNKS=2048), {"num_warps": nr.START_WARPS}),
    "finish_search": (nr._finish_kernel, dict(CAPACITY=64, PARTS=32), {"num_warps": nr.FINISH_WARPS}),
    # the nucleus search's reads of the rows and its passes, at the sampler's defaults (7 levels a pass)
    "chunk_maxima": (nrd._chunk_maxima_kernel, dict(CHUNK=128, PER_PART=nrd.SPAN // 128, ROWS=nrd.BLOCK // 128),
                     {"num_warps": nrd.WARPS}),
    "exp_and_mass": (nrd._exp_and_mass_kernel, dict(SPAN=nrd.SPAN, BLOCK=nrd.BLOCK, LO=0, HI=127 << 23, M=7, LEVELS=8),
                     {"num_warps": nrd.WARPS}, {"Partial": "*i64"}),
    "threshold_logit": (nrd._threshold_logit_kernel, dict(SPAN=nrd.SPAN, BLOCK=nrd.BLOCK), {"num_warps": nrd.WARPS},
                        {"Partial": "*fp32"}),
    "collect": (nrd._collect_kernel, dict(CAPACITY=64, SPAN=nrd.SPAN, BLOCK=nrd.BLOCK), {"num_warps": nrd.WARPS}),
    "cut_mass": (ma._cut_mass_kernel, dict(M=7, LEVELS=8, SPAN=ma.SPAN, BLOCK=ma.BLOCK), {"num_warps": ma.WARPS},
                 {"Partial": "*i64"}),
    "screen": (ma._screen_kernel, dict(M=7, LEVELS=8, SPAN=ma.SPAN, BLOCK=ma.SCREEN_BLOCK), {"num_warps": ma.WARPS},
               {"Partial": "*fp64"}),
}
usage = {}
for name, (fn, constexprs, options, *overrides) in KERNELS.items():
    types = {**TYPES, **(overrides[0] if overrides else {})}  # an argument name typed differently by kernel
    signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in fn.arg_names}
    # as the JIT specializes them on the engine's tensors: pointers, strides and Qwen's vocabulary (151,936 =
    # 16 · 9,496) divisible by 16, which lets the loads feeding tl.dot be pipelined through shared memory and a
    # row's loads under `lanes < vocab - offset` be 128-bit
    aligned = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
               if signature[arg].startswith("*") or arg.startswith("stride") or arg == "vocab"}
    source = ASTSource(fn=fn, signature=signature, attrs=aligned,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        out = subprocess.run([sys.argv[1], "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    line = [l for l in out.splitlines() if "REG:" in l][-1]
    usage[name] = dict(field.split(":") for field in line.split())
print(json.dumps(usage))
'''


@pytest.fixture(scope="module")
def usage():
    cuobjdump = BIN / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip(f"triton has no CUDA toolchain here ({cuobjdump} is missing)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", BUILD, str(cuobjdump)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# the names of BUILD's KERNELS, which runs from a string and cannot be imported; the last test keeps the two equal
KERNEL_NAMES = ["split", "split_from_starts", "combine", "prefix", "rope_store", "rope_store_7b", "rope_attend", "pick",
                "pick_under_cut", "pick_after_search", "start_search", "finish_search", "chunk_maxima", "exp_and_mass",
                "threshold_logit", "collect", "cut_mass", "screen"]


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_decode_kernels_compile_for_sm90_without_spilling(usage, kernel):
    resources = usage[kernel]
    assert int(resources["REG"]) <= 255
    assert resources["STACK"] == "0" and resources["LOCAL"] == "0", resources  # nothing spilled


def test_every_built_kernel_is_checked(usage):
    assert sorted(usage) == sorted(KERNEL_NAMES)
