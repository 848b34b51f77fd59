"""X-Request-Id: taken from the client when it sends a sane one, generated otherwise,
echoed on the response and stamped on every log line written while the request runs."""

from __future__ import annotations

import contextvars
import logging
import re
import uuid

HEADER = "x-request-id"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
_VALID = re.compile(r"[!-~]{1,128}")  # visible ASCII: safe in a header and in a log line
current: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id",
                                                                     default=None)


def resolve(sent: str | None) -> str:
    """The client's id when it is 1-128 visible ASCII characters, else a fresh uuid4."""
    if sent is not None and _VALID.fullmatch(sent):
        return sent
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` to each record ("-" outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current.get() or "-"
        return True


def install(level: str) -> None:
    """Root logging with the request id in the format (called once by `attnserve serve`)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
