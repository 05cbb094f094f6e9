"""dualblade: dual-path NVMe-direct KV-cache offloading for LLM inference (DUAL-BLADE).

The four subpackages are the four parts of the system and import only downwards:
``models -> pipeline -> actors -> io_engine``.
"""

__version__ = "0.1.0"
