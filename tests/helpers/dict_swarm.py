"""A peer's view of the DHT as a dict, for unit tests of record choice (admission, credit): ``get_dict`` returns
``subkey -> item with .value`` the way hivemind does, ``store`` keeps the value; keys and signatures stay real."""

from types import SimpleNamespace

from hivemind.utils.crypto import RSAPrivateKey


class DictSwarm:
    """``records[key][subkey] = value``; ``reads`` counts ``get_dict`` calls."""

    def __init__(self, key: RSAPrivateKey, run_id: str, peer_id: str = "QmSelf"):
        self.run_id = run_id
        self.signing_key = key
        self.public_key = key.get_public_key().to_bytes()
        self.peer_id = peer_id
        self.records: dict[str, dict[bytes, object]] = {}
        self.reads = 0

    def get_dict(self, key, **_):
        self.reads += 1
        return {k: SimpleNamespace(value=v) for k, v in self.records.get(key, {}).items()}

    def store(self, key, subkey, value, expires, what):
        self.records.setdefault(key, {})[subkey] = value
        return True

    def store_many(self, items, what, **_):
        return [self.store(key, subkey, value, expires, what) for key, subkey, value, expires in items]


def run_keys() -> SimpleNamespace:
    """A host's, a learner's and a stranger's RSA keys."""
    return SimpleNamespace(host=RSAPrivateKey(), learner=RSAPrivateKey(), stranger=RSAPrivateKey())


def public(key: RSAPrivateKey) -> bytes:
    return key.get_public_key().to_bytes()
