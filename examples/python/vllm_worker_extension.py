"""Moved into the package: ``driftless.vllm_ext.DriftlessWorkerExtension``.

The previous hand-written scatter (Llama-only ``qkv_proj`` / ``gate_up_proj`` fusion, manual
tensor-parallel slicing) is replaced by vLLM's own checkpoint-patch loader, which handles both
for every architecture. See ``docs/engines/vllm.md``.

    VLLM_SERVER_DEV_MODE=1 vllm serve /ckpt/step-0 \\
        --worker-extension-cls driftless.vllm_ext.DriftlessWorkerExtension

    # offline engine:
    from vllm import LLM
    llm = LLM(model="/ckpt/step-0", worker_extension_cls="driftless.vllm_ext.DriftlessWorkerExtension")
    llm.collective_rpc("driftless_init", kwargs={"url": "s3://bucket/run-1",
                                                 "trusted_keys": open("/keys/trainer.pub.pem").read()})
    llm.collective_rpc("driftless_update")   # between generation batches; returns the step per worker
"""

from driftless.vllm_ext import DriftlessWorkerExtension  # noqa: F401
