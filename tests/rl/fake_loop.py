"""A `Loop` over stand-in verbs (no model): `produce(step, weights) -> Produced`,
`train(step, produced) -> (metrics, params)`, `publish(params, version) -> (generator params,
metrics)`; rows logged to `rows`."""

from types import SimpleNamespace

from jaxrl.rl.loop import Loop, Parts
from jaxrl.rl.rollout import Produced


class FakeRollouts:
    def __init__(self, produce, release=None):
        self._produce, self._release = produce, release

    def produce(self, step, scheduler, weights):
        return self._produce(step, weights)

    def release(self, scheduler):
        if self._release is not None:
            self._release()


def fake_loop(mode, *, produce, train, publish, initial_params="params-0", rows=None,
              release=None, **kw) -> Loop:
    trainer = SimpleNamespace(state=SimpleNamespace(params=initial_params))

    def update(step, produced, trainer):
        metrics, params = train(step, produced)
        trainer.state = SimpleNamespace(params=params)
        return dict(metrics)

    generator = SimpleNamespace(publisher=SimpleNamespace(publish=publish), scheduler=None)
    log_row = None if rows is None else (lambda step, row, samples: rows.append(row))
    return Loop(Parts(trainer, generator), mode=mode, rollouts=FakeRollouts(produce, release),
                update=update, log_row=log_row, **kw)


def batch(step, version, *, num_rollouts=8, busy_s=0.0) -> Produced:
    return Produced(step=step, groups=[], num_rollouts=num_rollouts,
                    num_tokens=10 * num_rollouts, busy_s=busy_s, min_version=version)
