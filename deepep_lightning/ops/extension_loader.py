"""Load the C++/CUDA extension once per process: the compiled module, else a JIT build.

:class:`ExtensionLoader` is the load: once, thread-safe, hooks run after it, one warning on a fallback;
:data:`LOADER` is the process's loader, which :func:`extension_available` and the other functions here
consult. :func:`build_and_load` and :func:`jit_build_and_load` are what it runs.

A package installed with ``DEEPEP_LIGHTNING_BUILD_EXTENSION`` set carries the extension compiled at
install time (``deepep_lightning/_C*.so``, built by ``setup.py`` with
:class:`torch.utils.cpp_extension.BuildExtension`); the loader loads it and needs no compiler. Otherwise
(and when that module does not load, or in a checkout whose sources are newer than it) every
``extensions/csrc/*.cpp`` and, when CUDA is usable (a CUDA build of torch, a GPU and ``nvcc``), every
``extensions/csrc/cuda/*.cu``, and the same of the DeepEP workload's ``extensions/csrc/deepep``
(in a built package: ``deepep_lightning/_csrc``, see :func:`csrc_dir`)
is compiled into one library with :func:`torch.utils.cpp_extension.load` and loaded with
``torch.ops.load_library`` semantics, so adding an op is adding files: its C++ sources here, a Python
module that calls :func:`register_op_python_side` (built on :func:`on_extension_loaded`) for its
``register_fake`` / ``register_autograd``. Both builds take their sources and flags from
:mod:`deepep_lightning.ops._build_config`.

The JIT build is cached (:mod:`deepep_lightning.ops._build_cache`: ``$TORCH_EXTENSIONS_DIR``, else a
directory keyed by interpreter, torch and CUDA); later processes only re-link when a source changed. A
load that compiles prints one line before and one after, on rank 0. CUDA code is built for sm_90
unless ``TORCH_CUDA_ARCH_LIST`` is set, which torch then honours. When the build fails (no compiler, no
ninja) the ops fall back to the pure-PyTorch references and ONE warning says so;
``DEEPEP_LIGHTNING_DISABLE_EXTENSION=1`` selects the references without trying (and without a warning).
"""

import importlib.machinery
import logging
import os
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from deepep_lightning.ops import _build_config
from deepep_lightning.ops._build_cache import BuildAnnouncement, build_directory, needs_compile

__all__ = [
    "LOADER",
    "ExtensionLoader",
    "build_and_load",
    "build_hint",
    "compiled_module_in",
    "compiled_module_path",
    "csrc_dir",
    "cuda_kernels_available",
    "extension_available",
    "extension_error",
    "extension_library",
    "jit_build_and_load",
    "on_extension_loaded",
    "register_op_python_side",
    "sources",
]

log = logging.getLogger(__name__)

DISABLE_ENV = "DEEPEP_LIGHTNING_DISABLE_EXTENSION"
VERBOSE_ENV = "DEEPEP_LIGHTNING_VERBOSE_BUILD"
# an op whose CUDA kernel a compiled module holds exactly when it was built with the CUDA sources
_CUDA_PROBE_OP = "deepep_lightning::grid_sample_bilinear2d_backward"


def csrc_dir() -> Path:
    """The extension sources: the checkout's ``extensions/csrc``, else the installed package's ``_csrc``.

    A source checkout (editable install, ``PYTHONPATH``) builds from ``<repo>/extensions/csrc``, so edits
    there take effect; a built package (``pip install .``, a wheel) carries a copy as
    ``deepep_lightning/_csrc`` (setup.py's ``build_py``). When neither exists the checkout path is
    returned, and :func:`sources` names both in its error.
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
    ``nvcc`` gets the loader's own warning (:func:`jit_build_and_load`).
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


def build_hint(err: Exception) -> str:
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


def sources(with_cuda: bool) -> list[str]:
    """The C++ sources (and, ``with_cuda``, the CUDA sources) of the one library, plugin's and workload's."""
    sources = _build_config.source_files(csrc_dir(), with_cuda)
    if not sources:
        package = Path(__file__).resolve().parents[1]
        raise _MissingSourcesError(
            f"no C++ sources under {str(csrc_dir())!r} nor {str(package / '_csrc')!r}: this install of "
            "deepep_lightning lacks its package data"
        )
    return [str(path) for path in sources]


def compiled_module_path() -> Path | None:
    """The extension compiled at install time (``deepep_lightning/_C*.so``), or ``None`` without one.

    In a source checkout a compiled module older than a source or header of ``extensions/csrc`` is
    ignored (``None``), so an edited kernel is JIT-built rather than shadowed by a stale build.
    """
    package = Path(__file__).resolve().parents[1]
    root = csrc_dir()
    return compiled_module_in(package, root if root != package / "_csrc" else None)


def compiled_module_in(package: Path, checkout_sources: Path | None) -> Path | None:
    """The compiled module in ``package``, unless a file under ``checkout_sources`` is newer than it."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = package / f"{_build_config.COMPILED_MODULE}{suffix}"
        if not path.is_file():
            continue
        if checkout_sources is not None and _build_config.newest_source_mtime(checkout_sources) > path.stat().st_mtime:
            log.info("deepep_lightning.ops: %s is older than the sources in %s; JIT-building", path, checkout_sources)
            return None
        return path
    return None


