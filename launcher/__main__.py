import os
import sys

from kprof.cli import main

if len(sys.argv) < 2 or sys.argv[1] != "kernel-profile":
    sys.stderr.write("usage: python -m launcher kernel-profile <verb> ...  (the same verbs as `kprof`)\n")
    sys.exit(2)
sys.exit(main(sys.argv[2:], prog=(os.path.basename(sys.executable) or "python", "-m", "launcher", "kernel-profile"),
              program=True))
