"""How FSDP shards the models: one FSDP unit per transformer layer (both families), so that a rank holds the full
weights of one layer at a time, not of the whole model, during forward and backward (conf/strategy/fsdp.yaml)."""

from __future__ import annotations

from bpd_train.families import families


def layer_wrap_policy():
    """FSDP auto_wrap_policy: every EncoderLayer / DecoderLayer (encoder-decoder) and Layer (decoder-only) is its
    own unit; the embeddings, final norms and BPD/Medusa heads stay in the root unit (the tied projection reads
    the embedding, which the root unit holds gathered for the whole forward)."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return ModuleWrapPolicy({cls for fam in families() for cls in fam.layer_classes})
