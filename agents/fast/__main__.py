"""`python -m agents.fast [--force]`: build the fast-path extension (agents.fast.build)."""

import sys

from agents.fast.build import main

sys.exit(main())
