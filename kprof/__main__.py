import sys

from kprof.cli import main

sys.exit(main())
