"""Benchmarks behind `python launch/bench.py <name>`: one module per name with `main(argv)`."""
