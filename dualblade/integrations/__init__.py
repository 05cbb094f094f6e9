"""dualblade inside engines that already scale out: optional extras, one subpackage each.

- :mod:`dualblade.integrations.lmcache`: an LMCache L2 storage adapter (``pip install
  'dualblade[lmcache]'``; see ``docs/lmcache.md``), so vLLM, SGLang and TensorRT-LLM reach the
  dual-path placement through LMCache's multiprocess server.

Nothing here is imported by ``import dualblade``: an integration loads its engine's package, which
only its users have installed.
"""
