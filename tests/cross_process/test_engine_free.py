"""tiered_kv.cross_process needs no serving engine: it imports with vLLM unimportable (the connector,
integrations/vllm/, is the only place that speaks vLLM's protocol over it)."""

from __future__ import annotations

import subprocess
import sys


def test_cross_process_imports_without_vllm():
    code = "import sys\nsys.modules['vllm'] = None\nimport tiered_kv.cross_process\nimport tiered_kv.loops\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
