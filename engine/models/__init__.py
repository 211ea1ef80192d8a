"""Model families beyond the Llama layout of `engine.model`, one module each;
`engine.models.classes.model_class` picks the class for a config."""
