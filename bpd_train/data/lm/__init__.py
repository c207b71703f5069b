"""The decoder-only family's data: prompt/response records (processing.py), tokenizer.json folders (tokenizer.py)
and LMDataModule (datamodule.py)."""
