"""gs:// and az:// origins against real emulators: the tier contract, warm, the loader, version pinning."""

from __future__ import annotations

from pathlib import Path

import pytest
from _emulators import AzureContainer, GcsBucket, azure, azurite_server, gcs, gcs_server
from datacache.tiers import ObjectTier, Tier
from datacache.tiers.testing import TierTests

__all__ = ["azure", "azurite_server", "gcs", "gcs_server"]  # fixtures, imported to be found


class TestGcsObjectTier(TierTests):
    def make_tier(self, request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
        bucket: GcsBucket = request.getfixturevalue("gcs")
        return ObjectTier(bucket.url("prefix/data"), storage_options=bucket.storage_options, writable=True)


class TestAzureObjectTier(TierTests):
    def make_tier(self, request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
        container: AzureContainer = request.getfixturevalue("azure")
        return ObjectTier(container.url("prefix/data"), storage_options=container.storage_options, writable=True)
