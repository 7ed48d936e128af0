"""tiered_kv as a vLLM V1 KV connector.

Load it with::

    KVTransferConfig(
        kv_connector="TieredKVConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"config": "tiered_kv.yaml"},
    )

vLLM finds the name through the package's ``vllm.general_plugins`` entry point (plugin.py);
``kv_connector_module_path="tiered_kv.integrations.vllm.connector"`` loads it without one.

The connector speaks vLLM's protocol (scheduler_half.py, worker_half.py, the step metadata in meta.py)
over the cache across processes (tiered_kv.cross_process). ``request_keys``, ``block_bytes``, ``groups``,
``hits``, ``hints``, ``replicas``, ``cache_calls`` and ``plugin`` import without vLLM; the halves and ``connector`` need it.
"""

from ...scheduler.request_keys import request_block_keys, request_salt

__all__ = ["request_block_keys", "request_salt"]
