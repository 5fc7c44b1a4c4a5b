"""A Tinker-compatible training and sampling service over jaxrl (the `service` extra).

`python launch/serve.py --base-model DIR_OR_ID` serves one base model; scripts written against
the official `tinker` SDK point `ServiceClient(base_url=...)` at it. `backend.py`: the base, the
LoRA training clients, sampling; `server.py`: HTTP routes and futures; `limits.py`: what a request
may ask, checked on arrival; `worker.py`: the one model thread, a fair queue per API key;
`logs.py`: a line per request; `running.py`: starting a server; `wire.py`: protobuf bodies;
`compute.py`: the jitted losses (the maths: `jaxrl.train.tinker`); `rest.py` + `checkpoints.py`:
the RestClient's routes (training runs, checkpoints, TTLs, external weights) and the records
behind them; `prompt_scores.py`: top-k and target prompt log-probabilities. See
docs/service.md.
"""
