"""`python -m weightsync.app.cli`: the `weightsync` command."""

import sys

from weightsync.app.cli import main

sys.exit(main())
