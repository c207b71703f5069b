"""The encoder-decoder family's data: source/target pairs (processing.py) and BPDDataModule (datamodule.py)."""
