"""The one exception the wire layer raises for anything a peer sent that we cannot accept."""


class ProtocolError(ValueError):
    """Malformed, oversized, mismatched or unsupported input from the wire.

    Callers catch exactly this to drop or penalise a peer; any other exception escaping a decoder
    is a bug in this package, not a property of the input.
    """
