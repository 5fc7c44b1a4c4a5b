"""jaxrl.planner."""
