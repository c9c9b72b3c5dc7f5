"""InfiniGen: offline skewing and the speculative KV cache policy (see ``kv/infinigen.py``)."""
