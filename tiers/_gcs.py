"""gcsfs's filesystem with its own retries taken out: the tier's `RetryPolicy` is the one rule.

gcsfs wraps every request in a decorator that retries six times, sleeping up to 32 s
between tries, and logs each failure with its traceback (an unreachable origin took
3m40s and printed pages). Here the request runs once; what gcsfs would have retried is
raised as `RetriableError`, so that ``call_with_retry`` retries it by the tier's policy
and reports it in one line. Imported only when a gs:// tier is made (gcsfs is an extra).
"""

from __future__ import annotations

from typing import Any

from datacache.tiers._retry import RetriableError
from gcsfs.core import GCSFileSystem
from gcsfs.retry import is_retriable

__all__ = ["OneTryGCSFileSystem"]

_request_once = GCSFileSystem._request.__wrapped__  # the request without gcsfs's retry decorator


class OneTryGCSFileSystem(GCSFileSystem):  # type: ignore[misc]
    """`gcsfs.GCSFileSystem` whose requests are tried once (the JSON API, as `filesystem_class` says)."""

    async def _request(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await _request_once(self, *args, **kwargs)
        except Exception as exc:
            if is_retriable(exc):
                raise RetriableError(_describe(exc)) from exc
            raise


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    return f"{type(exc).__name__} {code}" if isinstance(code, int) else type(exc).__name__
