"""The service's log lines for requests that did not succeed (logger `jaxrl.service`).

A request refused when it arrives (HTTP 4xx) is one warning line: route, key id
(the owner hash of its API key, never the key), status and the reason sent to the client. An
accepted request whose future does not succeed is one line when it ends: cancelled (info),
refused while it ran (a user error: warning), or failed (error, with the traceback).
"""

from __future__ import annotations

import json
import logging

from aiohttp import web

from jaxrl.service.backend import UserError
from jaxrl.service.worker import Cancelled

log = logging.getLogger("jaxrl.service")


def refused(request: web.Request, response: web.Response, key_id: str) -> None:
    """One warning line per refused request: route, key id, status, reason (a 500 is logged
    where it is raised, with its traceback)."""
    if response.status >= 500:
        return
    try:
        reason = json.loads(response.body)["error"]
    except (TypeError, ValueError, KeyError):
        reason = response.reason
    log.warning("refused %s %s (%s, HTTP %d): %s", request.method, request.path,
                key_id, response.status, reason)


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
