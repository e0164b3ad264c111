"""The bounds on what a user may submit: the ``[limits]`` table of the serve
config, checked by ``admission.check_submission``."""

from __future__ import annotations

import msgspec

__all__ = ["SubmitLimits", "YEAR_S"]

YEAR_S = 366 * 86400.0


class SubmitLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_user_priority: int = 100  # non-operators submit priorities in [-this, this]
    max_retries: int = 100
    max_time_limit_s: float = YEAR_S
    max_gpu_mem_mib: int = 1 << 24  # 16 TiB per GPU: far above any GPU, far below int overflow
    max_command_bytes: int = 64 << 10  # the command line, all arguments together
    max_env_bytes: int = 256 << 10  # environment names and values, plus --env-setup
    max_name_chars: int = 200
    max_after: int = 1000  # --after dependencies of one job
    max_gpu_ids: int = 1024
