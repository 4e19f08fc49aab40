"""torch.compile of a routed op whose PyTorch decomposition refuses deterministic mode (max_unpool2d/3d).

On the CPU the routes are installed at the CPU key with a reference implementation standing in for the CUDA
kernel (the wrappers and the tracing are the same). Negative control: without the routes, compiling the op in
deterministic mode raises PyTorch's error while tracing.
"""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from deepep_lightning.ops import _routes, _tracing, extension_available, routed_aten_ops
from deepep_lightning.ops._routes import Route

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")


def _reference_unpool(self, indices, output_size, *_stride_padding):
    """max_unpool by a scatter over each plane (the duplicates of max_pool's indices do not occur here)."""
    planes = self.flatten(-len(output_size))
    out = planes.new_zeros((*planes.shape[:-1], torch.Size(output_size).numel()))
    return out.scatter(-1, indices.flatten(-len(output_size)), planes).view(
        *self.shape[: -len(output_size)], *output_size
    )


@pytest.fixture
def cpu_unpool_routes(monkeypatch):
    """The max_unpool routes with a CPU implementation, installed at CPU; routing and deterministic mode restored."""
    routed_aten_ops()  # every op module registers its routes
    calls: list[str] = []
    for name in ("max_unpool2d", "max_unpool3d"):
        route = _routes.registered_routes()[name]

        def deterministic(*args, _name=name):
            calls.append(_name)
            return _reference_unpool(*args)

        monkeypatch.setitem(_routes._routes, name, Route(name, deterministic, shape_function=route.shape_function))
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    yield calls
    _routes.disable_routes()
    torch.use_deterministic_algorithms(was_deterministic)
    torch._dynamo.reset()


def _pooled(dims):
    x = torch.randn(2, 3, *([8] * dims), generator=torch.Generator().manual_seed(0))
    pool = F.max_pool2d if dims == 2 else F.max_pool3d
    return pool(x, 2, return_indices=True)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("dims", [2, 3])
def test_compiled_max_unpool_calls_the_route_in_deterministic_mode(cpu_unpool_routes, monkeypatch, backend, dims):
    monkeypatch.setenv("CI", "1")  # inductor refuses an aten fallback for an op with a registered decomposition then
    unpool = F.max_unpool2d if dims == 2 else F.max_unpool3d
    pooled, indices = _pooled(dims)
    expected = _reference_unpool(pooled, indices, [8] * dims) * 2
    if backend == "inductor":  # an inductor compile before the routes caches inductor's decomposition table
        torch._dynamo.reset()
        torch.compile(lambda x: x * 2 + 1, backend="inductor")(torch.randn(4))
    _routes.enable_routes("CPU")
    torch.use_deterministic_algorithms(True)
    assert set(_tracing.installed_shape_functions()) == {"max_unpool2d", "max_unpool3d"}
    leaf = pooled.clone().requires_grad_()
    eager_grad = torch.autograd.grad((unpool(leaf, indices, 2) * 2).square().sum(), leaf)[0]
    torch._dynamo.reset()
    compiled = torch.compile(lambda p, i: unpool(p, i, 2) * 2, backend=backend, fullgraph=True)
    with torch.compiler.config.patch(force_disable_caches=True):  # lowered afresh: a cached compile skips lowering
        out = compiled(leaf, indices)
        grad = torch.autograd.grad(out.square().sum(), leaf)[0]
    assert torch.equal(out.detach(), expected)
    assert torch.equal(grad, eager_grad)  # the backward traces too
    assert cpu_unpool_routes.count(f"max_unpool{dims}d") >= 2  # eager and the compiled graph called the route


def test_without_the_routes_compiling_max_unpool_meets_pytorchs_refusal_and_the_tables_are_restored(
    cpu_unpool_routes,
):
    from torch._decomp import decomposition_table, meta_table

    op = torch.ops.aten.max_unpool2d.default
    before = (op in meta_table, dict(op.py_kernels).get(torch._C.DispatchKey.Meta), decomposition_table.get(op))
    assert before[2] is not None  # PyTorch registers a decomposition, which the route sets aside
    _routes.enable_routes("CPU")
    assert op in meta_table and op not in decomposition_table
    _routes.disable_routes()
    assert _tracing.installed_shape_functions() == []
    assert (op in meta_table, dict(op.py_kernels).get(torch._C.DispatchKey.Meta), decomposition_table.get(op)) == before
    torch.use_deterministic_algorithms(True)
    pooled, indices = _pooled(2)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="max_unpooling2d_forward_out does not have a deterministic implementation"):
        torch.compile(lambda p, i: F.max_unpool2d(p, i, 2), backend="eager", fullgraph=True)(pooled, indices)
    assert cpu_unpool_routes == []


def test_a_route_does_not_import_inductor_and_inductor_imported_later_leaves_the_op_to_the_route(tmp_path):
    """Inductor's table is built from PyTorch's at its import: an op set aside before then is missing from both,
    and removing the route puts it back in both (a fresh process: inductor is not imported yet)."""
    script = tmp_path / "later_inductor.py"
    script.write_text(
        "import sys\n"
        "import torch\n"
        "from torch._decomp import decomposition_table\n"
        "from deepep_lightning.ops import _tracing\n"
        "NAME = 'torch._inductor.decomposition'\n"
        "op = torch.ops.aten.max_unpool2d.default\n"
        "assert NAME not in sys.modules, 'imported before the test'\n"
        "original = decomposition_table[op]\n"
        "assert _tracing.install_shape_function('max_unpool2d', lambda self, *args: self.new_empty(self.shape))\n"
        "assert NAME not in sys.modules, 'the route imported inductor'\n"
        "import torch._inductor.decomposition as inductor\n"
        "assert op not in inductor.decompositions and op not in decomposition_table\n"
        "_tracing.remove_shape_function('max_unpool2d')\n"
        "assert decomposition_table[op] is original and inductor.decompositions[op] is original\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
