"""The service's log lines (logger `jaxrl.service`).

Every HTTP request is one line when it is answered (`log_request`): method, route, key id (the
owner hash of its API key, never the key), status and duration; at info level when it
succeeded, at warning level when it was refused (HTTP 4xx, with the reason sent to the client)
or failed (HTTP 5xx; the traceback is logged beside it at error level). An accepted request whose
future does not succeed is one more line when it ends (`log_outcome`): cancelled (info), refused
while it ran (a user error: warning), or failed (error, with the traceback).
"""

from __future__ import annotations

import json
import logging

from aiohttp import web

from jaxrl.service.backend import UserError
from jaxrl.service.worker import Cancelled

log = logging.getLogger("jaxrl.service")


def log_request(request: web.Request, response: web.StreamResponse, key_id: str,
                seconds: float) -> None:
    """One line per answered request: method, route, key id, status, duration; a refusal (4xx)
    or failure (5xx) at warning level with the reason the client was sent."""
    what = (f"{request.method} {request.path} ({key_id}, HTTP {response.status}, "
            f"{seconds * 1e3:.1f} ms)")
    if response.status < 400:
        log.info("%s", what)
        return
    try:
        reason = json.loads(response.body)["error"]
    except (AttributeError, TypeError, ValueError, KeyError):
        reason = response.reason
    log.warning("%s %s: %s", "refused" if response.status < 500 else "failed", what, reason)


def log_outcome(request_id: str, route: str, tenant: str | None, future) -> None:
    """One line per accepted request that did not succeed: cancelled (info), refused while
    running (a user error: warning) or failed (an error, with its traceback)."""
    who = tenant or "no key"
    if future.cancelled():
        log.info("cancelled %s %s (%s) before it ran", route, request_id, who)
        return
    e = future.exception()
    if e is None:
        return
    if isinstance(e, Cancelled):
        log.info("cancelled %s %s (%s) while it ran", route, request_id, who)
    elif isinstance(e, UserError):
        log.warning("refused %s %s (%s) while it ran: %s", route, request_id, who, e)
    else:
        log.error("failed %s %s (%s): %s: %s", route, request_id, who, type(e).__name__, e,
                  exc_info=e)
