"""jaxrl.envs: multi-turn environments (episodes whose turns call tools in the sandbox pool).

Thin on purpose: `jaxrl.envs.base` holds the protocol and registry, `jaxrl.envs.builtin` the
built-in environments (registered on import of `get_env`).
"""
