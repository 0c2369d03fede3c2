"""Moved into the package: ``driftless.vllm_ext.DriftlessWorkerExtension``, driven by the agent.

The previous hand-written scatter (Llama-only ``qkv_proj`` / ``gate_up_proj`` fusion, manual
tensor-parallel slicing) is replaced by vLLM's own checkpoint-patch loader, which handles both
for every architecture. The agent verifies each step on its own copy, writes the patch from
the engine's step, and calls the extension over ``collective_rpc``. See ``docs/engines/vllm.md``.

    VLLM_SERVER_DEV_MODE=1 vllm serve /weights/current \\
        --worker-extension-cls driftless.vllm_ext.DriftlessWorkerExtension
    driftless agent --bucket s3://bucket/run-1 --trust /keys/trainer.pub.pem --dir /weights \\
        --notify vllm=http://127.0.0.1:8000,patch=on
"""

from driftless.vllm_ext import DriftlessWorkerExtension  # noqa: F401
