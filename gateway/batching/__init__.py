"""Continuous batching: the scheduler, the per-sequence state, finish rules, sessions and the stream writer."""
