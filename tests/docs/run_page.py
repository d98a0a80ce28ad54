"""Runs one page's examples in order, as a reader would: ``python run_page.py BLOCKS.json`` in the page's own
temporary directory, with the broker's variables in the environment.

Python blocks share one namespace (a page reads like a notebook) and are compiled with the page's line numbers, so a
traceback points into the markdown. Each bash block runs with ``bash -euo pipefail`` in a process group of its own,
which is killed when the block ends (a broker started with ``&`` lives as long as its block) or after 120 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback

BASH_TIMEOUT = 120.0


def run_bash(where: str, source: str) -> None:
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", source], start_new_session=True)
    try:
        code = proc.wait(BASH_TIMEOUT)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the block's background jobs too
        except ProcessLookupError:
            pass
        proc.wait()
    if code is None:
        raise SystemExit(f"{where}: the bash block ran past {BASH_TIMEOUT:g} s")
    if code != 0:
        raise SystemExit(f"{where}: the bash block exited {code}")


def main() -> None:
    with open(sys.argv[1]) as f:
        blocks = json.load(f)
    namespace: dict[str, object] = {"__name__": "__main__"}
    for block in blocks:
        where = f"{block['where']} ({block['lang']})"
        print(f"--- {where}", flush=True)
        if block["lang"] == "bash":
            run_bash(where, block["source"])
            continue
        code = compile("\n" * (block["line"] - 1) + block["source"], block["file"], "exec")
        try:
            exec(code, namespace)
        except BaseException:
            traceback.print_exc()
            raise SystemExit(f"{where}: the python block raised") from None
        sys.stdout.flush()


if __name__ == "__main__":
    main()
