"""Jobs inside a detached terminal session (``submit --session tmux|screen``).

The job's process is a small ``sh`` script (the *waiter*): it starts the
session, runs the command in it, waits for it and exits the way the command
did (a status 128+N: dies of signal N), so exit records, cgroups and
re-adoption work as for any other job.

tmux: each job gets its own server, ``tmux -L eventsched-JOB``: the job must
not take its environment from a server started by hand, nor take the user's
later sessions down when its cgroup is emptied. The pane's shell stores the
command's status in ``@eventsched_rc`` and unlocks a ``wait-for -L`` channel
(a lock: two ``-S`` signals before anyone waits lose the wake-up);
``#{pane_dead_status}`` alone is not enough (tmux 3.3a now and then misses
the SIGCHLD of a pane that exits at once) but stays for a shell killed before
it can report. The command starts once ``pipe-pane`` is in place, so no output
is lost. screen: its own ``-L`` log.
"""

from __future__ import annotations

import shlex

__all__ = ["session_name", "session_argv", "attach_argv"]

# $1 = session name, $2 = the command (a shell word list), $3 = pipe-pane command
_TMUX_WAITER = r"""
n=$1
T() { tmux -L "$n" "$@"; }
ulimit -c 0 2>/dev/null
if T has-session 2>/dev/null; then  # another daemon's job of the same number: leave it be
  echo "eventsched: a tmux server named $n is already running for this user" >&2; exit 125
fi
stop() {
  p=$(T display-message -p -t "=$n:" '#{pane_pid}' 2>/dev/null)
  [ -n "$p" ] && kill -s TERM -- "-$p" "$p" 2>/dev/null
}
trap stop TERM INT HUP
export EVENTSCHED_SESSION_RUN="$2"
T new-session -d -s "$n" -x 200 -y 50 -- sh -c '
  tmux -L "$1" wait-for "$1-go" || exit 125
  r=$EVENTSCHED_SESSION_RUN; unset EVENTSCHED_SESSION_RUN
  eval "$r"
  rc=$?
  tmux -L "$1" set-option -g @eventsched_rc "$rc" \; wait-for -U "$1-run"
  exit "$rc"' eventsched-session "$n" || {
  echo "eventsched: cannot start a tmux session" >&2; exit 125; }
T set-option -g remain-on-exit on
T wait-for -L "$n-run"
T set-hook -g pane-died "wait-for -U $n-run"
T set-hook -g session-closed "wait-for -U $n-run"
T set-environment -g -u EVENTSCHED_SESSION_RUN
T pipe-pane -t "=$n:" -o "$3"
T wait-for -S "$n-go"
while :; do
  T wait-for -L "$n-run" 2>/dev/null
  s=$(T display-message -p -t "=$n:" '#{@eventsched_rc}:#{pane_dead}:#{pane_dead_status}:#{pane_dead_signal}' 2>/dev/null)
  case $s in [0-9]*|:1:*|"") break ;; esac
done
T kill-server 2>/dev/null
trap - TERM INT HUP
rc=${s%%:*}
if [ -z "$rc" ]; then
  case $s in
    :1:[0-9]*) c=${s#:1:}; rc=${c%%:*} ;;
    :1::[0-9]*) rc=$((128 + ${s#:1::})) ;;
  esac
fi
if [ -n "$rc" ]; then
  case $((rc - 128)) in  # killed by signal N: die of it too (not those that stop or are ignored)
    1|2|3|4|5|6|7|8|9|10|11|12|13|14|15|16|24|25|26|27|29|30|31) kill -s $((rc - 128)) $$ ;;
  esac
  exit "$rc"
fi
echo "eventsched: the terminal session $n was closed before the job ended" >&2
exit 129
"""

# $1 = session name, $2 = the command, $3 = the job's log
_SCREEN_WAITER = r"""
n=$1
d=$(mktemp -d "${TMPDIR:-/tmp}/eventsched-screen.XXXXXX") || exit 125
{ [ -r "$HOME/.screenrc" ] && echo "source $HOME/.screenrc"
  echo "logfile flush 1"; } > "$d/screenrc"
export EVENTSCHED_SESSION_RUN="$2" EVENTSCHED_SESSION_RC="$d/rc"
screen -c "$d/screenrc" -L -Logfile "$3" -DmS "$n" sh -c '
  r=$EVENTSCHED_SESSION_RUN; f=$EVENTSCHED_SESSION_RC
  unset EVENTSCHED_SESSION_RUN EVENTSCHED_SESSION_RC
  eval "$r"; echo $? > "$f"' &
sp=$!
trap 'kill -s TERM "$sp" 2>/dev/null' TERM INT HUP
while ! wait "$sp"; do kill -0 "$sp" 2>/dev/null || break; done
rc=$(cat "$d/rc" 2>/dev/null)
rm -rf "$d"
[ -n "$rc" ] && exit "$rc"
echo "eventsched: the terminal session $n was closed before the job ended" >&2
exit 129
"""


def session_name(job: int) -> str:
    """The session's (and, for tmux, the server socket's) name."""
    return f"eventsched-{job}"


def session_argv(kind: str, job: int, command: list[str], log_path: str) -> list[str]:
    """The waiter's argv: runs ``command`` (an argv) in a ``kind`` session."""
    name = session_name(job)
    run = shlex.join(command)
    if kind == "tmux":
        return ["sh", "-c", _TMUX_WAITER, "eventsched-session", name, run, "exec cat >> " + shlex.quote(log_path)]
    if kind == "screen":
        return ["sh", "-c", _SCREEN_WAITER, "eventsched-session", name, run, log_path]
    raise ValueError(f"unknown session kind {kind!r}")


def attach_argv(kind: str, job: int) -> list[str]:
    name = session_name(job)
    if kind == "tmux":
        return ["tmux", "-L", name, "attach-session", "-t", f"={name}"]
    return ["screen", "-r", name]
