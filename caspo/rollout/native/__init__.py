"""The native rollout engine: plain-PyTorch Qwen2/Llama and looped runners with their own KV cache and scheduler.

    engine = NativeEngine(model_or_folder, max_seq_len=2048, capacity_tokens=...)   # or gpu_memory_fraction=
    completions = engine.generate(requests, SamplingParams(temperature=0.6, top_p=0.9))

spec.py             which Hugging Face configs the runner computes exactly, and the error for the rest
runner.py           the decoder, its parameters named as in transformers, loading by name
looped_runner.py    the looped (fixed-depth recurrent) decoder: one KV plane per loop
decode_attention.py the split-K Triton kernel of decode attention
kv_cache.py         the engine-owned cache: one fixed slot per running sequence, addressed by (plane, layer)
prefix.py           which resident slot already holds a prompt's prefix
graphs.py           CUDA graphs of the decode step
scheduler.py        bookkeeping, no tensors: admission in request order, slots, prefill plans, retirement
model_runner.py     the device side: prefill, the decode step, the sampling hand-off, teacher-forced logits
engine.py           `NativeEngine`: builds runner, cache and model runner, runs the loop; publication, sleep/wake
"""

from caspo.rollout.native.engine import EngineStats, NativeCompletion, NativeEngine
from caspo.rollout.native.kv_cache import CapacityReport, KVCache
from caspo.rollout.native.spec import DecoderSpec, LoopedSpec, UnsupportedModelError, decoder_spec

__all__ = ["CapacityReport", "DecoderSpec", "EngineStats", "KVCache", "LoopedSpec", "NativeCompletion", "NativeEngine",
           "UnsupportedModelError", "decoder_spec"]
