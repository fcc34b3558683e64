"""``python -m qlab.train``: what ``qlab train --nproc N`` has torchrun start in each process."""

import os
import sys

from qlab.train.launch import main

status = main()  # results are written and the process group destroyed before it returns
if "LOCAL_RANK" in os.environ:
    # A torchrun worker skips the interpreter's C++ teardown: on a loaded machine it sometimes aborts
    # ("terminate called without an active exception", SIGABRT) after a run that finished, and
    # torchrun then reports the whole run as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
sys.exit(status)
