"""`python -m shardlm ...` is the `shardlm` command."""

import sys

from shardlm.cli import main

sys.exit(main())
