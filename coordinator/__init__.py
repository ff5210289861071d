"""Hosting a swarm: bootstrap peer, run manifest, model seeding, invites and status.

May import ``peer``; ``peer`` never imports this package.
"""
