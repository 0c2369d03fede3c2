"""The worker extension's torch path on a GPU, through vLLM's unchanged checkpoint-patch loader.

    VLLM_SRC=DIR python gpu_patch_check.py [--hidden 2048] [--layers 4] [--density 0.01]

DIR holds ``vllm/model_executor/model_loader/checkpoint_weight_patch.py`` exactly as published
in the pinned wheel (the file imports only torch), with empty ``__init__.py`` files above it.
Needs torch with CUDA (``--device cpu`` with a CPU build); not part of CI (no GPU, no torch
there), and not yet run: no GPU was lent to the session that wrote it. The model is a stand-in with vLLM's
parameter layout (fused ``qkv_proj`` and ``gate_up_proj`` filled by ``narrow(...).copy_`` as
vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` weight loaders do at TP=1);
the patch file follows ``crates/driftless-agent/src/patch.rs`` (sorted unique int32 indices,
values of the new step, a NaN tensor and a dense tensor to exercise the fallbacks).

Checks, bit for bit: after ``driftless_apply_patch`` every checkpoint tensor's region of the
live parameters equals the new step. Prints the time of the patch next to a dense load of the
same weights through the same ``load_weights`` (the in-place part of ``reload_weights``,
without reading the disk), and the bytes of each.
"""

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
EXT = os.path.join(HERE, "..", "..", "crates", "driftless-py", "python", "driftless", "vllm_ext.py")


class Model(torch.nn.Module):
    """vLLM's parameter layout for a Llama-style decoder, and its checkpoint-name mapping."""

    def __init__(self, hidden, inter, kv, layers, vocab, device):
        super().__init__()
        bf = dict(dtype=torch.bfloat16, device=device)
        self.hidden, self.inter, self.kv = hidden, inter, kv
        p = {"embed_tokens.weight": torch.empty(vocab, hidden, **bf), "norm.weight": torch.empty(hidden, **bf)}
        for li in range(layers):
            p[f"layers.{li}.self_attn.qkv_proj.weight"] = torch.empty(hidden + 2 * kv, hidden, **bf)
            p[f"layers.{li}.self_attn.o_proj.weight"] = torch.empty(hidden, hidden, **bf)
            p[f"layers.{li}.mlp.gate_up_proj.weight"] = torch.empty(2 * inter, hidden, **bf)
            p[f"layers.{li}.mlp.down_proj.weight"] = torch.empty(hidden, inter, **bf)
        self.params = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v, False) for k, v in p.items()})

    def param(self, name):
        return self.params[name.replace(".", "__")]

    def region(self, ckpt_name):
        """The view of a live parameter that a checkpoint tensor fills."""
        name = ckpt_name.removeprefix("model.")
        h, kv, i = self.hidden, self.kv, self.inter
        stacked = {"q_proj": ("qkv_proj", 0, h), "k_proj": ("qkv_proj", h, kv), "v_proj": ("qkv_proj", h + kv, kv),
                   "gate_proj": ("gate_up_proj", 0, i), "up_proj": ("gate_up_proj", i, i)}
        for short, (fused, off, n) in stacked.items():
            if f".{short}." in name:
                return self.param(name.replace(short, fused)).data.narrow(0, off, n)
        return self.param(name).data

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            self.region(name).copy_(w)  # the final same-shaped copy_ of vLLM's loaders
            loaded.add(name)
        return loaded


