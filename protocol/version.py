"""The wire protocol version. Bump it on any incompatible change to messages, codec or records."""

PROTOCOL_VERSION = 2  # 2: signed DHT envelopes, microbatch tokens, MACed frames in private swarms
