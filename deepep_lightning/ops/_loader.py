"""JIT build and load of the ``deepep`` C++/CUDA extension, once per process.

Every ``extensions/csrc/*.cpp`` and, when CUDA is usable (a CUDA build of torch, a GPU and
``nvcc``), every ``extensions/csrc/cuda/*.cu`` (in a built package: ``deepep_lightning/_csrc``, see
:func:`csrc_dir`) is compiled into one library with
:func:`torch.utils.cpp_extension.load` and loaded with ``torch.ops.load_library`` semantics, so
adding an op is adding files: its C++ sources here, a Python module that calls
:func:`register_op_python_side` (built on :func:`on_extension_loaded`) for its ``register_fake`` /
``register_autograd``.

The build is cached by torch under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``); later processes only re-link when a source changed. CUDA code is
built for sm_90 (``-gencode=arch=compute_90,code=sm_90``) unless ``TORCH_CUDA_ARCH_LIST`` is set,
which torch then honours. When the build fails (no compiler, no ninja) the ops fall back to the
pure-PyTorch references and ONE warning says so; ``DEEPEP_LIGHTNING_DISABLE_EXTENSION=1`` selects
the references without trying (and without a warning).
"""

import logging
import os
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = [
    "extension_available",
    "cuda_kernels_available",
    "extension_error",
    "on_extension_loaded",
    "register_op_python_side",
    "csrc_dir",
]

log = logging.getLogger(__name__)

DISABLE_ENV = "DEEPEP_LIGHTNING_DISABLE_EXTENSION"
VERBOSE_ENV = "DEEPEP_LIGHTNING_VERBOSE_BUILD"
_EXTENSION_NAME = "deepep_lightning_ext"
_SM90_FLAGS = ["-gencode=arch=compute_90,code=sm_90"]

_lock = threading.RLock()  # re-entrant: a hook may query the loader
_attempted = False
_loaded = False
_error: str | None = None
_with_cuda = False
_hooks: list[Callable[[], None]] = []


def csrc_dir() -> Path:
    """The extension sources: the checkout's ``extensions/csrc``, else the installed package's ``_csrc``.

    A source checkout (editable install, ``PYTHONPATH``) builds from ``<repo>/extensions/csrc``, so edits
    there take effect; a built package (``pip install .``, a wheel) carries a copy as
    ``deepep_lightning/_csrc`` (setup.py's ``build_py``). When neither exists the checkout path is
    returned, and :func:`_sources` names both in its error.
    """
    package = Path(__file__).resolve().parents[1]
    checkout = package.parent / "extensions" / "csrc"
    if checkout.is_dir() and (package.parent / "pyproject.toml").is_file():
        return checkout
    installed = package / "_csrc"
    return installed if installed.is_dir() else checkout


def _import_cpp_extension_quietly() -> None:
    """Import ``torch.utils.cpp_extension`` without its "No CUDA runtime is found" line.

    Its import guesses ``CUDA_HOME`` and logs that line on a machine with a CUDA toolkit but no GPU,
    where this loader builds the CPU kernels only and the guess does not matter; a GPU without
    ``nvcc`` gets the loader's own warning (:func:`_build_and_load`).
    """
    cpp_extension_log = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_extension_log.level
    cpp_extension_log.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension  # noqa: F401
    finally:
        cpp_extension_log.setLevel(level)


def _cuda_buildable() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None or not torch.cuda.is_available():
        return False
    nvcc = shutil.which("nvcc") or (CUDA_HOME and os.path.join(CUDA_HOME, "bin", "nvcc"))
    return bool(nvcc and os.path.exists(nvcc))


class _MissingSourcesError(FileNotFoundError):
    """The installed package has no extension sources to build (not a compiler problem)."""


def _build_hint(err: Exception) -> str:
    """What to do about a failed build, from what is missing on this machine."""
    from torch.utils.cpp_extension import is_ninja_available

    if isinstance(err, _MissingSourcesError):
        return (
            "reinstall deepep_lightning from a source checkout (pip install . or pip install -e .) or from a "
            "wheel built by its setup.py, which ships extensions/csrc as deepep_lightning/_csrc"
        )
    compiler = os.environ.get("CXX", "c++")
    missing = [] if shutil.which(compiler) else [f"a C++ compiler ({compiler!r} is not on PATH; or set CXX)"]
    if not is_ninja_available():
        missing.append("ninja (pip install ninja)")
    if missing:
        return "install " + " and ".join(missing)
    return "the compiler and ninja are present, so the build log says what failed"


def _sources(with_cuda: bool) -> list[str]:
    root = csrc_dir()
    sources = sorted(root.glob("*.cpp"))
    if with_cuda:
        sources += sorted((root / "cuda").glob("*.cu"))
    if not sources:
        package = Path(__file__).resolve().parents[1]
        raise _MissingSourcesError(
            f"no C++ sources under {str(root)!r} nor {str(package / '_csrc')!r}: this install of "
            "deepep_lightning lacks its package data"
        )
    return [str(path) for path in sources]


