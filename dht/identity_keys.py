"""A peer's identity key: the libp2p RSA key its peer id is the hash of, and what it signs.

A libp2p peer id is the multihash of the peer's protobuf-encoded public key (for RSA keys, the
sha2-256 one), so anyone holding a public key knows whose it is, and a signature that verifies with
it speaks for that peer id: no key directory, no trust in whoever relayed it. p2pd runs with the
same key (node/p2p/network.py checks that the peer id it announces is this key's), so the peer the
swarm routes to is the peer that signs. docs/security.md, "The identity key (b)", tells why.

Keys are RSA only, 2048 to 4096 bits (`RSA_KEY_BITS`): a verification a stranger can make us do
costs at most an RSA-4096 one. Signatures are PKCS#1 v1.5 over SHA-256, what libp2p's RSA keys sign
with. Each user of the key signs its own byte layout under its own domain tag, so that no signature
can pass for another kind: DHT record envelopes (dht/signing.py, `SIGNATURE_DOMAIN`), the
direct-link handshake (node/p2p/direct.py, `LABEL`) and a relay's pairing answers
(node/p2p/relay.py, `pair_signed`).

`Identity` is this peer's private key: generated, or read from and written to a libp2p private key
file (node/p2p/identity_store.py chooses which file and holds it for the process). `verify_signature`
and `signer_of` are the checks on anyone else's key; parsed public keys are cached, since a swarm has
few signers and every record carries its signer's key.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections import OrderedDict

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.proto import crypto_pb2

# Bounds the cost of a verification a stranger can make us do (RSA verify grows with the modulus).
RSA_KEY_BITS = (2048, 4096)

_PADDING = padding.PKCS1v15()  # what libp2p's RSA keys sign with
_HASH = hashes.SHA256()


class SignatureError(ValueError):
    """A signature does not verify, or the public key it comes with is not one we accept: a DHT
    value that is not a well-formed envelope validly signed by the peer it claims to be from, a
    handshake not signed by the peer it names."""


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id (base58) of a protobuf-encoded public key: the identity multihash of keys
    of up to 42 bytes, the sha2-256 multihash of longer ones (every RSA key)."""
    if len(public_key) <= 42:
        digest = b"\x00" + bytes([len(public_key)]) + public_key
    else:
        digest = b"\x12\x20" + hashlib.sha256(public_key).digest()
    return base58.b58encode(digest).decode()


class _PublicKeyCache:
    """Parsed public keys by their bytes: a swarm has few signers and parsing is per record otherwise."""

    def __init__(self, size: int = 1024):
        self.size = size
        self._keys: OrderedDict[bytes, tuple[rsa.RSAPublicKey, str]] = OrderedDict()
        self._lock = threading.Lock()  # hivemind may validate from more than one thread

    def get(self, public_key: bytes) -> tuple[rsa.RSAPublicKey, str]:
        with self._lock:
            if public_key in self._keys:
                self._keys.move_to_end(public_key)
                return self._keys[public_key]
        parsed = (_parse_public_key(public_key), peer_id_from_public_key(public_key))
        with self._lock:
            self._keys[public_key] = parsed
            while len(self._keys) > self.size:
                self._keys.popitem(last=False)
        return parsed


def _parse_public_key(public_key: bytes) -> rsa.RSAPublicKey:
    try:
        message = crypto_pb2.PublicKey.FromString(public_key)
        if message.key_type != crypto_pb2.KeyType.RSA:
            raise SignatureError(f"signer key type {message.key_type} is not RSA")
        key = serialization.load_der_public_key(message.data)
    except SignatureError:
        raise
    except Exception as e:  # protobuf and DER parsers raise a variety of errors on garbage
        raise SignatureError(f"signer public key does not parse: {type(e).__name__}") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise SignatureError("signer public key is not an RSA key")
    if not RSA_KEY_BITS[0] <= key.key_size <= RSA_KEY_BITS[1]:
        raise SignatureError(f"signer RSA key has {key.key_size} bits, outside {RSA_KEY_BITS}")
    return key


_public_keys = _PublicKeyCache()


class Identity:
    """This peer's libp2p identity key. p2pd runs with the same key, so the peer id it announces is
    the one records signed here verify against."""

    def __init__(self, private_key: rsa.RSAPrivateKey):
        if not isinstance(private_key, rsa.RSAPrivateKey):
            raise TypeError("only RSA identities are supported")
        self._private_key = private_key
        der = private_key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        # the exact serialization p2pd hashes into the peer id (hivemind's PeerID.from_identity)
        self.public_key = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
        self.peer_id = peer_id_from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(rsa.generate_private_key(public_exponent=65537, key_size=2048))

    @classmethod
    def from_file(cls, path: str) -> Identity:
        """Read a libp2p private key file (what `P2P.generate_identity` and `--identity` write)."""
        with open(path, "rb") as f:
            raw = f.read(64 * 1024)
        try:
            message = crypto_pb2.PrivateKey.FromString(raw)
        except Exception as e:
            raise ValueError(f"{path} is not a libp2p private key file ({type(e).__name__})") from None
        if message.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError(
                f"{path} holds a {crypto_pb2.KeyType.Name(message.key_type)} key; "
                "pipeswarm signs records with RSA identities only (delete it to get a new one)"
            )
        try:
            key = serialization.load_der_private_key(message.data, password=None)
        except Exception as e:
            raise ValueError(f"{path}: the RSA key does not parse ({type(e).__name__})") from None
        return cls(key)  # type: ignore[arg-type]

    def save(self, path: str) -> None:
        """Write the key as a libp2p private key file readable by its owner only."""
        der = self._private_key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
        raw = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)

    def save_temporary(self) -> tuple[str, str]:
        """Write the key into a fresh private directory: (directory, file) for p2pd to read once."""
        directory = tempfile.mkdtemp(prefix="pipeswarm-identity-")
        path = os.path.join(directory, "identity.key")
        self.save(path)
        return directory, path

    def sign(self, data: bytes) -> bytes:
        return self._private_key.sign(data, _PADDING, _HASH)


def signer_of(public_key: bytes) -> str:
    """The peer id of a libp2p public key we accept (RSA, `RSA_KEY_BITS`); SignatureError for any
    other key or junk. Cheap for a key seen before: the parsed key is cached."""
    return _public_keys.get(public_key)[1]


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> str:
    """The peer id whose libp2p key signed `data`; SignatureError if it did not (or the key is junk).
    The caller bounds the sizes (a direct-link hello is at most 4 KiB, node/p2p/direct.py)."""
    verifying_key, signer = _public_keys.get(public_key)
    try:
        verifying_key.verify(signature, data, _PADDING, _HASH)
    except (InvalidSignature, ValueError):
        raise SignatureError(f"signature of {signer} does not verify") from None
    return signer
