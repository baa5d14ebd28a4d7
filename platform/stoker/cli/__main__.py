"""`python -m stoker.cli`: the `stoker` command."""

import sys

from stoker.cli.main import main

sys.exit(main())
