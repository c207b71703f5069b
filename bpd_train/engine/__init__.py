"""The decode engine: step weights packed for decoding (one protocol, `step.DecodeStep`, implemented once per model
family, in a file named after it: `mt.DecodeWeights` for the encoder-decoder, `lm.LMDecodeWeights` for the
decoder-only model; what both share in `packed`),
the CPU kernels and native decoding loops (`fastlinear`, `csrc/`). The models (bpd_train/model) stay pure torch;
decoders (bpd_train/decoding) ask a model for `decode_weights()` and run its steps. The engine imports nothing from
model/, decoding/, data/ or evaluation/: what it must know beyond a model's modules (the heads' kind, stop ids) it
is given by its caller."""
