"""Tests of the ShardLM client SDKs."""
