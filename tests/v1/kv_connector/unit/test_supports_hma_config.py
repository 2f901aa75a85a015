# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for SupportsHMA.supports_hma_config: a connector class decides per
KV transfer config whether vLLM keeps the hybrid KV cache manager."""

from typing import Any

import pytest

from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.platforms import current_platform

pytestmark = pytest.mark.cpu_test

MODULE = "tests.v1.kv_connector.unit.test_supports_hma_config"


class ConfigDependentHMAConnector(ExampleConnector, SupportsHMA):
    """Supports HMA only when its config says "hma": true."""

    @classmethod
    def supports_hma_config(cls, kv_transfer_config: KVTransferConfig) -> bool:
        return bool(kv_transfer_config.get_from_extra_config("hma", False))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None


KVConnectorFactory.register_connector(
    "ConfigDependentHMAConnector", MODULE, "ConfigDependentHMAConnector"
)


@pytest.fixture(autouse=True)
def mock_hybrid_kv_cache_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(current_platform, "support_hybrid_kv_cache", lambda: True)


def _child(hma: bool) -> dict[str, Any]:
    return {
        "kv_connector": "ConfigDependentHMAConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"hma": hma},
    }


def _multi(*child_hma: bool) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [_child(hma) for hma in child_hma]},
    )


@pytest.mark.parametrize(
    "kv_transfer_config,hma_on",
    [
        (KVTransferConfig(**_child(hma=True)), True),
        (KVTransferConfig(**_child(hma=False)), False),
        (KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"), False),
        (_multi(True, True), True),
        (_multi(True, False), False),
    ],
    ids=["class-says-yes", "class-says-no", "no-supports-hma", "multi-yes", "multi-no"],
)
def test_connector_class_decides_per_config(
    kv_transfer_config: KVTransferConfig, hma_on: bool
):
    """The class's own answer for the config decides, for a connector and
    for each child of a MultiConnector, not only whether it subclasses
    SupportsHMA."""
    assert KVConnectorFactory.supports_hma_config(kv_transfer_config) is hma_on
    vllm_config = VllmConfig(
        device_config=DeviceConfig("cpu"), kv_transfer_config=kv_transfer_config
    )
    assert vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is not hma_on


def test_default_answer_is_yes():
    assert SupportsHMA.supports_hma_config(KVTransferConfig()) is True


def test_multi_connector_decides_in_supports_hma_config_alone():
    """MultiConnector's answer and the check its constructor makes are one
    method: no second way to ask."""
    assert not hasattr(MultiConnector, "all_children_support_hma")
    assert MultiConnector.supports_hma_config(_multi(True, True)) is True
    assert MultiConnector.supports_hma_config(_multi(True, False)) is False
    assert (
        MultiConnector.supports_hma_config(
            KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both")
        )
        is False
    )
