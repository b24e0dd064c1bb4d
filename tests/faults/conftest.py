"""Fixtures of the fault suite: the fault-injecting proxy in front of the session's S3 server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from _faultproxy import FaultProxy

if TYPE_CHECKING:
    from conftest import S3Server


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    """A fault proxy in front of the S3 server, injecting nothing until told to."""
    with FaultProxy(s3_server.endpoint, seed=1234) as running:
        yield running
