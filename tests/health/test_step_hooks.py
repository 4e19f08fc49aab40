"""The training-step hook chain: hooks run in the order added, innermost ones wrap the step most tightly."""

from deepep_lightning.health._step_hooks import add_step_hook, remove_step_hook

from .conftest import ToyModule


class Echo(ToyModule):
    def __init__(self):
        super().__init__()
        self.calls = []

    def training_step(self, batch, batch_idx):
        self.calls.append("step")
        return batch


def test_innermost_hooks_wrap_the_step_most_tightly():
    module = Echo()
    calls = module.calls
    add_step_hook(
        module,
        "inner",
        pre=lambda s, b: calls.append("inner-pre") or b,
        post=lambda s, o: calls.append("inner-post") or o,
        innermost=True,
    )
    add_step_hook(
        module,
        "outer",
        pre=lambda s, b: calls.append("outer-pre") or b,
        post=lambda s, o: calls.append("outer-post") or o,
    )
    assert module.training_step(7, 0) == 7
    assert calls == ["outer-pre", "inner-pre", "step", "inner-post", "outer-post"]
    remove_step_hook(module, "inner")
    remove_step_hook(module, "outer")
    assert "training_step" not in module.__dict__  # unwrapped once the last hook is gone
