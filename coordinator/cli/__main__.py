"""`python -m lockgate.coordinator.cli`: the `lockgate` command."""

import sys

from lockgate.coordinator.cli.main import main

sys.exit(main())
