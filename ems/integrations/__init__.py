"""Inference-engine connectors built on the ``ems`` SDK.

- ``ems.integrations.vllm``: ``EmsStoreConnector``, a vLLM v1 KV connector
  (``--kv-transfer-config '{"kv_connector":"EmsStoreConnector",
  "kv_connector_module_path":"ems.integrations.vllm","kv_role":"kv_both"}'``).
- ``ems.integrations.lmcache``: ``EmsdConnector``, an LMCache remote storage plugin.
- ``ems.integrations.sglang``: ``EmsdHiCacheStorage``, an SGLang HiCache storage backend.

Each module imports without its engine installed; the engine is needed only
to instantiate the connector. See docs/integrations.md.
"""
