"""The connector as an installed package: vLLM finds it by name through its
``vllm.general_plugins`` entry point, and a bad setting fails where vLLM
parses the config, naming the key and the fix, with nothing created.

Needs vLLM and ``kvlc-store-connector`` installed (``./wb venv``).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest
from kvlc_store import plugin
from pydantic import ValidationError
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory


def config(**overrides: Any) -> dict[str, Any]:
    kv: dict[str, Any] = {"kv_connector": "StoreConnector", "kv_role": "kv_both"}
    kv.update(overrides)
    return kv


@pytest.fixture(autouse=True)
def registered() -> None:
    plugin.register()


def test_entry_point_is_installed():
    (point,) = [
        p
        for p in importlib.metadata.entry_points(group="vllm.general_plugins")
        if p.value.startswith("kvlc_store")
    ]
    assert point.load() is plugin.register


def test_found_by_name_and_registering_again_is_harmless(tmp_path: Path):
    from kvlc_store.connector import StoreConnector

    plugin.register()
    plugin.register()
    extra = {"path": str(tmp_path / "store")}
    by_name = KVTransferConfig(**config(kv_connector_extra_config=extra))
    by_path = KVTransferConfig(
        **config(kv_connector_extra_config=extra, kv_connector_module_path="kvlc_store")
    )
    assert KVConnectorFactory.get_connector_class(by_name) is StoreConnector
    assert KVConnectorFactory.get_connector_class(by_path) is StoreConnector


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({}, "kv_connector_extra_config['path'] = None: set the directory"),
        (
            {"path": "STORE", "capasity": "1GiB"},
            "unknown key; did you mean 'capacity'?",
        ),
        ({"path": "STORE", "capacity": "lots"}, "set a positive size"),
    ],
)
def test_bad_settings_fail_when_parsed_and_create_nothing(
    tmp_path: Path, extra: dict[str, Any], expected: str
):
    store = tmp_path / "store"
    extra = {k: (str(store) if v == "STORE" else v) for k, v in extra.items()}
    with pytest.raises(ValidationError, match=expected.replace("[", r"\[")):
        KVTransferConfig(**config(kv_connector_extra_config=extra))
    assert not store.exists()


def test_bad_settings_fail_with_the_module_path_too(tmp_path: Path):
    with pytest.raises(ValidationError, match="path"):
        KVTransferConfig(**config(kv_connector_module_path="kvlc_store"))


@pytest.mark.parametrize(
    "overrides",
    [
        {"kv_connector": "StoreConector"},
        {"kv_connector": "Store", "kv_connector_module_path": "kvlc_store"},
    ],
)
def test_misspelled_class_names_the_package(overrides: dict[str, Any]):
    with pytest.raises(
        ValidationError, match="kvlc-store-connector.*did you mean 'StoreConnector'"
    ):
        KVTransferConfig(**config(**overrides))


@pytest.mark.parametrize(
    # MooncakeStoreConnector: vLLM's own, and close enough to StoreConnector
    # for the misspelling hint.
    "name",
    ["ExampleConnector", "MooncakeStoreConnector"],
)
def test_other_connectors_are_not_checked(name: str):
    KVTransferConfig(
        kv_connector=name,
        kv_role="kv_both",
        kv_connector_extra_config={"anything": 1},
    )
    KVTransferConfig(
        **config(kv_connector_module_path="other_pkg", kv_connector_extra_config={})
    )
