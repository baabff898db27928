"""The minimal issue-2 benchmark: step time of gsync on 2 CPU devices vs one plain process vs
torch DDP (gloo, 2 processes), plus the 2-replica compute floor, in one run, with ratios.

    python bench/step_time.py            # = python bench/run.py --only step
    python bench/step_time.py --quick    # one repeat, fewer steps
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.run import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--only" or a.startswith("--only=") for a in argv):
        argv = ["--only", "step", *argv]
    sys.exit(main(argv))
