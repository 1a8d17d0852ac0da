"""The wire protocol version. Bump it on any incompatible change to messages, codec or records."""

PROTOCOL_VERSION = 1
