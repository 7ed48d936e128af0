"""The README's embedding example runs, as written, from the project root."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_embedding_example_runs():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Embedding tiered_kv in an asyncio frontend", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "loaded 4 blocks" in out.stdout
