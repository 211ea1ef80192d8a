"""Building blocks of the Llama-family model (see engine/model.py)."""
