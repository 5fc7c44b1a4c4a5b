"""jaxrl.envs: multi-turn environments (episodes whose turns call tools in the sandbox pool): the
protocol and registry in `base`, the built-ins in `builtin`, registered here on import."""

from jaxrl.envs import builtin  # noqa: F401 - registers the built-in environments
