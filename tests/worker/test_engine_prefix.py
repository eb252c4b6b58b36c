"""A sequence the engine has never seen, prefilled on top of blocks another sequence wrote (a
prefix the gateway cached): the same logits and tokens as computing it all, in float32 on CPU."""

from __future__ import annotations

import pytest
import torch

from shardlm_server.worker.engine import DecodeItem, Engine, PrefillItem
from shardlm_server.worker.errors import InvalidRequestError, SequenceNotCachedError
from shardlm_server.worker.kv_cache import CacheConfig
from shardlm_server.worker.sampling import SamplerSettings

BLOCK = 4


@pytest.fixture(scope="module")
def engine(llama_dir):
    return Engine.load(llama_dir, dtype="float32",
                       cache_config=CacheConfig(block_size=BLOCK, num_blocks=64))


def test_prefill_on_a_shared_prefix_matches_the_full_computation(engine):
    engine.reset()
    shared = [1, 17, 300, 45, 9, 12, 801, 64]  # two full blocks
    mine = shared + [5, 77, 31]
    engine.prefill([PrefillItem(1, shared + [400, 2, 3], 0, [0, 1, 2])])
    sampling = SamplerSettings(temperature=0.8, seed=3, repetition_penalty=1.3)
    reused = engine.prefill([PrefillItem(2, mine[8:], 8, [0, 1, 10], sampling=sampling,
                                         prefix_token_ids=shared)], taps=["logits"])
    full = engine.prefill([PrefillItem(3, mine, 0, [20, 21, 22], sampling=sampling)],
                          taps=["logits"])
    torch.testing.assert_close(reused.taps["logits"], full.taps["logits"], atol=1e-5, rtol=0)
    assert reused.tokens[0].token.token_id == full.tokens[0].token.token_id
    assert engine.sequences[2].tokens == mine
    steps = [list(engine.decode([DecodeItem(sid, table, 6)], 6))
             for sid, table in ((2, [0, 1, 10, 11, 12]), (3, [20, 21, 22, 23, 24]))]
    ids = [[o.tokens[0].token.token_id for o in run] for run in steps]
    assert ids[0] == ids[1]


def test_prefix_ids_must_cover_the_start_position(engine):
    engine.reset()
    with pytest.raises(InvalidRequestError, match="prefix_token_ids"):
        engine.prefill([PrefillItem(1, [5], 8, [0, 1, 2], prefix_token_ids=[1, 2, 3])])
    with pytest.raises(SequenceNotCachedError):
        engine.prefill([PrefillItem(1, [5], 8, [0, 1, 2])])
