"""The wire protocol version. Bump it on any incompatible change to messages, codec or records."""

# 2: signed DHT envelopes, microbatch tokens, MACed frames in private swarms; 3: gossip rounds carry
# 4-bit Delta codes and a strided phi sample; 4: phi as residues on a dithered grid (node/averaging/gossip_codec.py)
# 5: spot-checks replay a real hop at the replica's committed weights (CHECK/AUDIT, COMMITMENT, OPEN, OPENING)
# 6: the subspace hop codecs (protocol/subspace.py); a FORWARD carries the hidden states only (no targets)
# 7: a stage's state carries its inner AdamW's moments (protocol/stage_state.py)
# 8: token anchors of a subspace hop at std 0.5, not 0.02 (protocol/subspace.py ANCHOR_STD)
PROTOCOL_VERSION = 8
