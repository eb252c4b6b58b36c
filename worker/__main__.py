import sys

from worker.worker_server import main

sys.exit(main())
