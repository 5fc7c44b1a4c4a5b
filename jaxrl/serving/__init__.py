"""Serving a jaxrl policy with external inference servers.

`jaxrl.serving.jetstream_adapter` implements JetStream's `Engine` over `jaxrl.generate.JaxEngine`
and `python -m jaxrl.serving.jetstream --model PATH` starts JetStream's gRPC server with it.
Both need the optional `jetstream` extra (`pip install 'jaxrl[jetstream]'`), which pulls in
TensorFlow through seqio; this package imports nothing from it, and core jaxrl never imports
this package. See docs/serving.md.
"""
