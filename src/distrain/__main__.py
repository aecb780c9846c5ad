"""``python -m distrain`` (and ``torchrun -m distrain``) run the command line."""

import sys

from distrain.cli import main

sys.exit(main())
