import sys

from shardlm_server.worker.worker_server import main

sys.exit(main())
