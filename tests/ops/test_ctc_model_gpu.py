"""End-to-end GPU test: a small CTC model (Conv1d -> GRU -> log_softmax -> F.ctc_loss, T=50 N=4 C=29) trains
bitwise reproducibly under DeterminismCallback in two fresh processes, while Trainer(deterministic=True) refuses
it (PyTorch's "ctc_loss_backward_gpu does not have a deterministic implementation")."""

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import hashlib, sys
    mode, seed = sys.argv[1], int(sys.argv[2])
    from deepep_lightning.determinism import DeterminismCallback, configure
    if mode == "plugin":
        configure(seed=seed)  # before CUDA starts
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    STEPS, CLASSES, FEATURES = 50, 29, 13

    class TinyCTC(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(FEATURES, 32, 3, padding=1)
            self.rnn = nn.GRU(32, 48)
            self.head = nn.Linear(48, CLASSES)

        def forward(self, features):  # [N, FEATURES, T] -> [T, N, CLASSES] log-probabilities
            hidden = F.relu(self.conv(features)).permute(2, 0, 1)  # [T, N, 32]
            output, _ = self.rnn(hidden)  # [T, N, 48]
            return self.head(output).log_softmax(2)

        def training_step(self, batch, batch_index):
            features, targets, input_lengths, target_lengths = batch
            log_probs = self(features)
            return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=True)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=3e-3)

    generator = torch.Generator().manual_seed(1)
    samples = 64
    features = torch.randn(samples, FEATURES, STEPS, generator=generator)
    targets = torch.randint(1, CLASSES, (samples, 12), generator=generator)
    input_lengths = torch.randint(40, STEPS + 1, (samples,), generator=generator)
    target_lengths = torch.randint(5, 13, (samples,), generator=generator)
    data = torch.utils.data.TensorDataset(features, targets, input_lengths, target_lengths)
    common = dict(accelerator="gpu", devices=1, max_steps=12, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False)
    if mode == "plugin":
        trainer = pl.Trainer(callbacks=[DeterminismCallback(seed=seed)], **common)
    else:
        pl.seed_everything(seed)
        trainer = pl.Trainer(deterministic=True, **common)
    model = TinyCTC()
    try:
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    except RuntimeError as error:
        print("RAISED", str(error).splitlines()[0])
        sys.exit(3)
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    print("DIGEST", digest.hexdigest())
    """
)


def _run(run_process, tmp_path, mode, seed=0):
    script = tmp_path / "train_ctc.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return run_process([sys.executable, str(script), mode, str(seed)], env=env, cwd=str(REPO))


def _digest(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if line.startswith("DIGEST ")][-1].split()[1]


@pytest.fixture
def gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_ctc_model_trains_bitwise_reproducibly_under_the_plugin(gpu, tmp_path, run_process):
    first, second = (_digest(_run(run_process, tmp_path, "plugin")) for _ in range(2))
    assert first == second
    # Negative control: the digest sees the training (another seed, another model).
    assert _digest(_run(run_process, tmp_path, "plugin", seed=1)) != first


def test_lightning_deterministic_trainer_refuses_the_ctc_model(gpu, tmp_path, run_process):
    result = _run(run_process, tmp_path, "lightning")
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ctc_loss_backward_gpu does not have a deterministic implementation" in result.stdout
