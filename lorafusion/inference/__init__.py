"""Generation from a run: every adapter and the base in one batch (``generate``) with a KV cache
(``kv_cache``). Never imports :mod:`lorafusion.runtime`."""
