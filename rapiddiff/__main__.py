import sys

from rapiddiff.cli import main

sys.exit(main())
