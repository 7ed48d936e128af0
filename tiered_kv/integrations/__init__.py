"""Plug-ins that connect tiered_kv to serving engines (each imports its engine lazily)."""
