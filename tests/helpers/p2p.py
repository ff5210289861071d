"""libp2p daemons of this process on loopback, for tests of the protocols served over them (blobs, spreading)."""

P2P_KW = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False)
"""Options of ``hivemind.p2p.P2P.create`` for a daemon on loopback only, without relays."""


async def with_peers(n_clients: int, scenario) -> None:
    """Run ``scenario(server_p2p, clients)`` with ``n_clients`` daemons joined to the server's; shut all down."""
    from hivemind.p2p import P2P

    server_p2p = await P2P.create(**P2P_KW)
    clients = []
    try:
        for _ in range(n_clients):
            clients.append(await P2P.create(initial_peers=await server_p2p.get_visible_maddrs(), **P2P_KW))
        await scenario(server_p2p, clients)
    finally:
        for p2p in [*clients, server_p2p]:
            await p2p.shutdown()
