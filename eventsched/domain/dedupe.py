"""What makes two submissions the same job, for ``--dedupe`` (``submit`` and
``submit-file``): the core refuses a job whose key a queued, running or
succeeded job of the same user already has."""

from __future__ import annotations

TYPE_CHECKING = False  # the CLI's fast path imports this module: nothing costly
if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["SESSION_ENV", "content_key"]

# what only describes the terminal a job was submitted from, not what it computes
SESSION_ENV = frozenset({"_", "OLDPWD", "PWD", "SHLVL", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "STY", "TMUX_PANE",
                         "WINDOWID", "TERM_SESSION_ID", "XDG_SESSION_ID"})


def content_key(command: list[str], cwd: str, conda: str, env_setup: str, env: Mapping[str, str] | None) -> str:
    """The key: command, working directory, set-up and environment (less SESSION_ENV), in any order."""
    import hashlib
    import json

    variables = sorted((k, v) for k, v in (env or {}).items() if k not in SESSION_ENV)
    material = json.dumps([command, cwd, conda, env_setup, variables])
    return hashlib.sha256(material.encode()).hexdigest()[:16]
