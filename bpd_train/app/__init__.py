"""The front ends: what users run and call. `cli` (config checks before Hydra), `commands` (the console scripts),
`api` (`Translator`), `translate` (the translate command line), `pipeline` (make demo's driver), `real_model` (make
demo-real's chain), `export` (checkpoint -> bundle / transformers / vLLM), `zero_cpu` (train.py under DeepSpeed ZeRO
on the CPU). `python -m bpd_train.translate`, `python -m bpd_train.pipeline` and `python -m bpd_train.real_model`
run through thin entry modules at the package root that only call these modules' `main`."""
