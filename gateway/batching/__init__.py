"""Continuous batching: the scheduler, the per-sequence state, the worker step requests,
finish rules, sessions and the stream writer."""
