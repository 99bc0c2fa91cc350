"""Own MLX model implementations, one module per Hugging Face `model_type`."""
