"""``python -m deepep_lightning.compare`` runs ``deepep-compare``."""

import sys

from deepep_lightning.compare.cli import main

sys.exit(main())
