"""sys.modules shims for the engines' heavy third-party dependencies.

The contract tests import vLLM's and SGLang's own HTTP route modules unchanged. Those modules
pull in packages that need a GPU or gigabytes of wheels (torch, triton, transformers, CUDA
kernels). Only those *third-party* packages are replaced, by the permissive stand-ins below;
every module of vllm/ and sglang/ that the routes import is the engine's own code. The list of
stubbed top-level packages is ``HEAVY`` (and, per engine, the ``extra`` argument of
:func:`install`); anything not listed must import for real (fastapi, pydantic, msgspec, ...).

A stand-in is a module whose every attribute is a class (so it can be subclassed, used in
annotations, ``isinstance`` checks and ``X | None``); calling a stand-in returns an instance
that is falsy, iterable as empty, and that returns its argument when used as a decorator.
Nothing computed by a stand-in is used by the code paths the tests exercise: the engine
internals those routes reach are replaced by the stub engines in ``stub_vllm.py`` and
``stub_sglang.py``.
"""

from __future__ import annotations

import abc
import importlib.abc
import importlib.machinery
import sys
import types

HEAVY = (
    "torch", "torchvision", "torchaudio", "triton",
    "sentencepiece", "xgrammar", "outlines", "outlines_core", "lm_format_enforcer",
    "llguidance", "flashinfer", "flash_attn", "vllm_flash_attn", "sgl_kernel", "cuda", "pynvml",
    "nvidia", "ray", "deep_gemm", "deep_ep", "mooncake", "torch_memory_saver", "decord", "av",
    "compressed_tensors", "gguf", "mistral_common", "openai_harmony", "tiktoken", "cv2", "PIL",
    "soundfile", "librosa", "einops", "blake3", "cbor2", "numba", "partial_json_parser",
    "datasets", "diskcache", "lark", "opentelemetry", "setproctitle", "py_cpuinfo", "cpuinfo",
    "quack", "cutlass", "tvm_ffi", "apache_tvm_ffi", "nixl", "modelscope", "hf_transfer",
    "interegular", "xformers", "torchao", "kernels", "flashmla", "aiter", "amdsmi", "pybase64",
    "grpc", "grpcio", "watchfiles", "llvmlite", "scipy", "pandas",
    "sglang_router", "sgl_diffusion", "IPython", "ijson", "timm", "accelerate", "peft",
)
STUBBED: list[str] = []


class _Meta(abc.ABCMeta):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        sub = _make(f"{cls.__name__}.{name}")
        type.__setattr__(cls, name, sub)
        return sub

    def __call__(cls, *a, **k):
        if len(a) == 1 and not k and callable(a[0]) and not isinstance(a[0], _Meta):
            return a[0]  # used as a decorator: @torch.compile, @triton.jit
        return type.__call__(cls)

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return True

    def __mro_entries__(cls, bases):
        return (cls,)

    def __int__(cls):
        return 0

    __index__ = __int__

    def __float__(cls):
        return 0.0

    def __len__(cls):
        return 0

    def __neg__(cls):
        return cls

    __pos__ = __abs__ = __invert__ = __neg__

    def __add__(cls, other):
        return cls

    def __radd__(cls, other):
        return other

    __sub__ = __mul__ = __truediv__ = __floordiv__ = __mod__ = __pow__ = __add__
    __rsub__ = __rmul__ = __rtruediv__ = __rfloordiv__ = __radd__

    def __lt__(cls, other):
        return False

    __gt__ = __le__ = __ge__ = __lt__


class _Base(metaclass=_Meta):
    def __init__(self, *a, **k):
        pass

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        from pydantic_core import core_schema

        return core_schema.any_schema()

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name == "name":  # torch.library.Library(...).m.name is used as an attribute name
            return "shim"
        return _make(name)()

    def __call__(self, *a, **k):
        if len(a) == 1 and not k and callable(a[0]):
            return a[0]
        return _make("result")()

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getitem__(self, item):
        return self

    def __int__(self):
        return 0

    def __index__(self):
        return 0

    def __float__(self):
        return 0.0

    def __len__(self):
        return 0

    def __add__(self, other):
        return self

    def __radd__(self, other):
        return other

    __sub__ = __mul__ = __truediv__ = __floordiv__ = __mod__ = __pow__ = __and__ = __add__
    __rsub__ = __rmul__ = __rtruediv__ = __rand__ = __radd__

    def __neg__(self):
        return self

    __pos__ = __abs__ = __invert__ = __neg__

    def __lt__(self, other):
        return False

    __gt__ = __le__ = __ge__ = __lt__

    def __contains__(self, item):
        return False

    def __hash__(self):
        return id(self)

    def __str__(self):
        return ""


def _make(name: str):
    return _Meta(name.rsplit(".", 1)[-1], (_Base,), {"__module__": "shim", "__qualname__": name})


# Attributes that must stay absent so the engines' platform probes (``hasattr(torch, "npu")``)
# pick plain CUDA code paths.
ABSENT = {"torch": {"npu"}}


# The few values the engines' import-time probes compare against (a CUDA build of torch 2.9 on a
# Hopper GPU); everything else is a stand-in.
VALUES = {
    "torch": {"__version__": "2.9.1"},
    "torch.version": {"cuda": "12.8", "hip": None, "__version__": "2.9.1"},
    "torch.cuda": {
        "is_available": lambda *a, **k: True,
        "get_device_capability": lambda *a, **k: (9, 0),
        "device_count": lambda *a, **k: 1,
    },
}


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__") or name in ABSENT.get(self.__name__, ()):
            raise AttributeError(name)
        val = _make(f"{self.__name__}.{name}")
        setattr(self, name, val)
        return val


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == r or fullname.startswith(r + ".") for r in self.roots):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Module(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0+shim"
        for k, v in VALUES.get(spec.name, {}).items():
            setattr(m, k, v)
        return m

    def exec_module(self, module):
        STUBBED.append(module.__name__)


def install(extra=()) -> None:
    """Puts the stand-ins first on ``sys.meta_path`` for ``HEAVY`` + ``extra`` packages."""
    for root in (*HEAVY, *extra):
        for k in [k for k in sys.modules if k == root or k.startswith(root + ".")]:
            del sys.modules[k]
    sys.meta_path.insert(0, _Finder((*HEAVY, *extra)))
