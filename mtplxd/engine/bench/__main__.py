"""`python -m mtplxd.engine.bench`: the AR-against-MTP decode bench (`bench.decode`)."""

import sys

from mtplxd.engine.bench.decode import main

sys.exit(main())
