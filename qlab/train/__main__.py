import sys

from qlab.train.launch import main

sys.exit(main())
