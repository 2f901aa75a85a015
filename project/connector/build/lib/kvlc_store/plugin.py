"""vLLM's ``vllm.general_plugins`` entry point: the connector by name, and
its settings checked when vLLM parses them.

vLLM runs ``register`` in the API server (while it builds the argument
parser), in the engine core and in every worker, each process once; so
everything here is idempotent, and ``register`` beside an explicit
``kv_connector_module_path`` is harmless too (the module path wins in vLLM's
factory, and it names the same class).

No hook of vLLM 0.32.0 hands a plugin the parsed configuration before the
model loads: the connector's own constructor runs only after the model is
loaded and the KV cache sized. So ``register`` also extends
``KVTransferConfig.__post_init__``: a ``KVTransferConfig`` naming this
connector is checked the moment it is built (``--kv-transfer-config`` is
parsed, or ``KVTransferConfig(...)`` is called), in seconds and before any
engine process starts. A bad setting then ends ``vllm serve`` with an
argument error naming each bad key and its fix, and creates nothing. A
setting that depends on other engine arguments (``offload: lazy`` needs
prefix caching) is checked the same way by an extended
``VllmConfig.__post_init__``, when vLLM assembles its whole configuration,
still before any engine process starts or any weight loads.
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Any

CONNECTOR = "StoreConnector"
PACKAGE = "kvlc_store"
DIST = "kvlc-store-connector"

# What ``kv_connector_module_path`` may be when it names this connector.
MODULE_PATHS = (PACKAGE, f"{PACKAGE}.connector")

_CHECK_MARK = "_kvlc_store_checks"


def register() -> None:
    """Entry point: make ``StoreConnector`` a connector name, install the
    early settings check. Safe to call any number of times."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # ValueError: already registered, by this plugin in this process.
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(
            CONNECTOR, f"{PACKAGE}.connector", CONNECTOR
        )
    _install_check()


def check_kv_transfer_config(kv_transfer_config: Any) -> None:
    """Raise ``ValueError`` naming the setting and its fix if
    ``kv_transfer_config`` selects this connector with bad settings, or looks
    like a misspelled reference to it. Other connectors pass untouched."""
    from kvlc_store.config import parse_config

    name = kv_transfer_config.kv_connector
    module_path = kv_transfer_config.kv_connector_module_path
    if name is None:
        return
    ours_by_path = module_path in MODULE_PATHS
    if name != CONNECTOR:
        close = difflib.get_close_matches(name, [CONNECTOR], n=1, cutoff=0.7)
        # A name close to ours that vLLM or another plugin registered
        # (MooncakeStoreConnector) is that connector, not a misspelling.
        misspelled = close and not _is_registered(name)
        if ours_by_path or (module_path is None and misspelled):
            raise ValueError(
                f"kv_connector = {name!r} is not a connector of {DIST} "
                f"(package {PACKAGE}); did you mean {CONNECTOR!r}?"
            )
        return
    if module_path is not None and not ours_by_path:
        return  # Another package's StoreConnector.
    parse_config(dict(kv_transfer_config.kv_connector_extra_config or {}))


def _ours(kv_transfer_config: Any) -> bool:
    return kv_transfer_config is not None and (
        kv_transfer_config.kv_connector == CONNECTOR
        and kv_transfer_config.kv_connector_module_path in (None, *MODULE_PATHS)
    )


def check_vllm_config(vllm_config: Any) -> None:
    """Raise ``ValueError`` naming the setting and its fix if this
    connector's settings do not fit the rest of ``vllm_config``."""
    from kvlc_store.config import check_vllm_config, parse_config

    kv_transfer_config = vllm_config.kv_transfer_config
    if not _ours(kv_transfer_config):
        return
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    config = parse_config(extra, check_store=False)
    check_vllm_config(config, vllm_config.cache_config.enable_prefix_caching)


def _is_registered(name: str) -> bool:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # vLLM 0.32.0 has no public query for a registered name; looking a name up
    # through get_connector_class_by_name would import its module.
    return name in KVConnectorFactory._registry


def _install_check() -> None:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig

    _extend_post_init(KVTransferConfig, check_kv_transfer_config)
    _extend_post_init(VllmConfig, check_vllm_config)


def _extend_post_init(cls: Any, check: Any) -> None:
    """Run ``check(instance)`` after ``cls.__post_init__``, once per class."""
    if getattr(cls, _CHECK_MARK, False):
        return
    original = cls.__post_init__

    def __post_init__(self: Any) -> None:
        original(self)
        check(self)

    # pydantic's dataclass validator looks ``__post_init__`` up on the class
    # each time it builds an instance, so replacing it takes effect at once.
    # setattr: mypy refuses assigning to a method.
    setattr(cls, "__post_init__", __post_init__)  # noqa: B010
    setattr(cls, _CHECK_MARK, True)
