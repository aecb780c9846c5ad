"""``python -m distrain`` (and ``torchrun -m distrain``) run the command line."""

import sys

try:
    from distrain.cli import main
except KeyboardInterrupt:  # Ctrl-C while torch is imported, before the command line's own handling
    print("distrain: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
