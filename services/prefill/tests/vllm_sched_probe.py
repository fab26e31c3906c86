"""Run by test_vllm_plugin.py in a child process (vLLM's import changes process-wide state):
builds vLLM's real v1 ``Scheduler`` subclass from ``vllm_plugin`` on a tiny local Llama config
(CPU device, no forward pass: vLLM's scheduler is plain Python), feeds it vLLM ``Request``s,
and steps it with ``schedule()`` / ``update_from_output()``, recording at each step the
policy's own decision on the same queue next to the tokens vLLM scheduled. Prints one JSON
report.

argv: <vllm env dir> <work dir>
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

POLICY = ("longcap-dynamic?step_tokens=2048&short_tokens=1024&min_chunk=256&short_step=1024"
          "&short_order=shortest")
TURNS = [("long", 9000), ("a", 700), ("b", 300), ("c", 5000), ("d", 40)]
BLOCKS, BLOCK = 4096, 16


def main() -> None:
    from testkit.vllm_env import enter_vllm_env, write_tiny_llama

    env_dir, work = sys.argv[1], Path(sys.argv[2])
    enter_vllm_env(env_dir)
    model_dir = write_tiny_llama(work / "tiny-llama", max_positions=16384)
    os.environ["AGENTSERVING_PREFILL_POLICY"] = POLICY

    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from agentserving.prefill import vllm_plugin
    from agentserving.prefill.policies import SchedState
    from agentserving.prefill.vllm_plugin import policy_from_env

    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                 dtype="float32", max_model_len=16384),
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(max_model_len=16384, is_encoder_decoder=False,
                                         max_num_batched_tokens=8192, max_num_seqs=8,
                                         enable_chunked_prefill=True),
        device_config=DeviceConfig(device="cpu"))
    config.cache_config.num_gpu_blocks = BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16,
                             dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn", "model.layers.1.self_attn"], spec)])

    cls = vllm_plugin.LongcapScheduler
    report: dict = {"subclass": issubclass(cls, Scheduler),
                    "overrides": sorted(k for k in vars(cls) if k in vars(Scheduler) and (
                        k == "__init__" or not k.startswith(("__", "_abc")))),
                    "split_params": list(inspect.signature(
                        Scheduler._mamba_block_aligned_split).parameters)}
    sched = cls(vllm_config=config, kv_cache_config=kv_config,
                structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)
    report["flag"] = sched.need_mamba_block_aligned_split
    policy = policy_from_env("")
    for i, (rid, n) in enumerate(TURNS):
        sched.add_request(Request(rid, list(range(n)), SamplingParams(max_tokens=1), None,
                                  arrival_time=float(i)))
    steps = []
    for _ in range(100):
        if not sched.waiting and not sched.running:
            break
        wait, run = vllm_plugin.views_from_vllm(sched.waiting, sched.running)
        want = policy.decide(SchedState(wait, run, max_running=8,
                                        kv_capacity_tokens=BLOCKS * BLOCK, block_size=BLOCK))
        out = sched.schedule()
        got = dict(out.num_scheduled_tokens)
        steps.append({"policy": dict(want.prefill), "vllm": got})
        ids = list(got)
        # a prompt completed this step samples its one token (max_tokens=1: then finishes)
        sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[
            r].num_prompt_tokens else [] for r in ids]
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
            sampled_token_ids=sampled))
    report["steps"] = steps
    report["left"] = [len(sched.waiting), len(sched.running)]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
