"""The tiered_kv config the connector runs with, from vLLM's ``kv_connector_extra_config``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ...config import Config, load_config
from ...errors import ConfigError


def resolve_config(raw: Any, model_id: str, revision: str | None, bytes_per_block: int) -> Config:
    """The tiered_kv config from ``kv_connector_extra_config['config']`` (a YAML path or a dict).

    Where the config names no ``model.model_id``, vLLM's model (and revision)
    fill it in, so the key namespace and the disk directory follow the model.
    """
    if isinstance(raw, (str, Path)):
        path = Path(raw).expanduser()
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"kv_connector_extra_config.config: cannot read {str(path)!r}: {exc}") from None
    elif isinstance(raw, Mapping):
        data = raw
    else:
        raise ConfigError(
            f"kv_connector_extra_config.config must be a YAML path or a dict, got {type(raw).__name__}"
        )
    if not isinstance(data, Mapping):
        raise ConfigError(f"kv_connector_extra_config.config: the top level must be a mapping, got {data!r}")
    data = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    model = data.setdefault("model", {})
    if not isinstance(model, dict):
        raise ConfigError(f"model: must be a mapping, got {model!r}")
    if "model_id" not in model:
        model["model_id"] = model_id
        if revision and "revision" not in model:
            model["revision"] = revision
    if "bytes_per_block" not in model and not {"num_layers", "num_kv_heads", "head_dim"} & set(model):
        model["bytes_per_block"] = bytes_per_block
    return load_config(data)
