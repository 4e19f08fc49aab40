"""benchmarks/bench_zoo.py on the CPU: verdicts, tax and attribution from real fits in fresh processes.

The module fixture drives ``tiny_mlp`` through two ``plugin`` verdict processes in parallel and two alternations
of ``plain``/``plugin`` timing processes, then the planted ``planted_nondeterministic`` model (its loss factor is
a float sum in an order drawn from the process id) through its two verdict processes, into one result. The rest
checks the driver's bookkeeping in-process: the verdict vocabulary, the tax, the attribution diff, the profile
table, skipped packages, the budget and bad input.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_zoo  # noqa: E402
import zoo_table  # noqa: E402
import zoo_verdicts  # noqa: E402
import zoo_worker  # noqa: E402
from zoo_models import ZooModel, ZooTask  # noqa: E402

FAST = ["--device", "cpu", "--warmup", "1", "--steps", "3", "--profile-steps", "1", "--verdict-steps", "3"]


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory) -> tuple[Path, dict]:
    """Two driver calls into one result (in this process; every fit in a fresh one): ``tiny_mlp`` with verdicts
    and two timing alternations, then the planted model's verdict alone (8 fits, ~5 s of start-up each)."""
    out = tmp_path_factory.mktemp("zoo")
    assert bench_zoo.main(["--out", str(out), *FAST, "--models", "tiny_mlp", "--verdict-modes", "plugin"]) == 0
    planted = ["--models", "planted_nondeterministic", "--verdict-modes", "plugin", "--stages", "verdict"]
    assert bench_zoo.main(["--out", str(out), *FAST, *planted]) == 0
    return out, json.loads((out / "zoo.json").read_text())


@pytest.mark.slow  # 8 fresh fits
def test_a_deterministic_model_is_bitwise_and_its_tax_and_attribution_are_filled(zoo_run):
    _, result = zoo_run
    record = result["models"]["tiny_mlp"]
    assert record["plugin"]["verdict"] == "bitwise" and record["plugin_timing_runs"]["verdict"] == "bitwise"
    timing = record["tax"]
    assert len(timing["alternations"]) == 2
    assert timing["plain_median_ms"] > 0 and timing["plugin_median_ms"] > 0
    assert timing["tax"] == pytest.approx(timing["plugin_median_ms"] / timing["plain_median_ms"], rel=1e-3)
    # step end to step end: the step and what runs between steps, so never shorter than the step's median
    assert timing["plain_iteration_ms"] >= timing["plain_median_ms"] * 0.9
    assert timing["iteration_tax"] == pytest.approx(
        timing["plugin_iteration_ms"] / timing["plain_iteration_ms"], rel=1e-3
    )
    assert "iteration_tax_median" in result["summary"]
    assert {"kernels", "ops"} <= record["attribution"].keys()  # CPU: op times, no kernels
    assert record["timing_wall_s"] > 0 and record["verdict_wall_s"] > 0  # what the integrator plans with
    assert record["timing_device"] == "cpu"
    # configure() sets the cuBLAS variable; only a CUDA run releases it at train start
    assert record["plugin_cublas_workspace_config"] == [":4096:8", ":4096:8"]
    assert record["wall_s"] == round(record["verdict_wall_s"] + record["timing_wall_s"], 1)
    assert result["summary"]["timed"] == 1 and result["environment"]["torch"] == torch.__version__


@pytest.mark.slow
def test_the_planted_nondeterministic_model_comes_out_differs(zoo_run):
    _, result = zoo_run
    record = result["models"]["planted_nondeterministic"]
    assert record["plugin"]["verdict"] == "differs", record["plugin"]
    assert record["plugin"]["detail"].startswith("loss at step 0")  # the first difference is named
    assert "tensors, first 'hidden.0.weight'" in record["plugin"]["detail"]
    assert "tax" not in record and "timing_wall_s" not in record  # --stages verdict
    summary = result["summary"]
    assert summary["verdicts"]["plugin"] == {"bitwise": 1, "differs": 1}
    assert summary["met"]["plugin_bitwise"] is False


