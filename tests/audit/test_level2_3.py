"""L2/L3 audits of LightningModules (deepep_lightning/audit/level2_3.py, targets.py), with negative controls."""

import pytest
import torch

from deepep_lightning.audit.causes import base_name
from deepep_lightning.audit.level2_3 import audit_module
from deepep_lightning.audit.targets import ModuleTarget, load_class, load_config

TINY_DEEPEP = {  # DeepEPModule's arguments as a config file's model: section gives them
    "env": {"num_envs": 4, "rollout_length": 6, "steps_per_epoch": 4},
    "network": {"hidden_size": 8},
    "execution": {"fused_value_head": False},
}


@pytest.mark.parametrize("level", ["L2", "L3"])
def test_clean_module_is_reproducible(level):
    result = audit_module(level, ModuleTarget("_planted:CleanModule", device="cpu"), repeats=4)
    assert result.status == "reproducible", result.describe()
    assert result.distinct_results == 1 and result.max_abs_diff == 0.0 and result.divergence is None
    assert result.details["tensors_compared"] >= 5  # loss + 4 gradients (L3: + losses, params)


@pytest.mark.parametrize("level", ["L2", "L3"])
def test_unseeded_generator_is_caught_and_located(level):
    result = audit_module(level, ModuleTarget("_planted:UnseededRNGModule", device="cpu"), repeats=3)
    assert result.status == "divergent" and result.distinct_results == 3
    assert "loss" in result.differing or "loss/step0" in result.differing
    d = result.divergence
    assert base_name(d["op"]) == "randn" and d["module_path"] == "encoder.gate" and d["cause"] == "RNG"


def test_call_counter_is_caught_and_located():
    result = audit_module("L2", ModuleTarget("_planted:CallCountModule", device="cpu"), repeats=3)
    assert result.status == "divergent"
    d = result.divergence
    assert base_name(d["op"]) == "mul" and d["module_path"].endswith("head_scale") and d["cause"] == "Python state"
    assert "first divergent op" in result.describe()


@pytest.mark.filterwarnings("ignore:.*self.log")
def test_deepep_timestep_and_rollout_are_reproducible_on_cpu():
    for level, expected in (("L2", "one timestep"), ("L3", "rollout of T=6")):
        result = audit_module(level, ModuleTarget(config=TINY_DEEPEP, device="cpu"), repeats=3)
        assert result.status == "reproducible", result.describe()
        assert expected in result.target and any(name.startswith("grad/agent.") for name in _names(result))


def _names(result):
    # differing is empty when reproducible; check the compared tensor names through a fresh prepare
    target = ModuleTarget(config=TINY_DEEPEP, device="cpu")
    prepared = target.prepare(result.level)
    return list(prepared.run(prepared.fresh_module()))


def test_module_that_cannot_run_is_an_error_not_a_crash():
    result = audit_module("L2", ModuleTarget("_planted:CleanModule", config={"hidden": -1}, device="cpu"), repeats=2)
    assert result.status == "error" and "Error" in result.error and result.repeats == 0


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="target"):
        load_class("no_such_module_xyz:Thing")
    with pytest.raises(ValueError, match="has no attribute"):
        load_class("_planted:Missing")
    with pytest.raises(ValueError, match="level"):
        audit_module("L5")
    with pytest.raises(ValueError, match="variant.*audit_variants"):
        ModuleTarget("_planted:CleanModule", variant="fused")
    with pytest.raises(ValueError, match=r"variant.*'reference', 'fused', 'fused_atomic'.*'fast'"):
        ModuleTarget(config=TINY_DEEPEP, variant="fast")
    assert load_config({"model": {"class_path": "x.Y", "init_args": {"a": 1}}}) == {"a": 1}
    assert load_config({"model": {"a": 2}, "trainer": {}}) == {"a": 2}


@pytest.mark.gpu
def test_index_add_over_duplicates_is_caught_on_cuda_and_fixed_by_deterministic_mode():
    result = audit_module("L3", ModuleTarget("_planted:IndexAddModule", device="cuda"), repeats=10)
    assert result.status == "divergent", result.describe()
    assert base_name(result.divergence["op"]) == "index_add", result.describe()
    assert result.divergence["cause"] == "atomic accumulation"
    from deepep_lightning.determinism import configure

    configure(0, cublas_workspace_config=":4096:8")  # what DeterminismCallback applies (CUDA already started)
    try:
        fixed = audit_module("L3", ModuleTarget("_planted:IndexAddModule", device="cuda"), repeats=10)
    finally:
        torch.use_deterministic_algorithms(False)
    assert fixed.status == "reproducible", fixed.describe()


@pytest.mark.gpu
def test_deepep_reference_is_reproducible_and_atomic_head_is_located_on_cuda():
    # 1024 rows per value-head call: 64 row chunks atomically added in the backward (16 rows per chunk)
    config = {"env": {"num_envs": 1024, "rollout_length": 16}, "network": {"hidden_size": 256}}
    reference = audit_module("L3", ModuleTarget(config=config, device="cuda", variant="reference"), repeats=5)
    assert reference.status == "reproducible", reference.describe()
    fused = audit_module("L3", ModuleTarget(config=config, device="cuda", variant="fused"), repeats=5)
    assert fused.status == "reproducible", fused.describe()
    atomic = audit_module("L3", ModuleTarget(config=config, device="cuda", variant="fused_atomic"), repeats=10)
    assert atomic.status == "divergent", atomic.describe()
    assert "all_action_q" in atomic.divergence["op"] and atomic.divergence["cause"] == "atomic accumulation"


def test_sequence_auditable_module_is_audited_one_training_step_per_level():
    from deepep_lightning.protocols import SequenceAuditable

    cls = load_class("_planted:SequenceModule")
    assert isinstance(cls, SequenceAuditable) and not isinstance(load_class("_planted:CleanModule"), SequenceAuditable)
    target = ModuleTarget("_planted:SequenceModule", config={"length": 4}, device="cpu", steps=3)
    for level, length, described in (("L2", 1, "one timestep"), ("L3", 4, "sequence of 4")):
        prepared = target.prepare(level)
        assert prepared.template.length == length and len(prepared.batches) == 1  # one step, never `steps`
        assert described in target.name(level)
        result = audit_module(level, target, repeats=3)
        assert result.status == "reproducible", result.describe()
    # negative control: the variant that draws from an unseeded generator is caught
    noisy = audit_module("L3", ModuleTarget("_planted:SequenceModule", device="cpu", variant="unseeded"), repeats=3)
    assert noisy.status == "divergent" and "variant=unseeded" in noisy.target


def test_deepep_variants_set_constructor_arguments_without_patching_ops():
    import deepep_lightning.deepep.kernels as kernels

    original = kernels.all_action_q
    heads = {}
    for variant in ("reference", "fused", "fused_atomic"):
        template = ModuleTarget(config=TINY_DEEPEP, device="cpu", variant=variant).prepare("L2").template
        heads[variant] = (template.agent.value_head.fused, template.agent.value_head.deterministic)
        assert kernels.all_action_q is original
    assert heads == {"reference": (False, True), "fused": (True, True), "fused_atomic": (True, False)}