def _load_compiled(path: Path) -> bool:
    """Loads the compiled module; returns whether its CUDA kernels are usable here."""
    torch.ops.load_library(str(path))
    try:
        has_cuda_kernels = torch._C._dispatch_has_kernel_for_dispatch_key(_CUDA_PROBE_OP, "CUDA")
    except RuntimeError:  # the module defines no such op: nothing to run on CUDA
        has_cuda_kernels = False
    if torch.cuda.is_available() and not has_cuda_kernels:
        warnings.warn(
            f"deepep_lightning.ops: the compiled extension {str(path)!r} holds the CPU kernels only, so CUDA "
            f"tensors use the pure-PyTorch references. HINT: reinstall with {_build_config.AOT_BUILD_ENV}=1 "
            "where nvcc is found, or uninstall it and let the JIT build compile the CUDA kernels.",
            RuntimeWarning,
            stacklevel=5,
        )
    return bool(has_cuda_kernels and torch.cuda.is_available())


def build_and_load() -> tuple[Path, bool]:
    """Loads the compiled module, else builds (or re-uses) the JIT library; returns the library loaded and
    whether the CUDA kernels are in it."""
    compiled = compiled_module_path()
    if compiled is not None:
        try:
            with_cuda = _load_compiled(compiled)
        except OSError as err:  # built for another torch or platform: the JIT build still works
            warnings.warn(
                f"deepep_lightning.ops: the compiled extension {str(compiled)!r} does not load "
                f"({str(err).splitlines()[0][:300]}); JIT-building it from the sources instead. HINT: "
                "reinstall deepep_lightning against this torch.",
                RuntimeWarning,
                stacklevel=4,
            )
        else:
            return compiled, with_cuda
    return jit_build_and_load()


def jit_build_and_load() -> tuple[Path, bool]:
    """Builds the library from :func:`sources` (or finds it in the build cache), loads it; returns the library
    and whether the CUDA kernels are in it. A load that compiles prints one line before and one after."""
    _import_cpp_extension_quietly()
    from torch.utils.cpp_extension import load

    with_cuda = _cuda_buildable()
    if torch.cuda.is_available() and not with_cuda:
        warnings.warn(
            "deepep_lightning.ops: a GPU is visible but nvcc was not found, so only the CPU kernels "
            "are built; CUDA tensors use the pure-PyTorch references. HINT: install the CUDA "
            "toolkit (nvcc) or set CUDA_HOME.",
            RuntimeWarning,
            stacklevel=5,
        )
    # Distinct names keep a CPU-only and a CUDA build of one checkout apart in the cache.
    name = _build_config.JIT_NAME + ("_cuda" if with_cuda else "_cpu")
    files = sources(with_cuda)
    directory = build_directory(name)
    announcement = BuildAnnouncement(directory, files) if needs_compile(directory, name, csrc_dir()) else None
    if announcement is not None:
        announcement.start()
    load(
        name=name,
        sources=files,
        extra_cflags=list(_build_config.CXX_FLAGS),
        extra_cuda_cflags=_build_config.cuda_flags(),
        extra_include_paths=[str(csrc_dir())],
        build_directory=str(directory),
        with_cuda=with_cuda,
        is_python_module=False,
        verbose=os.environ.get(VERBOSE_ENV, "0") == "1",
    )
    if announcement is not None:
        # ninja leaves the library as it is when no source it compiles changed (a .cu edited before a CPU-only
        # build): marking it current keeps the next load from announcing a build again
        (directory / f"{name}.so").touch()
        announcement.done()
    return directory / f"{name}.so", with_cuda


