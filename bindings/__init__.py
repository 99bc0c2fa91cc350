"""Declarative graph bindings."""

from models.blas import route_blas

route_blas()  # models/blas.py: before anything imports mlx
