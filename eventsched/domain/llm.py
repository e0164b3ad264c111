"""LLM-aware sizing: the older schedulers' ``llm_config.json`` and ``--llm NAME``
(README.md, "Jobs files and LLM sizing")::

    {"default_requirement": 1.0, "models": {"qwen2.5-3b-inst": 0.5, "qwen2.5-32b-inst": 2.0}}

A share up to 1 is a share of one GPU; above 1, that many whole GPUs, rounded up
(the seeds placed a 1.5 on 2 free GPUs). Pure: the callers read the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LLM_CONFIG_NAME", "LlmConfig", "LlmConfigError", "DEFAULT_LLM_CONFIG", "parse_llm_config",
           "llm_name", "gpus_for_share"]

LLM_CONFIG_NAME = "llm_config.json"
MAX_SHARE = 1024.0  # as many GPUs as one job may ask for (SubmitLimits.max_gpu_ids)


class LlmConfigError(ValueError):
    """A malformed llm_config.json: one line naming the file and the key."""


@dataclass(frozen=True)
class LlmConfig:
    default_requirement: float = 1.0
    models: dict[str, float] = field(default_factory=dict)
    path: str = ""  # where it was read from ("" = the built-in default)

    def share(self, model: str | None) -> float:
        """The GPUs ``model`` needs, as the file says (unknown: the default)."""
        return self.models.get(model, self.default_requirement) if model is not None else self.default_requirement

    def gpus(self, model: str | None) -> float:
        return gpus_for_share(self.share(model))


DEFAULT_LLM_CONFIG = LlmConfig()  # no file: every model needs one GPU (the seeds' default)


def gpus_for_share(share: float) -> float:
    return share if share <= 1 else float(math.ceil(share))


def _share(value: Any, where: str, key: str) -> float:
    # bool is an int to Python, not a number of GPUs to anyone
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LlmConfigError(f"{where}: {key} must be a number of GPUs (e.g. 0.5 or 2), not {json.dumps(value)}")
    share = float(value)
    if not math.isfinite(share) or share <= 0:
        raise LlmConfigError(f"{where}: {key} must be more than 0 GPUs, not {json.dumps(value)}")
    if share > MAX_SHARE:
        raise LlmConfigError(f"{where}: {key} is {share:g} GPUs; at most {MAX_SHARE:g}")
    return share


def parse_llm_config(text: str | bytes, where: str) -> LlmConfig:
    """``where`` names the file in errors. Both keys are required (a missing one is a
    typo more often than a wish for the default); others are ignored, as the seeds did."""
    try:
        raw = json.loads(text)
    except UnicodeDecodeError:
        raise LlmConfigError(f"{where}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise LlmConfigError(f"{where}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(raw, dict):
        raise LlmConfigError(f"{where}: expected a JSON object with \"default_requirement\" and \"models\"")
    if missing := next((k for k in ("default_requirement", "models") if k not in raw), None):
        raise LlmConfigError(f"{where}: missing key \"{missing}\"")
    default = _share(raw["default_requirement"], where, "\"default_requirement\"")
    models_raw = raw["models"]
    if not isinstance(models_raw, dict):
        raise LlmConfigError(f"{where}: \"models\" must be an object of model name -> GPUs, not {json.dumps(models_raw)}")
    models: dict[str, float] = {}
    for name, value in models_raw.items():
        if not name.strip():
            raise LlmConfigError(f"{where}: \"models\" has an empty model name")
        models[name] = _share(value, where, f"\"models\".\"{name}\"")
    return LlmConfig(default_requirement=default, models=models, path=where)


def llm_name(args: list[str]) -> str | None:
    """The NAME of ``--llm NAME`` / ``--llm=NAME`` in a job's arguments (the
    first one, as the seeds read it), or None."""
    for i, arg in enumerate(args):
        if arg == "--llm":
            return args[i + 1] if i + 1 < len(args) else None
        if arg.startswith("--llm="):
            return arg[len("--llm=") :]
    return None
