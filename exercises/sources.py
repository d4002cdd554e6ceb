"""Exercise C, the sources of a routed mode: the bookkeeping of delta_gpt.Stream.write (docs/exercises.md).

The S sublayers are cut into blocks of block_len sublayers (delta: 1, each sublayer its own block). As
sublayer k = 1, 2, ... writes its output v_k, keep
    blocks:  [e, b_1, b_2, ...]   the embedding e, then each completed block's source: the sum of its outputs
    partial: the current block's sum of outputs so far; None while the block is empty
A router reads e and the completed blocks, and the partial sum too when route_partial (attnres always;
delta_block with --route-partial) and it is not None.
Check it: make exercise-c (python -m pytest exercises/sources.py)
"""


def write(blocks, partial, v, k, block_len):
    """Sublayer k wrote v (B, T, D): return the new (blocks, partial)."""
    raise NotImplementedError("write(): add v to the partial sum; when sublayer k completes its block, "
                              "append the block's sum to blocks and start the next block empty")


def sources(blocks, partial, route_partial):
    """The list of tensors a router reads now, in order."""
    raise NotImplementedError("sources(): e and the completed blocks, then the partial sum if route_partial "
                              "and it is not None")
