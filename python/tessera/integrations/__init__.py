"""Framework integrations: :mod:`tessera.integrations.transformers` (Hugging Face attention
backend). Each module imports its framework lazily, so importing tessera never needs them."""
