import os
import sys

from kprof.cli import main

if len(sys.argv) < 2 or sys.argv[1] != "kernel-profile":
    asked = sys.argv[1:] in (["--help"], ["-h"])  # help asked for is an answer (stdout, 0), not a usage error
    (sys.stdout if asked else sys.stderr).write("usage: python -m launcher kernel-profile <verb> ...  (the same verbs "
                                                "as `kprof`; `python -m launcher kernel-profile --help` lists them)\n")
    sys.exit(0 if asked else 2)
sys.exit(main(sys.argv[2:], prog=(os.path.basename(sys.executable) or "python", "-m", "launcher", "kernel-profile"),
              program=True))
