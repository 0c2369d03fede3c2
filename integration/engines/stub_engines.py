"""Runs the pinned engines' own HTTP route code with a stub engine underneath.

    python stub_engines.py vllm|sglang --port N [--api-key KEY] [--admin-api-key KEY]

The engine sources come from the published wheels (``.ci/engines.sh`` puts them on
PYTHONPATH); ``shims.install()`` replaces only their heavy third-party dependencies.

**vLLM 0.33.0**: the app is a ``FastAPI()`` with, unchanged, the routers that
``vllm/entrypoints/launchers/api_server/routers.py`` registers under ``VLLM_SERVER_DEV_MODE=1``
(``serve/dev/cache``, ``serve/dev/rpc``, ``rl/online``), vLLM's exception handlers
(``serve/exception_handling/register.py``) and, with ``--api-key``, its
``AuthenticationMiddleware``. ``app.state.engine_client`` is :class:`StubAsyncLLM`: the methods
of ``vllm.engine.protocol.EngineClient`` the routes call, with the engine core's behaviour
(pause modes, ``reset_prefix_cache`` refusing while running requests hold blocks,
``reload_weights`` raising on a path that is not a checkpoint directory, as the real loader
does after it falls back to the Hub).

**SGLang 0.5.23**: the module ``sglang.srt.entrypoints.http_server`` is imported unchanged and
its module-level ``app`` served (its middlewares, ORJSON routes, exception handlers, ``auth_level``
decorators, and ``add_api_key_middleware`` from ``sglang/srt/utils/auth.py`` added exactly as
``launch_server`` does). The global state's ``tokenizer_manager`` is :class:`StubTokenizerManager`:
the methods those routes call, with the tokenizer manager's and scheduler's behaviour
(pause modes, no lock while paused, a path that is not a directory is a failed Hub download,
a cache flush refused while requests run in ``in_place`` mode fails the update with the
weights already loaded, version recorded only on success).

Not part of either engine: ``/_stub/*`` routes the tests use to script faults and read the
recorded calls.
"""


import argparse
import asyncio
import glob
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shims  # noqa: E402

# Which engine-internal subpackages are replaced for SGLang (model code, kernels, KV cache,
# distributed runtime); everything the HTTP layer itself imports stays real.
SGLANG_INTERNALS = (
    "sglang.kernels", "sglang.jit_kernel", "sglang.srt.layers", "sglang.srt.model_executor",
    "sglang.srt.models", "sglang.srt.distributed", "sglang.srt.mem_cache", "sglang.srt.speculative",
    "sglang.srt.compilation",
)


class Faults:
    """Scripted behaviour, set through POST /_stub/faults."""

    def __init__(self):
        self.load_delay = 0.0  # seconds a load takes
        self.fail_load = False  # the next load raises / fails
        self.die_on_load = False  # the process exits when a load starts (engine crash/restart)
        self.fail_patch = False  # the next patch raises after writing its first tensor
        self.patch_delay = 0.0  # seconds the next patch takes before it writes anything
        self.fail_reset = False  # vLLM's reset_prefix_cache answers False (did not reset)
        self.running = 0  # requests holding KV blocks
        self.calls: list[dict] = []


F = Faults()


def checkpoint_error(path: str) -> str | None:
    """What the real loaders do with ``path``: a directory with safetensors files loads; anything
    else is taken as a Hugging Face repo id, and the download fails here (no network, no repo)."""
    if not os.path.isabs(path):
        return f"{path} is not an absolute local path: taken as a Hub repo id; download failed"
    if not os.path.isdir(path):
        return f"{path}: not a local folder, taken as a Hub repo id; 404 Repository Not Found"
    if not glob.glob(os.path.join(path, "*.safetensors")):
        return f"Cannot find any model weights with `{path}`"
    return None


async def load(path: str) -> str | None:
    if F.die_on_load:
        os._exit(17)
    await asyncio.sleep(F.load_delay)
    if F.fail_load:
        F.fail_load = False
        return "CUDA out of memory (scripted)"
    return checkpoint_error(path)


