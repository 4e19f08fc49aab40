"""Determinism: configuration before CUDA starts, RNG state, fingerprints, seekable data order."""

from deepep_lightning.determinism.callback import DeterminismCallback
from deepep_lightning.determinism.checkpoint_integrity import CheckpointIntegrityError
from deepep_lightning.determinism.configuration import (
    NCCL_DETERMINISTIC_ENV,
    ConfigureRecord,
    configure,
    last_configure_record,
    prime_cublas_and_release_env,
)
from deepep_lightning.determinism.data import SeededDataset, SeekableDataLoader, make_seekable
from deepep_lightning.determinism.fingerprint import collect_fingerprint, diff_fingerprints
from deepep_lightning.determinism.resume_checks import FingerprintMismatchError
from deepep_lightning.determinism.rng import (
    capture_rng_state,
    fork_global_rng,
    restore_rng_state,
    seed_everything_from,
)
from deepep_lightning.determinism.sampler import SampleKey, SeekableSampler
from deepep_lightning.determinism.sharded_resume import ShardingLayoutMismatchError
from deepep_lightning.determinism.streams import derive_seed, make_generator

__all__ = [
    "CheckpointIntegrityError",
    "ConfigureRecord",
    "DeterminismCallback",
    "FingerprintMismatchError",
    "NCCL_DETERMINISTIC_ENV",
    "SampleKey",
    "SeededDataset",
    "SeekableDataLoader",
    "SeekableSampler",
    "ShardingLayoutMismatchError",
    "capture_rng_state",
    "collect_fingerprint",
    "configure",
    "derive_seed",
    "diff_fingerprints",
    "fork_global_rng",
    "last_configure_record",
    "make_generator",
    "make_seekable",
    "prime_cublas_and_release_env",
    "restore_rng_state",
    "seed_everything_from",
]
