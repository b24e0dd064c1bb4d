"""What bounds a cold epoch's rate: the fixed costs before the first GET, and the work per byte staged."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from datacache.tiers import ByteRange, open_origin

if TYPE_CHECKING:
    from conftest import S3Bucket


def test_the_get_client_reuses_the_service_model_the_listing_loaded(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """botocore's S3 service description is parsed once per origin: the GET threads' client
    shares the data loader of the session that listed (parsing it again cost 100-250 ms of
    the cold epoch, before its first byte)."""
    import botocore.loaders

    s3.put("ds/a.tar", b"x" * 1000)
    parsed: list[str] = []
    real = botocore.loaders.JSONFileLoader.load_file

    def counting(self: Any, file_path: str) -> Any:
        parsed.append(str(file_path))
        return real(self, file_path)

    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", counting)

    async def body() -> None:
        origin = open_origin(s3.url("ds"))
        try:
            assert [info.key async for info in origin.list()] == ["a.tar"]
            assert await origin.get("a.tar", ByteRange(0, 10)) == b"x" * 10  # the GET threads' client
        finally:
            await origin.close()

    asyncio.run(body())
    models = [path for path in parsed if Path(path).parent.parent.name == "s3" and Path(path).name == "service-2"]
    assert len(models) == 1, f"the S3 service model was parsed {len(models)} times: {models}"
