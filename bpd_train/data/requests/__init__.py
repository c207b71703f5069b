"""Chat requests for self-distillation: a general corpus built offline (build.py) and a user's own request log
(user.py). Torch-free; the real-model driver (bpd_train/app/real_model.py) writes them as prompt files."""

from bpd_train.data.requests.build import KINDS, build_general, held_out_topic, kind_balanced
from bpd_train.data.requests.user import RequestsError, read_requests, split_requests

__all__ = [
    "KINDS",
    "RequestsError",
    "build_general",
    "held_out_topic",
    "kind_balanced",
    "read_requests",
    "split_requests",
]
