"""Run a command so that everything it starts dies with the coordinator.

`PR_SET_PDEATHSIG` reaches only the process it is set on. A vLLM server's engine core and
worker are grandchildren of the coordinator: after a SIGKILL of the coordinator (the OOM
killer, `kill -9`, a hard stop by a scheduler or `timeout`) the server died with it, but they
ran on, orphaned, holding gigabytes of memory and spinning on a core. (torchrun's ranks need no
guard: torch ties them to torchrun itself.) So `spawn(..., guard=True)` starts such a command
under this guard instead:

    python -m lockgate.coordinator.launch.orphan_guard COMMAND...

The guard leads the process group (`spawn` starts one for it) and gets `SIGUSR1` when the
coordinator dies; it then SIGKILLs the whole group, itself included. A SIGTERM sent to the
group reaches the command too: the guard waits for the command to end and exits as it did
(the same code, or the same signal), so stopping a guarded child behaves as before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from types import FrameType

# The coordinator's death signal to the guard (set by spawn before exec, so there is no
# window in which the coordinator could die unnoticed).
PARENT_DIED = signal.SIGUSR1


def _kill_group(signum: int, frame: FrameType | None) -> None:
    os.killpg(0, signal.SIGKILL)


def _let_command_answer(signum: int, frame: FrameType | None) -> None:
    # The group's SIGTERM / SIGINT reaches the command as well; its exit ends the guard.
    pass


def main(argv: list[str]) -> int:
    if not argv:
        print(
            "usage: python -m lockgate.coordinator.launch.orphan_guard COMMAND...", file=sys.stderr
        )
        return 2
    signal.signal(PARENT_DIED, _kill_group)
    signal.signal(signal.SIGTERM, _let_command_answer)
    signal.signal(signal.SIGINT, _let_command_answer)
    # Handlers are reset to the default in the command: it keeps its own signal behaviour.
    code = subprocess.Popen(argv).wait()
    if code < 0:
        # Died of a signal: end the same way, so the coordinator sees what really happened.
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's handler cannot be set
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
