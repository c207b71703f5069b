"""The decoder-only family's data: prompt/response records (records.py), tokenizer.json folders (tokenizer.py)
and LMDataModule (datamodule.py)."""
