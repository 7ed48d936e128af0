"""tiered_kv as a vLLM V1 KV connector.

Load it with::

    KVTransferConfig(
        kv_connector="TieredKVConnector",
        kv_connector_module_path="tiered_kv.integrations.vllm.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"config": "tiered_kv.yaml"},
    )

The connector speaks vLLM's protocol (scheduler_half.py, worker_half.py, the step metadata in meta.py)
over the cache across processes (tiered_kv.cross_process). ``request_keys``, ``block_bytes``, ``groups``,
``hits``, ``hints``, ``replicas`` and ``cache_calls`` import without vLLM; the halves and ``connector`` need it.
"""

from .request_keys import request_block_keys, request_salt

__all__ = ["request_block_keys", "request_salt"]
