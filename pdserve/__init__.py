"""pdserve: prefill/decode disaggregated LLM serving."""

__version__ = "0.1.0"
