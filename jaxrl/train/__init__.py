"""jaxrl.train."""
