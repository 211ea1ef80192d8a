"""Model families beyond the Llama layout of `engine.model`, one module each."""
