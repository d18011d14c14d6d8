"""`python -m gateway.sim --engine vllm ...`: run one simulated engine."""

import sys

from gateway.sim.main import main

sys.exit(main())
