import sys

from headstart.cli import main

sys.exit(main())
