"""``python -m florg_tools.assets fetch ...`` (see ``florg_tools.assets.main``)."""

from __future__ import annotations

import sys

from florg_tools.assets import main

if __name__ == "__main__":
    sys.exit(main())
