"""attrs records for configs, artifacts and requests, and their cattrs converters."""

from models.blas import route_blas

route_blas()  # models/blas.py: before anything imports mlx
