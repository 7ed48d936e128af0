"""vLLM finds TieredKVConnector by name (issue 45 item 5): the ``vllm.general_plugins`` entry point
(pyproject.toml) whose function (tiered_kv/integrations/vllm/plugin.py) registers it with vLLM's
KVConnectorFactory, lazily and idempotently.

Entry points come from the installed package's metadata, which pip writes at install time: a checkout
whose pyproject.toml gained the entry point after the venv was built has none until it is re-installed.
``make test-vllm`` re-installs whenever pyproject.toml changes (the .venv-vllm stamp depends on it), so
in CI the entry point is real: ``test_the_entry_point_is_installed`` asserts it, and the engine test runs
vLLM's own discovery of it. Where it is not installed (a venv built before, or one pointed at another
checkout), the installed-metadata test skips, saying so, and the other tests put the entry point that
pyproject.toml declares on the path as a distribution's metadata of its own (``declared_entry_point``):
vLLM still discovers and loads it through importlib.metadata in every one of its processes, nothing of
ours is called by hand.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import PREFIX_TOKENS, PROMPT_A, PROMPT_B, cache_config, outputs, run_engine

from tiered_kv.integrations.vllm.plugin import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    ENTRY_POINT_GROUP,
    register_connector,
)

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml takes Python 3.11's tomllib")
ROOT = Path(__file__).resolve().parents[2]
ENTRY_NAME = "tiered_kv"
ENTRY_VALUE = "tiered_kv.integrations.vllm.plugin:register_connector"


def declared() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})


def installed() -> list[importlib.metadata.EntryPoint]:
    return [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.value == ENTRY_VALUE]


def declared_entry_point(tmp: Path) -> dict[str, str]:
    """The environment a vLLM process needs to find the entry point: none when the package's metadata has it
    (installed); else PYTHONPATH with a directory holding a distribution's metadata that declares what
    pyproject.toml declares, ahead of the current path (so this checkout's tiered_kv is the one imported)."""
    if installed():
        return {}
    site = tmp / "entry-points"
    dist = site / "tiered_kv_entry_points_from_pyproject-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tiered-kv-entry-points-from-pyproject\nVersion: 0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in declared().items())
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")
    path = [str(site), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(path)}


def test_pyproject_declares_the_entry_point_and_its_function_exists():
    assert declared() == {ENTRY_NAME: ENTRY_VALUE}
    module, _, attr = ENTRY_VALUE.partition(":")
    assert getattr(importlib.import_module(module), attr) is register_connector
    assert (CONNECTOR_NAME, CONNECTOR_MODULE) == ("TieredKVConnector", "tiered_kv.integrations.vllm.connector")


def test_the_entry_point_is_installed():
    if not installed():
        pytest.skip(f"the installed tiered_kv has no {ENTRY_POINT_GROUP} entry point: its metadata predates the one "
                    "pyproject.toml declares; `make test-vllm` re-installs (its stamp depends on pyproject.toml)")  # fmt: skip
    (ep,) = installed()
    assert (ep.name, ep.value) == (ENTRY_NAME, ENTRY_VALUE)
    assert ep.load() is register_connector


# In a fresh interpreter: vLLM's registry is per process, and what the registration imports is the point.
REGISTER = textwrap.dedent("""
    import sys
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vLLM's own path: entry points of vllm.general_plugins, each function called
    by_plugins = "TieredKVConnector" in KVConnectorFactory._registry
    from tiered_kv.integrations.vllm.plugin import register_connector
    register_connector()  # again (vLLM loads plugins in several places): nothing happens
    lazy = not any(m in sys.modules for m in ("tiered_kv.integrations.vllm.connector",
                                              "tiered_kv.integrations.vllm.scheduler_half",
                                              "tiered_kv.cross_process"))
    ktc = KVTransferConfig(kv_connector="TieredKVConnector", kv_role="kv_both")
    cls = KVConnectorFactory.get_connector_class(ktc)
    print("RESULT", by_plugins, lazy, cls.__module__ + "." + cls.__name__, KVConnectorFactory.supports_hma_config(ktc))
""")

PREREGISTERED = textwrap.dedent("""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from tiered_kv.integrations.vllm.plugin import register_connector

    KVConnectorFactory.register_connector("TieredKVConnector", "somewhere.else", "Other")  # someone else's, first
    register_connector()  # no error: vLLM starts, and the name stays theirs
    cls = KVConnectorFactory._registry["TieredKVConnector"]
    print("RESULT", cls.__closure__ is not None and "somewhere.else" in [c.cell_contents for c in cls.__closure__])
""")


def run_python(code: str, env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, **env}, cwd=ROOT)  # fmt: skip
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return results[-1][len("RESULT ") :]


def test_vllms_plugin_loading_registers_the_connector_by_name_lazily(tmp_path):
    pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed in this venv: run `make test-vllm`")
    out = run_python(REGISTER, declared_entry_point(tmp_path))
    assert out == "True True tiered_kv.integrations.vllm.connector.TieredKVConnector True"


def test_registering_a_name_vllm_has_already_never_fails(tmp_path):
    pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed in this venv: run `make test-vllm`")
    assert run_python(PREREGISTERED, {}) == "True"


@pytest.mark.slow
def test_an_engine_given_only_the_connectors_name_serves_hits(model_dir, tmp_path):
    pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed in this venv: run `make test-vllm`")
    steps = [{"generate": [PROMPT_A]}, {"reset": True}, {"generate": [PROMPT_B]}]
    spec = {"model": model_dir, "tiered_kv": cache_config(), "steps": steps, "by_name": True}
    report = run_engine(spec, tmp_path, env=declared_entry_point(tmp_path))
    (a,), (b,) = outputs(report)
    assert a["cached"] == 0 and b["cached"] >= PREFIX_TOKENS  # vLLM's own cache was reset: tiered_kv's hit
    assert report["counters"]["loaded_blocks"] >= PREFIX_TOKENS // 32
