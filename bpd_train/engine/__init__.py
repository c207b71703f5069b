"""The decode engine: step weights packed for decoding (one protocol, `step.DecodeStep`, implemented once per model
family, in a file named after it: `mt.DecodeWeights` for the encoder-decoder, `lm.LMDecodeWeights` for the
decoder-only model; what both share in `packed`; the packed-weight cache a decoder owns, `weights.PackedWeights`),
the CPU kernels and native decoding loops (`fastlinear`, `csrc/`). The models (bpd_train/model) stay pure torch and
import nothing from here; decoders (bpd_train/decoding) get a model's step weights from a `PackedWeights` and hand
them to the model's `encode` / `start_decoding`. The engine imports nothing from
model/, decoding/, data/ or evaluation/: what it must know beyond a model's modules (the heads' kind, stop ids) it
is given by its caller."""
