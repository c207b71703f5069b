"""`python -m bpd_train.translate`: a thin entry point; the command is bpd_train/app/translate.py."""

import sys

from bpd_train.app.translate import main

if __name__ == "__main__":
    sys.exit(main())
