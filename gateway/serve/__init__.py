"""`shardlm serve`: the command, its settings' sources, start-up and shutdown, and the supervisor that restarts failed workers."""
