"""The pure-Python bookkeeping structures the native core replaced, kept as the reference model.

Differential tests (tests/core) drive this model and tiered_kv._core with the same random
operations and compare every answer; nothing in tiered_kv imports it.
"""
