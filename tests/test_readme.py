"""The README's embedding example runs, as written, from the project root."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_embedding_example_runs_on_the_runtime_core_alone():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Embedding tiered_kv in an asyncio frontend", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    # Embedding needs only the core dependencies (uvloop and aiofiles among them): the extras' packages are
    # made unimportable.
    blocked = "import sys\nfor m in ('rich', 'matplotlib', 'redis', 'hiredis'): sys.modules[m] = None\n"
    out = subprocess.run([sys.executable, "-c", blocked + code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "loaded 4 blocks" in out.stdout
