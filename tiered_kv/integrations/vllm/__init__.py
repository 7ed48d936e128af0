"""tiered_kv as a vLLM V1 KV connector.

Load it with::

    KVTransferConfig(
        kv_connector="TieredKVConnector",
        kv_connector_module_path="tiered_kv.integrations.vllm.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"config": "tiered_kv.yaml"},
    )

``keys``, ``geometry`` and ``runtime`` do not import vLLM; ``connector`` does.
"""

from .keys import request_block_keys, request_salt
from .runtime import find_runtime

__all__ = ["find_runtime", "request_block_keys", "request_salt"]
