"""jaxrl: JAX-native single-controller RL for post-training language models.

Kept thin on purpose: importing `jaxrl` imports nothing heavy. Import the parts you need,
e.g. `from jaxrl.models import load_pretrained` or `from jaxrl.sandbox import LocalSandboxPool`.
"""

__version__ = "0.1.0"