def checkpoint_shapes(hidden, inter, kv, layers, vocab):
    s = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for li in range(layers):
        a, m = f"model.layers.{li}.self_attn", f"model.layers.{li}.mlp"
        s.update({f"{a}.q_proj.weight": (hidden, hidden), f"{a}.k_proj.weight": (kv, hidden),
                  f"{a}.v_proj.weight": (kv, hidden), f"{a}.o_proj.weight": (hidden, hidden),
                  f"{m}.gate_proj.weight": (inter, hidden), f"{m}.up_proj.weight": (inter, hidden),
                  f"{m}.down_proj.weight": (hidden, inter)})
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    sys.path.insert(0, os.environ["VLLM_SRC"])
    spec = importlib.util.spec_from_file_location("driftless_vllm_ext", EXT)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    dev = torch.device(a.device)
    h, i, kv, vocab = a.hidden, a.hidden * 11 // 4, a.hidden // 8, 32000
    shapes = checkpoint_shapes(h, i, kv, a.layers, vocab)
    g = torch.Generator(device=dev).manual_seed(1)
    old = {n: torch.randn(s, generator=g, device=dev).mul_(0.02).to(torch.bfloat16) for n, s in shapes.items()}
    new, sparse = {}, {}
    for n, t in old.items():
        bits = t.view(torch.int16).reshape(-1).clone()
        k = max(1, int(bits.numel() * a.density))
        idx = torch.randperm(bits.numel(), generator=g, device=dev)[:k].sort().values
        bits[idx] += torch.where(torch.rand(k, generator=g, device=dev) < 0.5, 1, -1).to(torch.int16)
        new[n] = bits.view(torch.bfloat16).view(t.shape)
        sparse[n] = idx.to(torch.int32)
    # Fallbacks: a NaN among one tensor's new values, one tensor marked dense.
    nan_t, dense_t = "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"
    new[nan_t].view(-1)[sparse[nan_t][0]] = float("nan")
    tmp = tempfile.mkdtemp()
    wdir = os.path.join(tmp, "weights")
    os.makedirs(wdir)
    save_file({n: t.cpu().contiguous() for n, t in new.items()}, os.path.join(wdir, "model.safetensors"))
    tensors = {}
    for n in shapes:
        if n == dense_t:
            continue
        tensors[f"idx/{n}"] = sparse[n].cpu()
        tensors[f"val/{n}"] = new[n].reshape(-1)[sparse[n].long()].cpu()
    meta = {"format": ext.FORMAT, "base_step": "0", "step": "1", "weights_root": "00" * 32,
            "shapes": json.dumps({n: list(s) for n, s in shapes.items()}), "dense": json.dumps([dense_t])}
    ppath = os.path.join(tmp, "0-1.safetensors")
    save_file(tensors, ppath, metadata=meta)

    model = Model(h, i, kv, a.layers, vocab, dev)
    model.load_weights(old.items())

    class Runner:
        def get_model(self):
            return model

    class Worker(ext.DriftlessWorkerExtension):
        model_runner = Runner()

    w = Worker()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    for n, t in old.items():  # the engine starts on the old step
        assert torch.equal(model.region(n).view(torch.int16), t.view(torch.int16)), n
    t0 = time.perf_counter()
    with open(ppath, "rb") as fh:
        sha = hashlib.sha256(fh.read()).hexdigest()
    step = w.driftless_apply_patch(ppath, wdir, sha)
    sync()
    t_patch = time.perf_counter() - t0
    assert step == 1
    bad = [n for n, t in new.items() if not torch.equal(model.region(n).view(torch.int16), t.view(torch.int16))]
    assert not bad, f"not bit-identical after the patch: {bad[:5]}"
    # Baseline: a dense load of the same new weights from host memory through load_weights.
    host = {n: t.cpu() for n, t in new.items()}
    model.load_weights(old.items())
    sync()
    t0 = time.perf_counter()
    model.load_weights(host.items())
    sync()
    t_dense = time.perf_counter() - t0
    ck_bytes = sum(t.numel() * 2 for t in new.values())
    print(json.dumps({
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "params": sum(t.numel() for t in new.values()),
        "density": a.density, "checkpoint_bytes": ck_bytes, "patch_bytes": os.path.getsize(ppath),
        "patch_apply_s": round(t_patch, 3), "dense_load_from_host_s": round(t_dense, 3),
        "bit_identical": True, "nan_tensor_sent_dense": nan_t, "dense_tensor": dense_t}))


if __name__ == "__main__":
    main()
