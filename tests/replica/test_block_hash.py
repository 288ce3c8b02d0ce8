import struct

import pytest
import xxhash

from kvroute.replica.block_hash import HashSpec, hash_block, hash_blocks, root_hash


def test_golden_vectors_pin_the_function():
    spec = HashSpec(4, 0)
    assert root_hash(spec) == 0x793CBD294FF73FD4D378E875156CACD1
    assert hash_blocks(spec, list(range(10))) == [
        0x6FD9A8EBA06F6058D1D240547038BC61,
        0x07109868293DED40C1C3900BAA8F4F33,
    ]
    spec = HashSpec(16, 12345, "smollm2-135m-instruct")
    assert root_hash(spec, "tenant-a") == 0xAEBE92E4E8A5C3A27045C070C564C04A
    assert hash_blocks(spec, list(range(100, 132)), cache_salt="tenant-a") == [
        0x134F45EAC5C11669F6F81261CB8274F4,
        0x47F1BCB1FDED2129D0F455F8F672EBFA,
    ]


def test_chain_matches_the_written_contract():
    spec = HashSpec(2, 7, "m")
    tokens = [5, 70000, 3, 2**32 - 1]
    parent = root_hash(spec)
    expected = []
    for i in range(2):
        data = parent.to_bytes(16, "little") + struct.pack("<2I", *tokens[2 * i : 2 * i + 2])
        parent = xxhash.xxh3_128_intdigest(data, 7)
        expected.append(parent)
    assert hash_blocks(spec, tokens) == expected
    assert hash_block(spec, root_hash(spec), tokens[:2]) == expected[0]


def test_only_full_blocks_are_hashed_and_extension_is_incremental():
    spec = HashSpec(4, 1)
    tokens = list(range(23))
    full = hash_blocks(spec, tokens)
    assert len(full) == 5
    head = hash_blocks(spec, tokens[:8])
    tail = hash_blocks(spec, tokens[8:20], parent=head[-1])
    assert head + tail == full[:5]


def test_salt_model_and_seed_separate_tenants():
    tokens = list(range(32))
    base = hash_blocks(HashSpec(16, 0, "m"), tokens)
    assert hash_blocks(HashSpec(16, 0, "m"), tokens, cache_salt="a") != base
    assert hash_blocks(HashSpec(16, 0, "m"), tokens, cache_salt="a") != hash_blocks(HashSpec(16, 0, "m"), tokens, cache_salt="b")
    assert hash_blocks(HashSpec(16, 1, "m"), tokens) != base
    assert hash_blocks(HashSpec(16, 0, "other"), tokens) != base
    # An empty salt is a salt: it is not the same as no salt.
    assert hash_blocks(HashSpec(16, 0, "m"), tokens, cache_salt="") != base


@pytest.mark.parametrize("kwargs", [dict(block_size=0), dict(block_size=16, seed=-1), dict(block_size=16, seed=2**64)])
def test_bad_spec(kwargs):
    with pytest.raises(ValueError):
        HashSpec(**kwargs)


def test_bad_tokens():
    spec = HashSpec(2)
    with pytest.raises(ValueError, match="unsigned 32-bit"):
        hash_blocks(spec, [1, -1])
    with pytest.raises(ValueError, match="exactly 2"):
        hash_block(spec, root_hash(spec), [1, 2, 3])