class ExtensionLoader:
    """The extension's load: ``build`` runs at most once (thread-safe), the hooks after it, one warning on a
    failure.

    Args:
        build: loads the library; returns it and whether it holds the CUDA kernels
            (:func:`build_and_load`). An exception means: fall back to the references, with one warning.

    ``DEEPEP_LIGHTNING_DISABLE_EXTENSION=1`` at the first :meth:`load` selects the references without trying.
    """

    def __init__(self, build: Callable[[], tuple[Path, bool]]) -> None:
        self._build = build
        self._lock = threading.RLock()  # re-entrant: a hook may query the loader
        self._hooks: list[Callable[[], None]] = []
        self.attempted = False
        self.loaded = False
        self.with_cuda = False
        self.error: str | None = None
        self.library: Path | None = None

    def load(self) -> bool:
        """Loads the library on the first call (later calls wait for it); returns whether it is loaded."""
        if self.attempted:  # fast path, no lock: the state is final once ``attempted`` is set
            return self.loaded
        with self._lock:
            if self.attempted:
                return self.loaded
            if os.environ.get(DISABLE_ENV, "0") == "1":
                self.error = f"disabled by {DISABLE_ENV}=1"
                log.info("deepep_lightning.ops: C++ extension %s; using the PyTorch references", self.error)
            else:
                try:
                    self.library, with_cuda = self._build()
                    self.with_cuda = bool(with_cuda)
                    for hook in self._hooks:
                        hook()
                    self.loaded = True
                except Exception as err:  # noqa: BLE001 - any build failure means: fall back
                    self.error = f"{type(err).__name__}: {err}"
                    first_line = self.error.strip().splitlines()[0][:300]
                    warnings.warn(
                        "deepep_lightning.ops: could not build/load the C++ extension "
                        f"({first_line}); falling back to the pure-PyTorch reference ops (same "
                        f"results up to fp32 rounding, slower, more memory). HINT: {build_hint(err)}; "
                        "deepep_lightning.ops.extension_error() holds the whole "
                        f"build log ({VERBOSE_ENV}=1 prints it live); {DISABLE_ENV}=1 uses the "
                        "references without this warning.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
            self.attempted = True
            return self.loaded

    def on_loaded(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once the library is loaded (now, if it already is)."""
        with self._lock:
            self._hooks.append(hook)
            if self.loaded:
                hook()


#: The process's loader: every function below and every op consults it.
LOADER = ExtensionLoader(build_and_load)


# torch.compile runs this once while tracing and bakes in the answer, instead of tracing the
# build (locks, files) and breaking the graph.
@torch.compiler.assume_constant_result
def extension_available() -> bool:
    """Whether the compiled ops (``torch.ops.deepep_lightning``, and the workload's ``torch.ops.deepep``) are
    usable; builds them on the first call.

    Returns:
        ``True`` when the extension is built and loaded, ``False`` when the ops fall back to the
        pure-PyTorch references (one ``RuntimeWarning`` per process says why).

    Example::

        >>> from deepep_lightning.ops import extension_available
        >>> extension_available()  # doctest: +SKIP
        True
    """
    return LOADER.load()


@torch.compiler.assume_constant_result
def cuda_kernels_available() -> bool:
    """Whether the loaded extension also holds the CUDA kernels (builds it on the first call)."""
    return LOADER.load() and LOADER.with_cuda


def extension_error() -> str | None:
    """Why the extension is not available (``None`` when it is, or was not tried yet)."""
    return LOADER.error


def extension_library() -> Path | None:
    """The library the ops were loaded from: the compiled module or the JIT build (``None`` before or
    without a load)."""
    return LOADER.library


def on_extension_loaded(hook: Callable[[], None]) -> None:
    """Run ``hook`` once the library is loaded (now, if it already is).

    Op modules register their ``register_fake`` / ``register_autograd`` this way: those need the
    C++ schema, which exists only after the library is loaded.
    """
    LOADER.on_loaded(hook)


def register_op_python_side(
    op: str,
    fake_forward: Callable,
    fake_backward: Callable,
    backward: Callable | None = None,
    setup_context: Callable | None = None,
    *,
    namespace: str = "deepep_lightning",
) -> None:
    """Once the library is loaded: ``register_fake`` for ``<namespace>::<op>`` and
    ``<namespace>::<op>_backward``, and, when ``backward`` is given, ``register_autograd`` for
    ``<namespace>::<op>`` (exactly once). Ops whose autograd is registered in C++ (``refused_ops.cpp``)
    pass no ``backward``; a workload's ops built into the same library pass their own ``namespace``
    (DeepEP's: ``"deepep"``)."""
    registered = False

    def register() -> None:
        nonlocal registered
        if registered:
            return
        torch.library.register_fake(f"{namespace}::{op}")(fake_forward)
        torch.library.register_fake(f"{namespace}::{op}_backward")(fake_backward)
        if backward is not None:
            torch.library.register_autograd(f"{namespace}::{op}", backward, setup_context=setup_context)
        registered = True

    on_extension_loaded(register)
