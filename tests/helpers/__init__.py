"""What the tests share.

* :mod:`~tests.helpers.records`: a valid record of every kind (:func:`~tests.helpers.records.make_group` and the
  others), each with keyword overrides.
* :mod:`~tests.helpers.waiting`: :func:`~tests.helpers.waiting.wait_until`, the one way a test waits for something.
* :mod:`~tests.helpers.signing`: DHT records as hivemind builds and signs them, for the run's validators.
* :mod:`~tests.helpers.swarm`: peers as real processes on loopback (the ``procs`` fixture is in conftest.py).
* :mod:`~tests.helpers.p2p`: libp2p daemons of the test process on loopback.
* :mod:`~tests.helpers.intake`: honest groups sampled from the bundled model, for a learner's intake.
* :mod:`~tests.helpers.dict_swarm`: a peer's view of the DHT as a dict, for record choice without a network.
* :mod:`~tests.helpers.status`: the run ``hivegrpo status`` summarizes in the tests (its time and manifest).
* :mod:`~tests.helpers.strategies`: hypothesis strategies for every record kind, ways to break them, and junk.

``records``, ``waiting`` and ``swarm`` import only the standard library and ``peer.protocol`` at import time: the
processes in tests/procs use them too.
"""
