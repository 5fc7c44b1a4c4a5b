"""The default experiment: a tiny model on the built-in char tokenizer (CPU friendly)."""

from jaxrl.config import RunConfig


def config() -> RunConfig:
    return RunConfig(name="default")
