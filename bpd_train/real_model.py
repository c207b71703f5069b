"""`python -m bpd_train.real_model`: a thin entry point; the command is bpd_train/app/real_model.py."""

from bpd_train.app.real_model import main

if __name__ == "__main__":  # (without flags it prints the real model's file path, for gguf:$(...))
    main()
