"""jaxrl.controller."""
