import os

# Offline by default: a stray hub call otherwise hangs on DNS.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402

# Two cores and several processes (DDP, subprocess runs): one thread each keeps tests from thrashing.
torch.set_num_threads(1)
