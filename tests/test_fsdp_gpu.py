"""A run of several processes on CUDA reads its models on the host (`fsdp.read_device`): sharding moves each group
to the rank's card (FSDP2 on an NCCL mesh), and the engine is built on the card from the host copy. One NCCL
process stands in for a rank here; every check compares against the same model read straight onto the card."""

import copy

import pytest
import torch
import torch.distributed as dist

from caspo.config import load_config
from caspo.models.policy import load_policy, resolve_model_path
from caspo.models.tokenizer import load_tokenizer
from caspo.rollout.base import Request, SamplingParams
from caspo.rollout.factory import build_engine
from caspo.train import fsdp

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
POLICY = "embedded:tiny-arith"


@pytest.fixture
def nccl_group(tmp_path):
    torch.cuda.set_device(CUDA)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1, device_id=CUDA)
    yield
    dist.destroy_process_group()


def test_a_policy_read_on_the_host_is_sharded_onto_the_card(nccl_group):
    host = load_policy(POLICY, "cpu").eval()
    on_card = copy.deepcopy(host).to(CUDA)
    model = fsdp.shard_routed(host, "fp32")
    assert {(type(p).__name__, p.device.type) for p in model.parameters()} == {("DTensor", "cuda")}
    assert {b.device.type for b in model.buffers()} == {"cuda"}  # RoPE's inv_freq went with its group
    ids = torch.randint(3, 100, (3, 17), generator=torch.Generator().manual_seed(0)).to(CUDA)
    with torch.no_grad():
        sharded = fsdp.call(model, lambda m, x: m(x).logits, ids)
        whole = on_card(ids).logits
    torch.testing.assert_close(sharded, whole, rtol=0, atol=1e-5)


def test_an_engine_built_from_a_host_copy_samples_as_one_built_on_the_card():
    cfg = load_config("tests", ["model.device=cuda", "rollout.backend=native", "rollout.capacity_tokens=4096"])
    tokenizer = load_tokenizer(resolve_model_path(POLICY))
    host = load_policy(POLICY, "cpu")
    from_host = build_engine(cfg, host, tokenizer, 96, device=CUDA)
    from_card = build_engine(cfg, copy.deepcopy(host).to(CUDA), tokenizer, 96)
    assert from_host.device == from_card.device == CUDA
    requests = [Request(prompt_ids=tokenizer.encode(f"{a}+{b}="), max_new_tokens=12, seed=a * 10 + b)
                for a in range(1, 5) for b in range(3)]
    sampling = SamplingParams(temperature=1.0)
    assert [c.tokens for c in from_host.generate(requests, sampling)] == \
        [c.tokens for c in from_card.generate(requests, sampling)]
