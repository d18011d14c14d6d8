"""`python -m gateway.cli`: the shapegate command, as the console script runs it."""

import sys

from gateway.cli.main import main

sys.exit(main())
