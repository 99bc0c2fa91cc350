"""Declarative graph bindings."""
