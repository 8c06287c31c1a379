"""Benchmarks of lightning_dp, each run from the repository root as ``python -m benchmarks.<name>``."""
