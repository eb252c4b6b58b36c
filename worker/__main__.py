import sys

from worker.server import main

sys.exit(main())
