"""``hivegrpo demo``: a whole swarm on this machine on the bundled model and task (see docs/demo.md).

:mod:`peer.demo.swarm` starts and stops the child processes, :mod:`peer.demo.observer` follows and evaluates the
adapter, :mod:`peer.demo.report` draws the live table and the plots, :mod:`peer.demo.run` ties them together.
"""

from peer.demo.run import DemoConfig, run_demo

__all__ = ["DemoConfig", "run_demo"]
