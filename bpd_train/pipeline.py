"""`python -m bpd_train.pipeline`: a thin entry point; the command is bpd_train/app/pipeline.py."""

from bpd_train.app.pipeline import main

if __name__ == "__main__":
    main()
