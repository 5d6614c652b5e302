"""Session keys: made unguessable, kept only as digests.

The trajectory store is the file researchers copy and share, so it holds a key's SHA-256, never
the key: a request's key is digested and looked up. A store written before keys were digested
holds them plain; those are digested when loaded and keep working.
"""

from __future__ import annotations

import hashlib
import secrets

SESSION_KEY_PREFIX = "lg-sk-"
# A run's enrolment key (client-driven rollouts, api/enrolment.py): it creates sessions, nothing
# else, so it says so in its prefix and is never mistaken for a session's key.
ENROLMENT_KEY_PREFIX = "lg-ek-"
_DIGEST_PREFIX = "sha256:"


def new_session_key() -> str:
    """A fresh session key: 192 random bits, after a prefix that says what it is."""
    return SESSION_KEY_PREFIX + secrets.token_urlsafe(24)


def new_enrolment_key() -> str:
    """A fresh enrolment key: as unguessable as a session key, with its own prefix."""
    return ENROLMENT_KEY_PREFIX + secrets.token_urlsafe(24)


def key_digest(key: str) -> str:
    """What the store and the gateway keep of `key`."""
    return _DIGEST_PREFIX + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def stored_digest(stored: str) -> str:
    """The digest of a key as a store holds it: already a digest, or a plain key of an older
    store."""
    return stored if stored.startswith(_DIGEST_PREFIX) else key_digest(stored)
