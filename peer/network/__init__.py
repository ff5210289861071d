"""Networking for peers: joining the DHT, buckets, blob transfer, heartbeats. No torch here.

Import what you need from the submodules (for example ``peer.network.blobs``); this package imports nothing itself.
"""