@pytest.mark.slow
def test_the_table_and_a_later_call_within_its_budget_keep_the_earlier_results(zoo_run):
    out, _ = zoo_run
    table = (out / "zoo_table.md").read_text().splitlines()
    assert table[2].startswith("| tiny_mlp | 32-true | bitwise |") and "**" in table[2]
    assert table[3].startswith("| planted_nondeterministic | 32-true | differs: loss at step 0")
    # in-process: past its budget before the first model, so no fit starts
    assert bench_zoo.main(["--out", str(out), *FAST, "--models", "tiny_cnn", "--budget-s", "1e-9"]) == 0
    result = json.loads((out / "zoo.json").read_text())
    assert result["not_run"] == ["tiny_cnn"]
    assert set(result["models"]) == {"tiny_mlp", "planted_nondeterministic"}


def _report(losses=("0x1.0p+0", "0x1.8p-1"), tensors=None, **extra) -> dict:
    tensors = tensors or {"a.weight": "11", "b.weight": "22"}
    return {"losses": list(losses), "tensor_digests": tensors, "digest": "".join(tensors.values()), **extra}


def test_verdicts_name_the_first_difference_and_the_first_line_of_an_error():
    assert zoo_verdicts.verdict([_report(), _report()])["verdict"] == "bitwise"
    differs = zoo_verdicts.verdict([_report(), _report(tensors={"a.weight": "11", "b.weight": "23"})])
    assert differs == {"verdict": "differs", "detail": "1 tensors, first 'b.weight'"}
    loss = zoo_verdicts.verdict([_report(), _report(losses=("0x1.0p+0", "0x1.8000000000001p-1"))])
    assert loss["verdict"] == "differs" and loss["detail"].startswith("loss at step 1: 0.75 vs 0.75000")
    error = {
        "type": "RuntimeError",
        "message": "nll_loss2d_forward_out_cuda_template does not have a deterministic\nmore",
    }
    raised = zoo_verdicts.verdict([_report(), {"error": error}])
    assert raised == {
        "verdict": "raises",
        "detail": "RuntimeError: nll_loss2d_forward_out_cuda_template does not have a deterministic",
        "error": error,
    }
    with pytest.raises(ValueError, match="at least two runs to compare, got 1"):
        zoo_verdicts.verdict([_report()])


def test_the_tax_is_the_ratio_of_medians_and_attribution_names_the_kernel_that_grew():
    def timed(ms, kernels):
        return {"median_ms": ms, "step_ms": [100.0, ms, ms, ms], "profile": {"kernels": kernels, "ops": []}}

    gemm = {"name": "gemm", "ms": 2.0}
    pairs = [(timed(4.0, [gemm]), timed(5.0, [gemm, {"name": "radix_sort", "ms": 0.9}]))] * 2
    result = zoo_verdicts.tax(pairs, warmup=1, steps=3)
    assert result["tax"] == 1.25 and [row["tax"] for row in result["alternations"]] == [1.25, 1.25]
    assert "iteration_tax" not in result  # runs that did not record iterations
    # iteration_ms[i] ends with step i + 1: with warmup=1 the timed iterations are [0, 3), not the slow 4th
    plain, plugin = timed(4.0, [gemm]), timed(5.0, [gemm])
    plain["iteration_ms"], plugin["iteration_ms"] = [6.0, 6.0, 6.0, 90.0], [8.0, 8.0, 8.0, 90.0]
    whole = zoo_verdicts.tax([(plain, plugin)] * 2, warmup=1, steps=3)
    assert (whole["plain_iteration_ms"], whole["plugin_iteration_ms"], whole["iteration_tax"]) == (6.0, 8.0, 1.3333)
    grown = zoo_verdicts.attribution([plain for plain, _ in pairs], [plugin for _, plugin in pairs])
    assert grown["kernels"] == [{"name": "radix_sort", "plain_ms": 0.0, "plugin_ms": 0.9, "grown_ms": 0.9}]
    assert grown["kernels_total_ms"] == {"plain": 2.0, "plugin": 2.9}
    assert grown["host"] == [] and grown["host_total_ms"] == {"plain": 0.0, "plugin": 0.0}  # no host rows given


