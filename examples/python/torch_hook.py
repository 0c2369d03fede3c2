#!/usr/bin/env python3
"""Publish a PyTorch model's BF16 weights after every optimizer step.

    pip install ./crates/driftless-py torch transformers
    python examples/python/torch_hook.py s3://bucket/run-1 key.pem

With a Hugging Face model the tensor names are the checkpoint's own
(``model.layers.0.self_attn.q_proj.weight``), so an inference server that loads the
directory written by ``driftless agent`` (or ``Follower.sync_dir``) sees a normal checkpoint.
This example falls back to a small ``torch.nn`` model when transformers is absent.
"""

import sys

import torch

import driftless
import driftless.torch


def make_model():
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=1024)
        return AutoModelForCausalLM.from_config(cfg)
    except ImportError:
        return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))


def main():
    url = sys.argv[1]
    key = sys.argv[2] if len(sys.argv) > 2 else None
    model = make_model()  # FP32 master weights; the hook publishes their BF16 view
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    with driftless.Publisher(url, signing_key=key, anchor_every=50) as pub:
        hook = driftless.torch.attach(pub, model, opt, on_receipt=lambda r: print(
            f"step {r['step']}: {r['outcome']}, {100 * r['density']:.3f}% changed, publish() {r['encode_secs']:.3f} s"))
        for _ in range(5):
            x = torch.randn(8, 256)
            out = model(x) if isinstance(model, torch.nn.Sequential) else model(torch.randint(0, 1024, (2, 16))).logits
            out.float().pow(2).mean().backward()
            opt.step()  # -> hook -> pub.publish(step, bf16 tensors); returns once encoded
            opt.zero_grad()
        hook.remove()
        print(pub.status())


if __name__ == "__main__":
    main()
