"""Peak memory and step time of saved-tensor hooks under torch.compile.

Same as ``python -m torch_patches bench``; kept here so benchmarks can be found and run
from a checkout::

    python benchmarks/saved_tensor_hooks.py --device cpu --json benchmarks/results/cpu.json
    python benchmarks/saved_tensor_hooks.py --help

See benchmarks/README.md for the method and the latest measured tables.
"""

import sys

from torch_patches.bench import main


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