def _build_and_load() -> bool:
    """Builds (or re-uses) and loads the library; returns whether the CUDA kernels are in it."""
    _import_cpp_extension_quietly()
    from torch.utils.cpp_extension import load

    with_cuda = _cuda_buildable()
    if torch.cuda.is_available() and not with_cuda:
        warnings.warn(
            "deepep_lightning.ops: a GPU is visible but nvcc was not found, so only the CPU kernels "
            "are built; CUDA tensors use the pure-PyTorch references. HINT: install the CUDA "
            "toolkit (nvcc) or set CUDA_HOME.",
            RuntimeWarning,
            stacklevel=4,
        )
    cuda_flags = ["-O3"]
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        cuda_flags += _SM90_FLAGS
    # Distinct names keep a CPU-only and a CUDA build of one checkout apart in the cache.
    load(
        name=_EXTENSION_NAME + ("_cuda" if with_cuda else "_cpu"),
        sources=_sources(with_cuda),
        extra_cflags=["-O3", "-ffp-contract=off"],
        extra_cuda_cflags=cuda_flags,
        extra_include_paths=[str(csrc_dir())],
        with_cuda=with_cuda,
        is_python_module=False,
        verbose=os.environ.get(VERBOSE_ENV, "0") == "1",
    )
    return with_cuda


def _load_once() -> bool:
    global _attempted, _loaded, _error, _with_cuda
    if _attempted:  # fast path, no lock: both flags are final once _attempted is set
        return _loaded
    with _lock:
        if _attempted:
            return _loaded
        if os.environ.get(DISABLE_ENV, "0") == "1":
            _error = f"disabled by {DISABLE_ENV}=1"
            log.info("deepep_lightning.ops: C++ extension %s; using the PyTorch references", _error)
        else:
            try:
                _with_cuda = bool(_build_and_load())
                for hook in _hooks:
                    hook()
                _loaded = True
            except Exception as err:  # noqa: BLE001 - any build failure means: fall back
                _error = f"{type(err).__name__}: {err}"
                first_line = _error.strip().splitlines()[0][:300]
                warnings.warn(
                    "deepep_lightning.ops: could not build/load the C++ extension "
                    f"({first_line}); falling back to the pure-PyTorch reference ops (same "
                    f"results up to fp32 rounding, slower, more memory). HINT: {_build_hint(err)}; "
                    "deepep_lightning.ops.extension_error() holds the whole "
                    f"build log ({VERBOSE_ENV}=1 prints it live); {DISABLE_ENV}=1 uses the "
                    "references without this warning.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        _attempted = True
        return _loaded


# torch.compile runs this once while tracing and bakes in the answer, instead of tracing the
# build (locks, files) and breaking the graph.
@torch.compiler.assume_constant_result
def extension_available() -> bool:
    """Whether the compiled ``torch.ops.deepep`` ops are usable; builds them on the first call.

    Returns:
        ``True`` when the extension is built and loaded, ``False`` when the ops fall back to the
        pure-PyTorch references (one ``RuntimeWarning`` per process says why).

    Example::

        >>> from deepep_lightning.ops import extension_available
        >>> extension_available()  # doctest: +SKIP
        True
    """
    return _load_once()


@torch.compiler.assume_constant_result
def cuda_kernels_available() -> bool:
    """Whether the loaded extension also holds the CUDA kernels (builds it on the first call)."""
    return _load_once() and _with_cuda


def extension_error() -> str | None:
    """Why the extension is not available (``None`` when it is, or was not tried yet)."""
    return _error


def on_extension_loaded(hook: Callable[[], None]) -> None:
    """Run ``hook`` once the library is loaded (now, if it already is).

    Op modules register their ``register_fake`` / ``register_autograd`` this way: those need the
    C++ schema, which exists only after the library is loaded.
    """
    with _lock:
        _hooks.append(hook)
        if _loaded:
            hook()


def register_op_python_side(
    op: str,
    fake_forward: Callable,
    fake_backward: Callable,
    backward: Callable | None = None,
    setup_context: Callable | None = None,
) -> None:
    """Once the library is loaded: ``register_fake`` for ``deepep::<op>`` and ``deepep::<op>_backward``,
    and, when ``backward`` is given, ``register_autograd`` for ``deepep::<op>`` (exactly once). Ops whose
    autograd is registered in C++ (``refused_ops.cpp``) pass no ``backward``."""
    registered = False

    def register() -> None:
        nonlocal registered
        if registered:
            return
        torch.library.register_fake(f"deepep::{op}")(fake_forward)
        torch.library.register_fake(f"deepep::{op}_backward")(fake_backward)
        if backward is not None:
            torch.library.register_autograd(f"deepep::{op}", backward, setup_context=setup_context)
        registered = True

    on_extension_loaded(register)
