"""Benchmarks behind `python launch/bench.py <name>`: one module per name, each with `main(argv)`."""
