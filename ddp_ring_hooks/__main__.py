"""``python -m ddp_ring_hooks`` runs the command line."""

import sys

from .cli.__main__ import main

sys.exit(main())
