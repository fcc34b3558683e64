import os

import torch

os.environ.setdefault("MPLBACKEND", "Agg")

# Triton decides at import whether its kernels run on the interpreter, and torch.compile imports Triton
# too; without a GPU the interpreter is chosen here, before any test can import it (tests/test_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
