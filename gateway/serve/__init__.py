"""`shardlm serve`: the command, its settings' sources, start-up and shutdown, the supervisor that restarts failed workers, and the OpenAI HTTP API's SMG router, a supervised child process."""
