"""Model sources: where a model and its tokenizer come from. `loading` (one resolver: a path or an `hf:` / `gguf:`
spec -> model + tokenizer + meta), `convert/` (transformers, GGUF, vLLM Medusa), `bundle` (the bundle format),
`checkpoint` (Lightning checkpoints and run folders), `zero` (DeepSpeed ZeRO folders). The stages above
(training, evaluation, distillation) and the front ends load every model through `loading.load`."""
