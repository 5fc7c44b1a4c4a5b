"""Pallas kernels for jaxrl's attention hot paths (prefill and decode)."""
