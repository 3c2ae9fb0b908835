"""``python -m torch_patches.bench``: the same as ``python -m torch_patches bench`` (and the
entry point of its ``--worker`` subprocesses)."""

import sys

from torch_patches.bench import main

sys.exit(main())
