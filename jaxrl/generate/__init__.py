"""jaxrl.generate."""
