"""``python -m florg_tools.flwr_home setup ...`` (see ``florg_tools.flwr_home.cli.main``)."""

from __future__ import annotations

import sys

from florg_tools.flwr_home.cli import main

if __name__ == "__main__":
    sys.exit(main())
