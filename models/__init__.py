"""Own MLX model implementations, one module per Hugging Face `model_type`."""

from models.blas import route_blas

route_blas()  # before anything imports mlx (models/blas.py)