def test_a_model_whose_package_is_missing_is_skipped_without_a_process(tmp_path, monkeypatch):
    absent = ZooModel("needs_absent", ("test",), ("deepep_no_such_package",), lambda generator: ZooTask(None, [], None))  # type: ignore[arg-type]
    monkeypatch.setattr(bench_zoo, "select_models", lambda selection: [absent])
    assert bench_zoo.main(["--out", str(tmp_path), "--models", "tiny_mlp"]) == 0
    record = json.loads((tmp_path / "zoo.json").read_text())["models"]["needs_absent"]
    assert record["skipped"] == "deepep_no_such_package not installed" and "plugin" not in record
    assert not (tmp_path / "runs").exists()


def test_a_failing_run_is_reported_with_its_type_message_and_frames(tmp_path):
    out = tmp_path / "run.json"
    assert zoo_worker.main(["--model", "no_such_model", "--mode", "plain", "--out", str(out), "--device", "cpu"]) == 0
    report = json.loads(out.read_text())
    assert (
        report["error"]["type"] == "ValueError"
        and "'no_such_model' is neither a model nor a group" in report["error"]["message"]
    )
    assert report["error"]["frames"] and "select_models" in report["error"]["frames"][-1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--parallel", "0"], "--parallel must be >= 1, got 0"),
        (["--budget-s", "0"], "--budget-s must be > 0, got 0.0"),
        (["--models", "resnet"], "--models: 'resnet' is neither a model nor a group"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_zoo._parse(["--out", str(tmp_path), *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_cuda_profile_lists_launched_kernels_and_aten_ops_by_device_time():
    def event(key, device_type, self_device_us=0.0, device_us=0.0, cpu_us=0.0, count=2, kernels=()):
        return SimpleNamespace(
            key=key,
            device_type=device_type,
            self_device_time_total=self_device_us,
            device_time_total=device_us,
            self_cpu_time_total=cpu_us,
            count=count,
            kernels=[SimpleNamespace(name=name, duration=us) for name, us in kernels],
        )

    indexing = "void at::native::indexing_backward_kernel<float>"
    averages = [
        event("aten::index_put_", DeviceType.CPU, self_device_us=500, device_us=3000, cpu_us=40),
        event("Optimizer.step#AdamW.step", DeviceType.CPU, self_device_us=100, device_us=900),
        event(indexing, DeviceType.CUDA, self_device_us=0),  # a kernel row key_averages counts as 0
        event("cudaLaunchKernel", DeviceType.CPU, cpu_us=70),
    ]
    launches = [  # each kernel once, linked to the launch that started it
        event("cudaLaunchKernel", DeviceType.CPU, kernels=[(indexing, 900.0)]),
        event("cudaLaunchKernel", DeviceType.CPU, kernels=[(indexing, 1100.0), ("gemm", 200.0)]),
        event("aten::index_put_", DeviceType.CPU),
    ]
    profiler = SimpleNamespace(key_averages=lambda: averages, events=lambda: launches)
    table = zoo_worker.profile_table(profiler, steps=2, cuda=True)
    assert table["kernels"] == [
        {"name": indexing, "ms": 1.0, "calls": 1.0},
        {"name": "gemm", "ms": 0.1, "calls": 0.5},
    ]
    assert table["ops"] == [{"name": "aten::index_put_", "ms": 1.5, "calls": 1.0}]
    host = [  # self CPU time of every event: the launches too
        {"name": "cudaLaunchKernel", "ms": 0.035, "calls": 1.0},
        {"name": "aten::index_put_", "ms": 0.02, "calls": 1.0},
    ]
    assert table["host"] == host
    on_cpu = zoo_worker.profile_table(profiler, steps=2, cuda=False)  # ops: self CPU time of aten ops only
    assert on_cpu == {"kernels": [], "ops": [{"name": "aten::index_put_", "ms": 0.02, "calls": 1.0}], "host": host}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_a_real_cuda_profile_has_kernel_rows():
    """The attribution's kernel rows come from a real ``torch.profiler`` run as the zoo worker starts it."""
    weight = torch.randn(512, 512, device="cuda")
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(2):
            (weight @ weight).relu().sum().item()
    table = zoo_worker.profile_table(profiler, steps=2, cuda=True)
    seen = [
        (event.key[:40], str(event.device_type), event.self_device_time_total, event.device_time_total)
        for event in profiler.key_averages()
    ]
    assert table["kernels"] and all(row["ms"] > 0 for row in table["kernels"]), seen
    assert any(row["name"] == "aten::mm" for row in table["ops"]), seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_a_worker_on_cuda_names_its_card_and_profiles_kernels(tmp_path):
    """After fit Lightning has moved the module back to the CPU: the card and the kernel table come from the
    device the steps ran on. The worker runs in its own process, as the driver starts it: the plugin refuses a
    process whose CUDA is already in use, as this test process's may be."""
    out = tmp_path / "run.json"
    command = [sys.executable, zoo_worker.__file__, "--model", "tiny_mlp", "--mode", "plugin", "--out", str(out)]
    subprocess.run([*command, "--device", "cuda", *FAST[2:8]], check=True, timeout=300, env=bench_zoo._worker_env())
    report = json.loads(out.read_text())
    assert "error" not in report, report.get("error")
    assert report["device_name"] == torch.cuda.get_device_name(0)
    assert report["profile"]["kernels"], report["profile"]


def test_a_worker_names_the_forward_and_the_backward_in_its_host_rows(tmp_path):
    """Lightning runs forward and backward inside the optimizer's step: the worker's named ranges keep the host's
    wait for the backward out of ``Optimizer.step``'s self time; the report says which cuBLAS variable ran."""
    out = tmp_path / "run.json"
    command = [sys.executable, zoo_worker.__file__, "--model", "tiny_mlp", "--mode", "plugin", "--out", str(out)]
    subprocess.run([*command, *FAST[:8]], check=True, timeout=300, env=bench_zoo._worker_env())
    report = json.loads(out.read_text())
    assert "error" not in report, report.get("error")
    names = {row["name"] for row in report["profile"]["host"]}
    assert {"zoo::forward", "zoo::backward"} <= names, names
    assert "cublas_workspace_config" in report


def test_the_kernel_ratio_is_plugin_over_plain_kernel_time_and_is_summarised_beside_the_tax():
    def record(tax: float, plain: float | None, plugin: float | None) -> dict:
        attribution = {"kernels_total_ms": {"plain": plain, "plugin": plugin}} if plain is not None else {}
        timing = {"tax": tax, "plain_median_ms": 10.0, "plugin_median_ms": 10.0 * tax, "alternations": [{"tax": tax}]}
        return {"precision": "32-true", "tax": timing, "attribution": attribution}

    results = {
        "host_bound": record(1.3, 6.0, 6.0),
        "kernel_bound": record(1.1, 20.0, 24.0),
        "cpu": record(1.0, None, None),
    }
    assert [zoo_table.kernel_ratio(r) for r in results.values()] == [1.0, 1.2, None]
    summary = zoo_table.summarise(results)
    assert summary["tax_worst"] == ("host_bound", 1.3) and summary["met"]["tax_worst"] is False
    assert summary["kernel_ratio_median"] == 1.1 and summary["kernel_ratio_worst"] == ("kernel_bound", 1.2)
    rows = zoo_table.markdown_table(results).splitlines()
    assert "| 20.0 → 24.0 (1.20) |" in rows[3] and "| 6.0 → 6.0 (1.00) |" in rows[2]
    assert all(row.count("|") == rows[0].count("|") for row in rows)  # every row has every column
