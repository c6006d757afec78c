"""Reproducible mechanism diagnostics ("papers"), run by ``kvlab reproduce``."""