# --------------------------------------------------------------------------------------- vLLM
def read_weights(path: str) -> dict:
    """The weights a reload puts in the stub's 'GPU': every tensor of the directory."""
    import ml_dtypes  # noqa: F401  (bfloat16 for the reference reader's numpy backend)
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


def load_extension():
    """The shipped worker extension module, loaded from its file (the engine venv does not
    build the driftless package; the module needs only safetensors)."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "crates", "driftless-py", "python", "driftless", "vllm_ext.py")
    spec = importlib.util.spec_from_file_location("driftless_vllm_ext", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def stub_worker_class(ext):
    """A worker with the extension mixed in, as ``--worker-extension-cls`` does; only the step
    that hands patches to vLLM's loader runs on numpy here, with the loader's own checks
    (``checkpoint_weight_patch.py``: floating dtype, no NaN, in-range unique indices, same shape)
    and its lack of rollback. The torch path is run on a GPU by gpu_patch_check.py."""
    import numpy as np

    class StubWorker(ext.DriftlessWorkerExtension):
        _driftless_framework = "np"

        def __init__(self, engine):
            self.engine = engine

        @staticmethod
        def _driftless_isnan_any(values) -> bool:
            return bool(np.isnan(values.astype(np.float32)).any())

        def _driftless_load(self, patch, sparse, full):
            w = self.engine.weights
            for name, t in full.items():
                if name not in w or w[name].shape != t.shape or w[name].dtype != t.dtype:
                    raise ValueError(f"{name}: dense patch does not match the model")
            for name in sparse:
                idx, vals, _ = patch.sparse[name]
                numel = int(np.prod(patch.shapes[name]))
                if name not in w or w[name].shape != tuple(patch.shapes[name]):
                    raise ValueError(f"{name}: not a weight of this model")
                if self._driftless_isnan_any(vals) or idx.ndim != 1 or len(idx) != len(vals):
                    raise ValueError("Sparse checkpoint patches contain NaN values")
                if len(idx) and (idx.min() < 0 or idx.max() >= numel or (np.diff(np.sort(idx)) == 0).any()):
                    raise ValueError("Sparse checkpoint patches contain out-of-range or duplicate indices")
            for name, t in full.items():
                w[name][...] = t
            for k, name in enumerate(sparse):
                if k == 1 and F.fail_patch:
                    F.fail_patch = False
                    raise RuntimeError("CUDA out of memory (scripted, after a partial write)")
                idx, vals, _ = patch.sparse[name]
                w[name].reshape(-1)[idx.astype(np.int64)] = vals

    return StubWorker


class StubAsyncLLM:
    def __init__(self):
        self.paused = False
        self.mode = None
        self.version: str | None = None
        self.model_path = "/models/initial"
        self.weights: dict = {}
        self.worker = None
        self.rpc_lock = asyncio.Lock()

    async def pause_generation(self, *, mode="abort", clear_cache=True):
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"Invalid pause mode: {mode}")
        if mode == "abort":
            F.running = 0
        elif mode == "wait":
            await asyncio.sleep(0.01 * F.running)  # in-flight requests drain
            F.running = 0
        self.paused, self.mode = True, mode
        await asyncio.sleep(0.02)  # AsyncLLM.pause_generation's own settle sleep

    async def resume_generation(self):
        self.paused = False

    async def is_paused(self):
        return self.paused

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        # The engine core runs utility calls one at a time (`EngineCore.collective_rpc` blocks
        # its loop): a reload sent while a patch is still running waits for it.
        async with self.rpc_lock:
            return await self._collective_rpc(method, kwargs or {})

    async def _collective_rpc(self, method, kwargs):
        if method == "driftless_apply_patch":
            if F.patch_delay:
                delay, F.patch_delay = F.patch_delay, 0.0
                await asyncio.sleep(delay)
            if self.worker is None:
                self.worker = stub_worker_class(load_extension())(self)
            try:
                return [self.worker.driftless_apply_patch(**kwargs)]
            except Exception as e:
                raise RuntimeError(f"Worker failed with error '{e}'") from e
        if method != "reload_weights":
            raise AttributeError(f"'Worker' object has no attribute '{method}'")
        path = kwargs.get("weights_path") or self.model_path
        err = await load(path)
        if err:
            # The worker's exception comes back through the engine core as a RuntimeError.
            raise RuntimeError(f"Worker failed with error '{err}'")
        self.model_path = path
        self.weights = read_weights(path)
        return [None]  # one result per worker; reload_weights returns None

    async def reset_prefix_cache(self, reset_running_requests=False, reset_external=False):
        if F.fail_reset or (F.running and not reset_running_requests):
            return False
        F.running = 0  # preempted back to the waiting queue, recomputed later
        return True

    async def update_weight_version(self, new_version):
        # set_weight_version / get_weight_version are engine-core utility calls too
        # (vllm/v1/engine/core.py), queued behind a running collective_rpc.
        async with self.rpc_lock:
            self.version = new_version

    async def get_weight_version(self):
        async with self.rpc_lock:
            return self.version


def vllm_app(api_key: str | None):
    from argparse import Namespace

    from fastapi import FastAPI

    from vllm.entrypoints.rl.factories import register_rl_api_routers
    from vllm.entrypoints.serve import register_vllm_dev_api_routers
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    app = FastAPI()
    # The parsed CLI args the handlers read (log_error_stack defaults to VLLM_SERVER_DEV_MODE).
    app.state.args = Namespace(api_key=[api_key] if api_key else None, log_error_stack=True)
    # What routers.py registers when VLLM_SERVER_DEV_MODE=1.
    register_vllm_dev_api_routers(app)
    register_rl_api_routers(app)
    init_exception_handler(app)
    if api_key:
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        app.add_middleware(AuthenticationMiddleware, tokens=[api_key])
    app.state.engine_client = StubAsyncLLM()
    return app, app.state.engine_client


# ------------------------------------------------------------------------------------- SGLang
class StubTokenizerManager:
    def __init__(self):
        self.is_pause = False
        self.mode = None
        self.is_pause_cond = asyncio.Condition()
        self.lock = asyncio.Lock()  # model_update_lock.writer_lock, taken only when not paused
        self.loads_in_flight = 0
        self.max_concurrent_loads = 0
        self.weight_version = "default"
        self.model_path = "/models/initial"
        self.served_model_name = self.model_path
        self.is_generation = True
        self.model_config = type("MC", (), {
            "is_image_understandable_model": False, "is_audio_understandable_model": False,
            "hf_config": type("HF", (), {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})(),
        })()

    def config_value(self, name):
        return {"weight_version": self.weight_version, "load_format": "auto"}.get(name)

    def abort_request(self, rid="", abort_all=False):
        if abort_all:
            F.running = 0

    async def pause_generation(self, obj):
        async with self.is_pause_cond:
            self.is_pause = True
            self.mode = obj.mode
            if obj.mode == "abort":
                F.running = 0
            # retract: running requests go back to the waiting queue (still counted as queued)

    async def continue_generation(self, obj):
        async with self.is_pause_cond:
            self.is_pause = False
            self.is_pause_cond.notify_all()

    async def update_weight_version(self, obj):
        # tokenizer_control_mixin.update_weight_version: the scheduler's answer, then the
        # tokenizer manager's own record, which /model_info reports.
        if obj.abort_all_requests:
            F.running = 0
        self.weight_version = obj.new_version

    async def flush_cache(self, timeout_s=0.0):
        ok = not (F.running and self.mode == "in_place" and self.is_pause)
        return type("R", (), {"success": ok, "message": None if ok else "Flush cache failed: requests running.\n"})()

    async def update_weights_from_disk(self, obj, request=None):
        if obj.abort_all_requests:
            F.running = 0
        lock = self.lock if not self.is_pause else _Null()
        async with lock:
            self.loads_in_flight += 1
            self.max_concurrent_loads = max(self.max_concurrent_loads, self.loads_in_flight)
            try:
                err = await load(obj.model_path)
            finally:
                self.loads_in_flight -= 1
        if err:
            return False, f"Failed to update weights: {err}.\nRolling back to original weights.", 0
        self.model_path = self.served_model_name = obj.model_path
        if obj.flush_cache and F.running and self.mode == "in_place" and self.is_pause:
            return False, ("Weights were updated, but the cache was not flushed because requests are still "
                           "running or queued. Retract or finish them, then call /flush_cache."), 0
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return True, "Succeeded to update model weights.", 0


class _Null:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *a):
        return False


def sglang_app(api_key: str | None, admin_api_key: str | None):
    hs = __import__("sglang.srt.entrypoints.http_server", fromlist=["app"])
    from types import SimpleNamespace

    from sglang.srt.runtime_context import get_context

    tm = StubTokenizerManager()
    hs.set_global_state(hs._GlobalState(tokenizer_manager=tm, template_manager=None, scheduler_info={}))
    # launch_server publishes the ServerArgs into config bags; the routes under test read only
    # these fields of the "serving" bag.
    get_context()._config_bags = {"serving": SimpleNamespace(
        api_key=api_key, admin_api_key=admin_api_key, tokenizer_path=tm.model_path,
        preferred_sampling_params=None)}
    if api_key or admin_api_key or hs.app_has_admin_force_endpoints(hs.app):
        from sglang.srt.utils.auth import add_api_key_middleware

        add_api_key_middleware(hs.app, api_key=api_key, admin_api_key=admin_api_key)
    # The real lifespan starts the tokenizer manager, warmup and gRPC: not here.
    hs.app.router.lifespan_context = _no_lifespan
    return hs.app, tm


from contextlib import asynccontextmanager  # noqa: E402


@asynccontextmanager
async def _no_lifespan(app):
    yield


# ------------------------------------------------------------------------------------- common
def add_stub_routes(app, engine):
    from fastapi import Request
    from starlette.middleware.base import BaseHTTPMiddleware

    class Record(BaseHTTPMiddleware):
        async def dispatch(self, request, call_next):
            if not request.url.path.startswith("/_stub"):
                body = (await request.body()).decode(errors="replace")
                entry = {"method": request.method, "path": request.url.path, "query": request.url.query,
                         "body": body, "auth": request.headers.get("authorization") is not None, "t": time.time()}
                F.calls.append(entry)
                resp = await call_next(request)
                entry["status"] = resp.status_code
                return resp
            return await call_next(request)

    app.add_middleware(Record)

    @app.get("/_stub/calls")
    async def calls():
        return {"calls": F.calls, "paused": getattr(engine, "paused", getattr(engine, "is_pause", None)),
                "running": F.running, "max_concurrent_loads": getattr(engine, "max_concurrent_loads", None),
                "model_path": engine.model_path}

    @app.get("/_stub/weights")
    async def weights():
        import hashlib

        w = getattr(engine, "weights", {})
        return {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in w.items()}

    @app.post("/_stub/faults")
    async def faults(request: Request):
        for k, v in (await request.json()).items():
            if k == "clear_calls":
                F.calls.clear()
            else:
                setattr(F, k, v)
        return {"ok": True}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("engine", choices=["vllm", "sglang"])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--api-key")
    p.add_argument("--admin-api-key")
    p.add_argument("--ready-file")
    a = p.parse_args()
    if a.engine == "vllm":
        shims.install()
        app, engine = vllm_app(a.api_key)
    else:
        shims.install(extra=SGLANG_INTERNALS)
        app, engine = sglang_app(a.api_key, a.admin_api_key)
    add_stub_routes(app, engine)
    import socket

    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", a.port))
    # Listening before the ready file is written: a client that connects while uvicorn is
    # still starting waits in the backlog instead of being refused (uvicorn listens again on
    # the same socket, which only resets the backlog).
    sock.listen(2048)
    port = sock.getsockname()[1]
    print(f"stub {a.engine} on http://127.0.0.1:{port}", flush=True)
    if a.ready_file:
        with open(a.ready_file + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(a.ready_file + ".tmp", a.ready_file)
    config = uvicorn.Config(app, log_level="warning", loop="asyncio")
    server = uvicorn.Server(config)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
