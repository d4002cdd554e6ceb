"""The exercise checks' setup: the repository root importable, and one torch thread (a shared machine)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

torch.set_num_threads(1)
