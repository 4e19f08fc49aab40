"""The plugin's argument validators, public for workloads that check their own arguments in its words.

A workload built on the plugin (DeepEP in :mod:`deepep_lightning.deepep`) validates its constructor
arguments with these, so that its messages read like the plugin's: the subject (```Owner(name=...)```),
the value (``!r``) and what is allowed. The exception type defaults to Lightning's
``MisconfigurationException``; pass ``error=ValueError`` (or another type) for runtime values. Each
validator returns the value it accepted.

Example::

    from deepep_lightning import validation

    validation.number("MyModule", "gamma", gamma, minimum=0, maximum=1)
    validation.int_at_least("MyModule", "num_envs", num_envs, 1)
"""

from deepep_lightning import _checks
from deepep_lightning._checks import *  # noqa: F403 - the validators, public under this module's name

__all__ = list(_checks.__all__)
