"""The workers as the gateway sees them: the one async client, and the local worker processes."""
